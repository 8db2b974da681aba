"""A frame as text: a header, one line per worker, notes on the ones not up, streams
(layer L4).

Pure: rows in, lines out, so the screen, ``--once`` and the tests all show the same
thing. Each line says whether it needs the eye (``alert``): the screen shows those in
reverse video.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from asyncrpc.top.board import HISTORY, UP, Row, StreamRow

__all__ = ["Line", "frame", "text"]

_COLUMNS = (  # (title, width), right-aligned but for the first three
    ("WORKER", 10), ("RANK", 4), ("STATE", 7), ("OUT/s", 8), ("IN/s", 8), ("P50", 8),
    ("P99", 8), ("PEND", 5), ("RUN", 4), ("RX B/s", 8), ("TX B/s", 8), ("POOL", 7),
    ("LAG", 7), ("LOST", 0),
)  # fmt: skip
_BAR = HISTORY  # scrapes in a stream line's strip
_LEVELS = ":-=#"  # a quarter of the strip's peak rate, a half, three quarters, the peak


@dataclass(frozen=True, slots=True)
class Line:
    text: str
    alert: bool = False


def _si(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}" if value >= 10 or value == 0 else f"{value:.1f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f}us"
    if value < 1.0:
        return f"{value * 1e3:.1f}ms"
    return f"{value:.2f}s"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _pool(row: Row) -> str:
    if row.pool_busy is None or row.pool_size is None:
        return "-"
    busy = f"{row.pool_busy:.0f}/{row.pool_size:.0f}"
    return busy if not row.pool_queued else f"{busy}+{row.pool_queued:.0f}"


def _cells(row: Row) -> list[str]:
    lag = "-" if row.lag_ms is None else f"{row.lag_ms:.1f}ms"
    return [
        row.worker, row.rank, row.state, _si(row.calls_out), _si(row.calls_in),
        _seconds(row.p50), _seconds(row.p99), _count(row.pending), _count(row.running),
        _si(row.bytes_in), _si(row.bytes_out), _pool(row), lag, " ".join(row.lost) or "-",
    ]  # fmt: skip


def _join(cells: Sequence[str]) -> str:
    parts = []
    for i, (cell, (_, width)) in enumerate(zip(cells, _COLUMNS, strict=True)):
        parts.append(cell.ljust(width) if i < 3 or width == 0 else cell.rjust(width))
    return " ".join(parts).rstrip()


def _note(row: Row) -> str | None:
    said = [row.reason] if row.state != UP and row.reason else []
    if row.lost_by:
        said.append("lost by " + " ".join(row.lost_by))
    if not said:
        return None
    where = f" ({row.url})" if row.url and row.worker == "?" else ""
    return f"  ^ {row.worker}{where}: " + "; ".join(said)


def _strip(history: Sequence[float]) -> str:
    # A stream's length is not known to the metrics (a generator ends when it ends), so
    # no bar can show how much is done. What is known is whether items move and how fast:
    # one cell per scrape (oldest left), "." where no item moved, else its rate in four
    # steps of the strip's own peak. A stall reads as dots coming in from the right.
    peak = max(history, default=0.0)
    cells = [
        "." if rate <= 0 or peak <= 0 else _LEVELS[min(3, int(4 * rate / peak - 1e-9))]
        for rate in history
    ]
    return "".join(cells).rjust(_BAR)


def _stream_line(stream: StreamRow) -> Line:
    stalled = stream.still_for is not None and stream.still_for > 0 and not stream.items_per_s
    moving = f"{_si(stream.items_per_s)} items/s"
    state = f"no item for {stream.still_for:.0f}s" if stalled else moving
    return Line(
        f"  {stream.worker:<10} {stream.open} open  [{_strip(stream.history[-_BAR:])}]  "
        f"{_si(stream.items)} items so far  {state}",
        alert=stalled,
    )


def frame(
    rows: Sequence[Row], *, interval: float, wall: float | None = None,
    notes: Sequence[str] = (),
) -> list[Line]:  # fmt: skip
    """The lines of one frame.

    Args:
        rows: the board's rows.
        interval: the refresh period, for the header.
        wall: the time to show (``time.time()`` when None).
        notes: lines to show under the header, marked (the store is not answering).

    Returns:
        The lines, the header first.
    """
    stamp = time.strftime("%H:%M:%S", time.localtime(time.time() if wall is None else wall))
    watched = [row for row in rows if row.url]  # not the lost ones only others name
    up = sum(row.state == UP for row in watched)
    sizes = {row.world_size for row in rows if row.world_size}
    world = f", world size {'/'.join(sorted(sizes))}" if sizes else ""
    lines = [
        Line(f"asyncrpc top  {stamp}  {up}/{len(watched)} up{world}  every {interval:g}s"),
    ]
    lines += [Line(f"  ! {note}", alert=True) for note in notes]
    lines.append(Line(_join([title for title, _ in _COLUMNS])))
    for row in rows:
        lines.append(Line(_join(_cells(row)), alert=row.state != UP or bool(row.lost_by)))
        note = _note(row)
        if note:
            lines.append(Line(note, alert=True))
    streams = [row.stream for row in rows if row.stream is not None]
    if streams:
        lines.append(Line(""))
        lines.append(Line("STREAMS"))
        lines += [_stream_line(stream) for stream in streams]
    return lines


def text(lines: Sequence[Line]) -> str:
    """The lines as plain text, one per line."""
    return "\n".join(line.text for line in lines) + "\n"
