"""A probe of a silent peer's process through its lane listener (layer L2.46).

The heartbeat (``runtime/net/heartbeat.py``) hears a peer only through its event loop. When
a connection has been silent for ``heartbeat_timeout``, the loop may be blocked by user
code, or the process may be stopped or dead; to tell them apart, the agent opens a lane to
the peer: its listener and the lane's handshake are served by threads of the peer's own,
which go on while its loop is blocked, and stop with the process. The handshake is the
authenticated one (the key proof), so only a member can answer for the peer.

- The handshake completes, or the peer refuses or closes the lane (over its limit, say):
  something of the process ran, so it is alive.
- No answer before the deadline: the process is stopped, hung in C code holding the GIL,
  or its host is unreachable; evidence of a loss.
- Nobody listens at its address: the process is gone.

The last two are evidence only where the peer's listener has been seen to answer from
here before: a lane address that a firewall drops, or that is advertised on an interface
the listener does not bind, would otherwise make every live peer look dead (the main
connection open and merely silent means its process still holds its sockets). So each
peer's listener is checked once while its connection is live (``notice``; again every
``_RECHECK_S`` until it answers), and until then a probe proves nothing.

The dial blocks, so each probe runs on a short-lived thread of its own (they are rare: one
check per peer, and one probe per silent peer per ``heartbeat_timeout``), and its answer
goes back to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from asyncrpc.protocol.address import PeerAddress
from asyncrpc.runtime.lanes.handshake import HANDSHAKE_ERRORS, dial_lane, lane_target

__all__ = ["ProcessProbe", "probe_process"]

# How often a peer whose lane listener has not answered yet is checked again (seconds).
_RECHECK_S = 10.0


def probe_process(
    target: str | tuple[str, int],
    me: tuple[str, int],
    peer: tuple[str, int],
    key: bytes,
    max_frame_size: int,
    timeout: float,
) -> str | None:
    """Dial ``peer``'s lane listener at ``target`` and close the lane at once (blocking).

    Returns:
        None when the peer's process answered, else the evidence that it did not, as the
        end of a sentence ("and ...") for the loss's reason.
    """
    try:
        opened = dial_lane(target, me, peer, key, max_frame_size, timeout)
    except TimeoutError:
        return f"and its process did not answer a probe within {timeout:g} s"
    except (ConnectionRefusedError, FileNotFoundError):
        return "and nothing listens at its lane address any more (its process is gone)"
    except HANDSHAKE_ERRORS:
        return None  # refused, closed or failed by the peer: it ran, so it lives
    opened.frames.close()
    return None


class ProcessProbe:
    """The heartbeat's ``probe``: a thread per probe, its answer posted to the loop.

    Args:
        addresses: the group's addresses by rank (a live dict).
        host_id: this machine's identity; a peer on it is probed on its Unix socket.
        timeout: the probe's deadline in seconds.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        me: tuple[str, int],
        addresses: dict[int, PeerAddress],
        host_id: str | None,
        key: bytes,
        max_frame_size: int,
        timeout: float,
    ) -> None:
        self._loop = loop
        self._me, self._addresses, self._host_id = me, addresses, host_id
        self._key, self._max_frame_size, self.timeout = key, max_frame_size, timeout
        # Ranks whose lane listener answered from here (any thread adds, by set.add).
        self._answered: set[int] = set()
        self._next_check: dict[int, float] = {}  # loop thread only

    @property
    def checked(self) -> int:
        """Peers whose lane listener answered from here: their silence can be tested."""
        return len(self._answered)

    def target(self, rank: int) -> str | tuple[str, int] | None:
        """Where ``rank`` takes lanes; None when it takes none (``sync_lanes=0``, TLS)."""
        address = self._addresses.get(rank)
        return None if address is None else lane_target(address, self._host_id)

    def notice(self, conn: object) -> None:
        """A live connection: check once that its peer's listener answers from here."""
        rank = getattr(conn, "peer", None)
        if rank is None or rank in self._answered:
            return
        now = self._loop.time()
        if now < self._next_check.get(rank, 0.0):
            return
        self._next_check[rank] = now + _RECHECK_S
        self._start(rank, lambda evidence: None)

    def __call__(self, conn: object, answer: Callable[[str | None], None]) -> bool:
        rank = getattr(conn, "peer", None)
        return rank is not None and self._start(rank, answer)

    def _start(self, rank: int, answer: Callable[[str | None], None]) -> bool:
        target = self.target(rank)
        if target is None:
            return False
        peer = (self._addresses[rank].name, rank)
        args = (target, self._me, peer, self._key, self._max_frame_size, self.timeout)
        trusted = rank in self._answered

        def run() -> None:
            evidence = probe_process(*args)
            if evidence is None:
                self._answered.add(rank)
            elif not trusted:
                evidence = None  # never seen to answer from here: it proves nothing
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(answer, evidence)

        threading.Thread(target=run, name=f"asyncrpc-probe-{peer[0]}", daemon=True).start()
        return True
