"""asyncio tests of the graceful shutdown's verdict on lost peers (a stub host and store)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrpc.errors import (
    RemoteProtocolError,
    ShutdownError,
    ShutdownTimeoutError,
    WorkersLostError,
)
from asyncrpc.protocol.wire import FrameDecoder
from asyncrpc.protocol.wire.messages import BarrierOpened, decode_message
from asyncrpc.runtime.group.shutdown import TAGS, BarrierNews, GracefulShutdown, shutdown_limit

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


class ScriptedGroup:
    """A store group whose ``missing`` answers follow a script, then stay at the last one."""

    def __init__(self, *answers: list[int]) -> None:
        self._answers = list(answers)
        self.arrived: list[str] = []
        self.declared: set[int] = set()  # ranks some worker recorded as dead
        self.reads = 0
        self.lost_reads = 0
        self.found: list[list[int]] = []  # the addresses read (find_all), per request
        self.dynamic = False  # a static group: shutdown runs its barriers
        self.opened_here: dict[str, bool] = {}  # it never completes a barrier itself

    def reach(self, tag: str) -> None:
        self.arrived.append(tag)

    def missing(self, tag: str, ranks: list[int] | None = None) -> list[int]:
        self.reads += 1
        answer = self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]
        return [r for r in answer if ranks is None or r in ranks]

    def await_arrivals(self, tag: str, ranks: list[int], seconds: float) -> bool:
        """A wait is a read too; it returns at once unless a worker is missing."""
        missing = self.missing(tag, ranks)
        if missing:
            time.sleep(min(seconds, 0.01))
        return not missing

    def declare_lost(self, rank: int) -> None:
        self.declared.add(rank)

    def count_dead(self, tag: str, rank: int) -> bool:
        return True

    def lost_ranks(self) -> list[int]:
        self.lost_reads += 1
        return sorted(self.declared)

    def declared_lost(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if r in self.declared]

    def find_all(self, ranks: list[int]) -> list[Any]:
        self.found.append(ranks)
        return [SimpleNamespace(name=f"w{r}", rank=r) for r in ranks]


class NoRRefs:
    """An RRef service that holds no reference."""

    def release_all_users(self) -> None:
        pass

    def quiescent(self) -> bool:
        return True

    def owner_leaks(self) -> list[Any]:
        return []

    def report_leaks(self) -> None:
        pass


def _opened(pieces: list[Any]) -> BarrierOpened:
    (frame,) = FrameDecoder().feed(b"".join(bytes(p) for p in pieces))
    message = decode_message(frame.fields)
    assert isinstance(message, BarrierOpened)
    return message


class CompletingGroup(ScriptedGroup):
    """A group in which this worker's arrival is the last one, at every barrier."""

    def reach(self, tag: str) -> None:
        super().reach(tag)
        self.opened_here[tag] = False  # nobody was counted dead


class StubHost:
    """A worker of rank 1 in a group of 3, with nothing in flight and no RRef held: the
    parts the rounds are built from (its liveness is itself)."""

    def __init__(
        self, store: ScriptedGroup, lost: set[int], connected: frozenset[int] = frozenset()
    ) -> None:
        addresses = {r: SimpleNamespace(name=f"w{r}", rank=r) for r in range(3)}
        self.group: Any = SimpleNamespace(
            store=store,
            directory=SimpleNamespace(learn=lambda a: addresses.__setitem__(a.rank, a)),
            name="w1",
            rank=1,
            world_size=3,
            addresses=addresses,
            dynamic=store.dynamic,
        )
        self.rrefs: Any = NoRRefs()
        self._lost = lost
        self._connected = connected
        self.probed: list[int] = []
        self.told: list[tuple[int, BarrierOpened]] = []  # BarrierOpened frames sent
        self.unsent_for = 0  # looks a told frame stays waiting for its connection
        self.unsent_polls: dict[int, int] = {}
        self.unsent_asked: list[list[int]] = []

    def calls_in_flight(self) -> int:
        return 0

    def requests_running(self) -> int:
        return 0

    def is_lost(self, rank: int) -> bool:
        return rank in self._lost

    def is_connected(self, rank: int) -> bool:
        return rank in self._connected

    def probe(self, rank: int) -> None:
        self.probed.append(rank)
        if rank not in self._connected:
            self._lost.add(rank)  # as if it refused the connection

    def control(self, rank: int, pieces: list[Any], connect: bool = False) -> None:
        assert connect  # a child never talked to is dialled
        self.told.append((rank, _opened(pieces)))
        self.unsent_polls[rank] = self.unsent_for  # "connecting" for that many looks

    def unsent(self, ranks: list[int]) -> bool:
        waiting = [r for r in ranks if self.unsent_polls.get(r, 0) > 0]
        for rank in waiting:
            self.unsent_polls[rank] -= 1
        self.unsent_asked.append(list(ranks))
        return bool(waiting)


