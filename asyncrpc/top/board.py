"""The state of every watched endpoint, and the rows of a frame (layer L4).

A ``Board`` keeps the last few seconds of good scrapes of each endpoint and what became
of its latest try. A worker whose endpoint stops answering within the scrape timeout is
HUNG (it took the connection but said nothing: a stopped process, or one whose Python
threads cannot run), one that refuses the connection is DOWN; both are known from the
first failed scrape, without waiting for the group's own heartbeats. The group's verdict
is shown beside it: the workers whose ``lost_peers`` name it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from asyncrpc.top.figures import Figures, quantile, rate

__all__ = ["Attempt", "Board", "Endpoint", "Row", "StreamRow"]

UP, HUNG, DOWN, ERROR, WAITING = "up", "HUNG", "DOWN", "ERROR", "waiting"
IDLE = "idle"  # the endpoint answers, but no worker runs in its process
HISTORY = 12  # scrapes of stream movement a stream line shows


@dataclass(frozen=True, slots=True)
class Attempt:
    """The outcome of one scrape: figures, or the state it shows and why."""

    at: float  # time.monotonic() when it ended
    figures: Figures | None = None
    state: str = UP
    reason: str = ""


class Endpoint:
    """One ``/metrics`` URL: its recent good scrapes and its latest outcome."""

    def __init__(self, url: str, window: float) -> None:
        self.url = url
        self.window = window
        self.good: deque[tuple[float, Figures]] = deque()
        self.last: Attempt | None = None
        self.last_good_at: float | None = None
        # When its stream items last moved: a stall can outlast the window of scrapes.
        self.items_moved_at: float | None = None
        self._items: float | None = None
        self._items_at: float | None = None
        # Items/s between each two good scrapes, newest last: the stream line's strip.
        self.items_history: deque[float] = deque(maxlen=HISTORY)

    def record(self, attempt: Attempt) -> None:
        self.last = attempt
        if attempt.figures is None:
            return
        self.last_good_at = attempt.at
        items = _items(attempt.figures)
        if self._items is not None and self._items_at is not None and attempt.at > self._items_at:
            # A restarted worker's counters begin again: no movement is made of that.
            moved = max(0.0, items - self._items)
            self.items_history.append(moved / (attempt.at - self._items_at))
        if items != self._items:
            self.items_moved_at = attempt.at
        self._items, self._items_at = items, attempt.at
        self.good.append((attempt.at, attempt.figures))
        # Keep the newest scrape and those within the window before it (at least two).
        while len(self.good) > 2 and attempt.at - self.good[1][0] >= self.window:
            self.good.popleft()

    @property
    def name(self) -> str:
        return self.good[-1][1].worker if self.good else ""


@dataclass(frozen=True, slots=True)
class StreamRow:
    """A worker's streams: how many are open, and whether their items move."""

    worker: str
    open: int
    items: float  # sent and received so far, by all its streams, ended ones too
    items_per_s: float | None
    still_for: float | None  # seconds with streams open and no item moved, or None
    history: tuple[float, ...] = ()  # items/s between each two scrapes, newest last


@dataclass(frozen=True, slots=True)
class Row:
    """One worker's line in a frame; None where a figure is unknown."""

    worker: str
    rank: str
    url: str
    state: str
    reason: str
    calls_out: float | None = None  # calls made per second
    calls_in: float | None = None  # requests served per second
    p50: float | None = None  # seconds, of the calls it made that ended in the window
    p99: float | None = None
    pending: float | None = None  # its calls awaiting replies
    running: float | None = None  # requests it is serving
    bytes_in: float | None = None  # per second
    bytes_out: float | None = None
    pool_busy: float | None = None
    pool_size: float | None = None
    pool_queued: float | None = None  # only if the worker exports it
    lag_ms: float | None = None
    lost: tuple[str, ...] = ()  # peers it lost
    lost_by: tuple[str, ...] = ()  # workers that lost it
    world_size: str = ""
    stream: StreamRow | None = None


