"""Unit tests of asyncrpc.protocol.reflog.RefLog: refcount frames kept until a Pong."""

from __future__ import annotations

from asyncrpc.protocol.reflog import RefLog


def frame(i: int) -> list[bytes]:
    return [str(i).encode()]


def test_RefLog_replays_everything_not_acknowledged() -> None:
    log = RefLog()
    for i in range(3):
        log.add(frame(i))
    assert log.replay() == [frame(0), frame(1), frame(2)]


def test_RefLog_pong_trims_what_its_ping_covered() -> None:
    log, conn = RefLog(), object()
    log.add(frame(0))
    log.add(frame(1))
    log.pinged(conn)
    log.add(frame(2))
    log.ponged(conn)
    assert log.replay() == [frame(2)]
    log.ponged(conn)  # a Pong with no Ping outstanding changes nothing
    assert log.replay() == [frame(2)]


def test_RefLog_ignores_pongs_of_a_lost_connection() -> None:
    log, old, new = RefLog(), object(), object()
    log.add(frame(0))
    log.pinged(old)
    log.lost(old)
    log.add(frame(1))
    log.pinged(new)
    log.ponged(old)  # late, from the old connection: it proves nothing now
    assert len(log) == 2
    log.ponged(new)
    assert len(log) == 0


def test_RefLog_asks_for_a_ping_every_ack_every_frames() -> None:
    log, conn = RefLog(ack_every=3), object()
    asks = [log.add(frame(i)) for i in range(3)]
    assert asks == [False, False, True]
    log.pinged(conn)
    assert [log.add(frame(i)) for i in range(3, 6)] == [False, False, True]


def test_RefLog_awaits_an_ack_until_a_ping_covers_the_last_frame() -> None:
    log, conn = RefLog(), object()
    assert not log.awaiting_ack()
    log.add(frame(0))
    assert log.awaiting_ack()
    log.pinged(conn)
    assert not log.awaiting_ack()  # the Ping in flight covers it
    log.add(frame(1))
    assert log.awaiting_ack()


FORK = ((0, 1), (0, 2))
OTHER = ((0, 1), (0, 3))


def test_RefLog_forks_not_covered_by_a_pong_are_in_doubt_when_the_link_dies() -> None:
    log, conn = RefLog(), object()
    log.wrote([FORK])
    log.pinged(conn)
    log.wrote([OTHER])
    assert log.awaiting_ack()  # OTHER is not covered by the Ping in flight
    log.ponged(conn)
    assert log.forks_in_flight == 1
    assert log.lost(conn) == [OTHER]
    assert log.forks_in_flight == 0
    assert log.lost(conn) == []  # handed back once


def test_RefLog_forks_written_before_a_lost_ping_stay_in_doubt() -> None:
    log, conn = RefLog(), object()
    log.wrote([FORK, OTHER])
    log.pinged(conn)  # its Pong never comes
    assert log.lost(conn) == [FORK, OTHER]
    assert not log.awaiting_ack()