def _rounds(host: StubHost, news: BarrierNews | None = None) -> GracefulShutdown:
    return GracefulShutdown(
        host.group, rrefs=host.rrefs, liveness=host, calls_in_flight=host.calls_in_flight,
        requests_running=host.requests_running, news=news,
    )  # fmt: skip


def _shutdown(group: ScriptedGroup, lost: set[int]) -> GracefulShutdown:
    return _rounds(StubHost(group, lost))


async def test_GracefulShutdown_peer_that_arrived_then_left_is_not_dead() -> None:
    # w2 was missing at the first read, then arrived and closed its connections before
    # the liveness check: the second read of the store shows it arrived.
    group = ScriptedGroup([2], [])
    rounds = _shutdown(group, lost={2})
    await rounds.run(5.0)
    assert group.arrived == ["calls-done", "users-released", "closing", "left"]
    assert rounds.dead == {}
    assert group.declared == set()


async def test_GracefulShutdown_survivors_finish_without_a_dead_worker() -> None:
    # w2 died before the first barrier: every round goes on without it, and the verdict
    # is recorded for the other survivors.
    group = ScriptedGroup([2])
    rounds = _shutdown(group, lost={2})
    await rounds.run(None)
    assert group.arrived == ["calls-done", "users-released", "closing", "left"]
    assert rounds.dead == {2: "w2"}
    assert group.declared == {2}