class Board:
    """Every watched endpoint, in the order given."""

    def __init__(self, urls: Sequence[str], window: float = 5.0) -> None:
        self.window = window
        self.endpoints = [Endpoint(url, window) for url in urls]

    @property
    def urls(self) -> list[str]:
        return [endpoint.url for endpoint in self.endpoints]

    def watch(self, urls: Sequence[str]) -> None:
        """Watch ``urls`` from now on, in that order; an endpoint watched already keeps
        its history (the group's endpoints, read again from its store)."""
        had = {endpoint.url: endpoint for endpoint in self.endpoints}
        self.endpoints = [had.get(url) or Endpoint(url, self.window) for url in urls]

    def record(self, attempts: Iterable[Attempt]) -> None:
        for endpoint, attempt in zip(self.endpoints, attempts, strict=True):
            endpoint.record(attempt)

    def rows(self, now: float) -> list[Row]:
        """One row per endpoint, then one per lost worker no endpoint of ours serves."""
        rows = [_row(endpoint, now) for endpoint in self.endpoints]
        lost_by: dict[str, list[str]] = {}
        for row in rows:
            if row.state == UP:  # a hung worker's last word on others is stale
                for peer in row.lost:
                    lost_by.setdefault(peer, []).append(row.worker)
        known = {row.worker for row in rows}
        rows = [
            dataclasses.replace(row, lost_by=tuple(lost_by.get(row.worker, ()))) for row in rows
        ]
        for peer in sorted(set(lost_by) - known):
            rows.append(_unwatched(peer, tuple(lost_by[peer])))
        return rows


def _unwatched(worker: str, lost_by: tuple[str, ...]) -> Row:
    return Row(worker, "", "", "LOST", "not watched here", lost_by=lost_by)


def _row(endpoint: Endpoint, now: float) -> Row:
    last = endpoint.last
    state = WAITING if last is None else last.state
    reason = "" if last is None else last.reason
    if state != UP and endpoint.last_good_at is not None:
        reason = f"{reason}; last answer {now - endpoint.last_good_at:.1f}s ago"
    if not endpoint.good:
        return Row("?", "", endpoint.url, state, reason)
    t_new, new = endpoint.good[-1]
    t_old, old = endpoint.good[0]
    seconds = t_new - t_old
    if state != UP:
        # What it said last is not what it does now: its name and the peers it had lost
        # are kept, no figure is shown as if current.
        return Row(new.worker or "?", new.rank, endpoint.url, state, reason, lost=new.lost,
                   world_size=new.world_size)  # fmt: skip
    since = old.latency if seconds > 0 else {}

    def per_s(key: str) -> float | None:
        return rate(old, new, key, seconds)

    return Row(
        worker=new.worker or "?",
        rank=new.rank,
        url=endpoint.url,
        state=state,
        reason=reason,
        calls_out=per_s("calls_sent_total"),
        calls_in=per_s("calls_received_total"),
        p50=quantile(0.5, new.latency, since),
        p99=quantile(0.99, new.latency, since),
        pending=new.get("pending_calls"),
        running=new.get("running_requests"),
        bytes_in=per_s("bytes_in_total"),
        bytes_out=per_s("bytes_out_total"),
        pool_busy=new.get("thread_pool_busy"),
        pool_size=new.get("thread_pool_size"),
        pool_queued=new.get("thread_pool_queued"),
        lag_ms=new.get("loop_lag_ms"),
        lost=new.lost,
        lost_by=(),
        world_size=new.world_size,
        stream=_streams(endpoint),
    )


def _items(figures: Figures) -> float:
    return (figures.get("stream_items_sent_total") or 0.0) + (
        figures.get("stream_items_received_total") or 0.0
    )


def _streams(endpoint: Endpoint) -> StreamRow | None:
    t_new, new = endpoint.good[-1]
    t_old, old = endpoint.good[0]
    opened = (new.get("streams_consuming") or 0.0) + (new.get("streams_producing") or 0.0)
    if not opened:
        return None
    items = _items(new)
    per_s = (items - _items(old)) / (t_new - t_old) if t_new > t_old else None
    moved = endpoint.items_moved_at
    still = t_new - moved if moved is not None and len(endpoint.good) > 1 else None
    return StreamRow(new.worker, int(opened), items, per_s, still, tuple(endpoint.items_history))