async def test_GracefulShutdown_reports_the_dead_as_its_policy_says(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rounds = _shutdown(ScriptedGroup([2]), lost={2})
    await rounds.run(None)
    with pytest.raises(WorkersLostError) as info:
        rounds.report_dead("error")
    assert info.value.workers == ("w2",)
    assert isinstance(info.value, ShutdownError)
    caplog.clear()
    rounds.report_dead("ignore")
    assert caplog.records == []
    rounds.report_dead("warn")
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "'w2' died before shutdown" in caplog.records[0].getMessage()


async def test_GracefulShutdown_reports_nothing_when_nobody_died() -> None:
    rounds = _shutdown(ScriptedGroup([]), lost=set())
    await rounds.run(None)
    rounds.report_dead("error")  # nothing to raise


async def test_GracefulShutdown_probes_a_worker_missing_too_long() -> None:
    # w2 was never contacted: nothing says it is lost until the probe finds it dead.
    group = ScriptedGroup([2])
    host = StubHost(group, lost=set())
    rounds = _rounds(host)
    await rounds.run(None)
    assert host.probed == [2]
    assert rounds.dead == {2: "w2"}


async def test_GracefulShutdown_adopts_another_survivors_verdict_without_a_connection() -> None:
    # w2 went away with its host: a dial gets no answer, so this worker's own probe
    # proves nothing; another survivor recorded it dead in the store.
    group = ScriptedGroup([2])
    group.declared.add(2)
    host = StubHost(group, lost=set(), connected=frozenset())
    host.probe = host.probed.append  # type: ignore[method-assign]  # no answer
    rounds = _rounds(host)
    await rounds.run(None)
    assert rounds.dead == {2: "w2"}


async def test_GracefulShutdown_keeps_waiting_for_a_connected_worker_declared_dead() -> None:
    # Another survivor lost w2, but this worker's connection to w2 is alive: it waits.
    group = ScriptedGroup([2])
    group.declared.add(2)
    rounds = _rounds(StubHost(group, lost=set(), connected=frozenset({2})))
    with pytest.raises(ShutdownTimeoutError):
        await rounds.run(1.5)  # past PROBE_AFTER_S: the store's verdict was read
    assert rounds.dead == {}


async def test_GracefulShutdown_without_limit_waits_until_a_slow_worker_arrives() -> None:
    # No deadline: a live worker missing for many reads is waited for, not given up on
    # (a read per slice, as no BarrierOpened message comes: 0.5, 1, 0.5 after the probe...).
    group = ScriptedGroup(*[[2]] * 6, [])
    rounds = _rounds(StubHost(group, lost=set(), connected=frozenset({2})))
    await rounds.run(None)
    assert group.reads >= 6
    assert group.arrived == ["calls-done", "users-released", "closing", "left"]
    assert rounds.dead == {}


async def test_GracefulShutdown_bounded_wait_names_the_worker_and_the_option() -> None:
    group = ScriptedGroup([1])
    with pytest.raises(ShutdownTimeoutError) as info:
        await _shutdown(group, lost=set()).run(0.1)
    assert isinstance(info.value, TimeoutError)
    assert info.value.waiting_for == "'w1'"
    assert info.value.stage == "calls-done"
    assert "RpcBackendOptions.shutdown_timeout" in str(info.value)


async def test_shutdown_limit_zero_and_none_mean_no_limit() -> None:
    assert shutdown_limit(None) is None
    assert shutdown_limit(0) is None
    assert shutdown_limit(0.0) is None
    assert shutdown_limit(2) == 2.0
    with pytest.raises(ValueError, match=">= 0"):
        shutdown_limit(-1)


async def test_GracefulShutdown_the_worker_completing_a_barrier_tells_its_children() -> None:
    # Rank 1 of 3 completes each barrier: the root of the tree tells the two others, and
    # waits for nobody (the store still says rank 2 is missing: it is not asked).
    group = CompletingGroup([2])
    host = StubHost(group, lost=set())
    await _rounds(host).run(5.0)
    # The tree is rooted at rank 0 (the same at every barrier): rank 1 tells the root,
    # and its own children (none in a group of 3).
    assert host.told == [(0, BarrierOpened(tag, 0)) for tag in TAGS]
    assert group.reads == 0
    assert group.lost_reads == 0  # every barrier said nobody died


async def test_GracefulShutdown_lets_its_last_news_leave_before_closing() -> None:
    # The news of the last barrier may wait for a connection to the peer told (one never
    # called before): the rounds end only once it left, not while it waits (the worker
    # would close its connections and drop it; that subtree would look at the store).
    group = CompletingGroup([2])
    host = StubHost(group, lost=set())
    host.unsent_for = 3  # the frame to rank 0 waits three looks for its connection
    await _rounds(host).run(5.0)
    assert host.told[-1] == (0, BarrierOpened("closing", 0))
    assert host.unsent_asked[-1] == [0]
    assert host.unsent_polls[0] == 0  # looked at until it left
    assert len(host.unsent_asked) == 4  # three "still waiting", then "left"


async def test_GracefulShutdown_a_worker_told_the_barrier_is_open_asks_the_store_nothing() -> None:
    # Rank 1 is a leaf of rank 0's tree in a group of 3: it tells nobody.
    group = ScriptedGroup([2])  # the store would say rank 2 is missing, for ever
    news = BarrierNews()
    for tag in TAGS:
        news.heard(BarrierOpened(tag, 0, dead=tag == "users-released"), 3)
    host = StubHost(group, lost=set())
    started = time.monotonic()
    await _rounds(host, news).run(5.0)
    assert time.monotonic() - started < 0.5  # no slice ran out
    assert group.reads == 0
    assert host.told == []
    assert group.lost_reads == 1  # a barrier said a rank was counted dead: who?


async def test_GracefulShutdown_without_news_falls_back_to_the_store_after_a_slice() -> None:
    group = ScriptedGroup([2], [])  # a poll at the slice's end finds the barrier open
    host = StubHost(group, lost=set())
    started = time.monotonic()
    await _rounds(host).run(5.0)
    # Each barrier waits a slice (0.5 s) for a message before it looks; the first look
    # finds rank 2 missing, the next slice's (1 s) finds it open.
    assert time.monotonic() - started >= 2.5
    assert group.reads == 4


async def test_BarrierNews_wakes_a_waiter_and_keeps_the_first_message() -> None:
    news = BarrierNews()
    assert await news.wait("closing", 0.01) is None
    waiter = asyncio.ensure_future(news.wait("closing", 5.0))
    await asyncio.sleep(0)
    news.heard(BarrierOpened("closing", 7), 10)
    news.heard(BarrierOpened("closing", 3, dead=True), 10)  # a second message: known
    assert await waiter == BarrierOpened("closing", 7)
    assert await news.wait("closing", 0.0) == BarrierOpened("closing", 7)


@pytest.mark.parametrize(
    ("message", "size"),
    [
        (BarrierOpened("left", 0), 4),  # not a barrier anyone is told of
        (BarrierOpened("closing", 4), 4),  # no such rank
        (BarrierOpened("closing", -1), 4),
        (BarrierOpened("closing", 0), None),  # a dynamic group has no barriers
    ],
)
async def test_BarrierNews_refuses_garbage_from_a_peer(
    message: BarrierOpened, size: int | None
) -> None:
    with pytest.raises(RemoteProtocolError):
        BarrierNews().heard(message, size)


async def test_GracefulShutdown_reads_its_tree_parents_address_once_if_unknown() -> None:
    # Rank 1's parent is rank 0 (it has no children in a group of 3): a first frame from
    # rank 0 would make it look rank 0 up; read once, before the first barrier's wait.
    group = CompletingGroup([])
    host = StubHost(group, lost=set())
    del host.group.addresses[0]
    await _rounds(host).run(5.0)
    assert group.found == [[0]]
    assert host.group.addresses[0].name == "w0"
    group.found.clear()
    await _rounds(host).run(5.0)  # known now: nothing read
    assert group.found == []


async def test_GracefulShutdown_dials_its_tree_children_once_before_the_first_news() -> None:
    # Rank 0 (the tree's root, children 1 and 2) dials them when it reaches the first
    # barrier, so that the news does not wait for a handshake per level; once for all
    # three barriers, and only its children (the parent dials, never the child).
    group = CompletingGroup([])
    host = StubHost(group, lost=set(), connected=frozenset({1, 2}))
    host.group.rank = 0
    await _rounds(host).run(5.0)
    assert host.probed == [1, 2]
    assert [rank for rank, _ in host.told] == [1, 2] * len(TAGS)
    leaf = StubHost(CompletingGroup([]), lost=set())  # rank 1 of 3: no child
    await _rounds(leaf).run(5.0)
    assert leaf.probed == []


async def test_GracefulShutdown_passes_news_on_as_it_comes() -> None:
    # Rank 0 of 3 tells ranks 1 and 2 the moment a message comes (on the loop), not when
    # its own wait wakes up; and only once, though its wait then reads the same news.
    news = BarrierNews()
    host = StubHost(ScriptedGroup([]), lost=set(), connected=frozenset({1, 2}))
    host.group.rank = 0
    rounds = _rounds(host, news)
    news.heard(BarrierOpened("calls-done", 0), 3)
    assert host.told == [(1, BarrierOpened("calls-done", 0)), (2, BarrierOpened("calls-done", 0))]
    news.heard(BarrierOpened("calls-done", 0), 3)  # a second message: dropped
    for tag in TAGS[1:]:
        news.heard(BarrierOpened(tag, 0), 3)
    await rounds.run(5.0)
    assert [rank for rank, _ in host.told] == [1, 2] * len(TAGS)
    assert set(rounds.opened.values()) == {"told by a peer"}


async def test_GracefulShutdown_news_of_a_dead_rank_waits_for_the_verdicts() -> None:
    # A message saying a rank was counted dead is passed on only once this worker has
    # read who died: its children are told in a dead child's place.
    news = BarrierNews()
    group = ScriptedGroup([])
    group.declared.add(1)
    host = StubHost(group, lost=set(), connected=frozenset({2}))
    host.group.rank = 0
    rounds = _rounds(host, news)
    news.heard(BarrierOpened("calls-done", 0, dead=True), 3)
    assert host.told == []
    task = asyncio.create_task(rounds.run(5.0))
    for _ in range(500):  # bounded: 5 s at most
        if "calls-done" in rounds.opened:  # rank 1 is known dead now
            break
        await asyncio.sleep(0.01)
    for tag in TAGS[1:]:
        news.heard(BarrierOpened(tag, 0), 3)
    await task
    assert [rank for rank, _ in host.told] == [2, 2, 2]
    assert host.told[0] == (2, BarrierOpened("calls-done", 0, dead=True))
    assert rounds.dead == {1: "w1"}


async def test_GracefulShutdown_the_completing_worker_tells_the_root_and_its_children() -> None:
    # Rank 1 of 7 (children 3 and 4) completes every barrier: its own subtree hears it
    # from it at once, not after the root's news comes back down to it.
    group = CompletingGroup([])
    host = StubHost(group, lost=set(), connected=frozenset({3, 4}))
    host.group.world_size = 7
    await _rounds(host).run(5.0)
    assert [rank for rank, _ in host.told] == [0, 3, 4] * len(TAGS)


async def test_GracefulShutdown_news_that_came_during_the_store_check_counts_as_told() -> None:
    # The slice ran out and the store says the barrier is open, but the message came
    # while the store answered: told by a peer, and nobody's verdicts to read.
    loop = asyncio.get_running_loop()
    news = BarrierNews()

    class LateNews(ScriptedGroup):
        def await_arrivals(self, tag: str, ranks: list[int], seconds: float) -> bool:
            came = asyncio.run_coroutine_threadsafe(_hear(news, tag), loop)
            came.result(5.0)
            return True

    async def _hear(news: BarrierNews, tag: str) -> None:
        news.heard(BarrierOpened(tag, 0), 3)

    group = LateNews([2])
    rounds = _rounds(StubHost(group, lost=set()), news)
    await rounds.run(5.0)
    assert set(rounds.opened.values()) == {"told by a peer"}
    assert group.lost_reads == 0
