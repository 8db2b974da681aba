"""Scenarios of issue 15 (test layer): connections that heal, bounded waits, nested
blocking calls; and the regression the chaos soak found (an autograd release lost with
its connection). Each joins a group of its own as rank 0 ("driver")."""

from __future__ import annotations

import argparse
import gc
import os
import random
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.protocol import auth
from asyncrpc.protocol.wire import PROTOCOL_VERSION, FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import Hello, decode_message
from asyncrpc.testing import chaos_fns, free_port
from asyncrpc.testing.faultproxy import FaultProxy
from tests.integration import remote_fns as fns
from tests.scenarios.common import Observations, attempt, options, poll, report
from tests.scenarios.registry import option, scenario

# The heal scenarios' flags: a world of two by default, looser timeouts.
_DEFAULTS = {"world_size": 2, "rpc_timeout": 20.0, "shutdown_timeout": 20.0}
# The worker behind a proxy: where it listens, and the proxy's port in front of it.
_BEHIND = (option("--port", type=int, default=0), option("--proxy-port", type=int, default=0))


def _init(args: argparse.Namespace, **overrides: object) -> None:
    opts = options(args, **overrides)
    asyncrpc.init_rpc("driver", rank=0, world_size=args.world_size, rpc_backend_options=opts)


# -- nested blocking calls deeper than the pool --------------------------------------------


@scenario("nested", **_DEFAULTS)
def nested(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, n1, n2, n3, n4}, all workers with 4 pool threads; n3 and n4 also
    cap their pools at 4. Chains of nested ``rpc_sync`` between n1 and n2 (1 x 32, 8 x 8),
    then one too deep for the capped pair."""
    _init(args)
    obs: Observations = {}
    obs["deep"] = attempt(lambda: asyncrpc.rpc_sync("n1", fns.chain, args=(32, "n1", "n2")))
    chains = [
        asyncrpc.rpc_async(f"n{1 + i % 2}", fns.chain, args=(8, f"n{1 + i % 2}", f"n{2 - i % 2}"))
        for i in range(8)
    ]
    obs["eight"] = attempt(lambda: asyncrpc.wait_all(chains))
    obs["capped"] = attempt(lambda: asyncrpc.rpc_sync("n3", fns.chain, args=(16, "n3", "n4")))
    obs["capped_after"] = attempt(lambda: asyncrpc.rpc_sync("n3", fns.chain, args=(2, "n3", "n4")))

    def settled(name: str) -> Callable[[], bool]:
        return lambda: asyncrpc.rpc_sync(name, fns.metrics)["thread_pool_threads"] <= 4

    obs["threads_back"] = all(poll(settled(n), 10.0) for n in ("n1", "n2"))
    obs["metrics"] = {n: asyncrpc.rpc_sync(n, fns.metrics) for n in ("n1", "n2", "n3", "n4")}
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=20.0))
    report(obs)
    return 0


# -- frame limits known to both sides -------------------------------------------------------

MIB = 1 << 20


@scenario("frames", **_DEFAULTS)
def frames(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, m1}; both take frames of at most 1 MiB. Oversized messages both
    ways, each followed by normal calls on the same connection."""
    import torch

    # No pings between the counts, and every byte on the socket (shared memory would carry
    # the large tensors beside the frames, where the frame limit does not apply).
    _init(args, max_frame_size=MIB, heartbeat_interval=0.0, shared_memory=False)
    obs: Observations = {}
    obs["warm"] = attempt(lambda: asyncrpc.rpc_sync("m1", fns.add, args=(1, 2)))
    before = asyncrpc.get_metrics()
    big = torch.zeros(2 * MIB, dtype=torch.uint8)
    obs["send_big"] = attempt(lambda: asyncrpc.rpc_sync("m1", fns.storage_nbytes, args=(big,)))
    after = asyncrpc.get_metrics()
    obs["bytes_written"] = after["bytes_out"] - before["bytes_out"]
    obs["connections_lost"] = after["connections_lost"]
    half = torch.zeros(MIB // 2, dtype=torch.uint8)
    obs["send_half"] = attempt(lambda: asyncrpc.rpc_sync("m1", fns.storage_nbytes, args=(half,)))
    obs["reply_big"] = attempt(lambda: asyncrpc.rpc_sync("m1", fns.zeros, args=(2 * MIB,)))
    obs["reply_half"] = attempt(
        lambda: int(asyncrpc.rpc_sync("m1", fns.zeros, args=(MIB // 2,)).numel())
    )
    obs["connections_opened"] = asyncrpc.get_metrics()["connections_opened"]
    obs["m1_metrics"] = asyncrpc.rpc_sync("m1", fns.metrics)
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=20.0))
    report(obs)
    return 0


# -- connections that drop and heal ---------------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _hello(claim: str, rank: int) -> bytes:
    hello = Hello(PROTOCOL_VERSION, claim, rank, auth.new_nonce())
    return b"".join(bytes(p) for p in encode_frame(hello.to_fields(), b""))


def _stray(port: int, claim: str, rank: int) -> bool:
    """A stranger connects, claims to be worker ``claim`` and hangs up once the worker has
    answered (its handshake holds the connection by then); whether it answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(_hello(claim, rank))
        try:
            return sock.recv(1) != b""
        except OSError:  # reset, or no answer within the socket's timeout
            return False


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _stalled(port: int) -> tuple[bool, bool]:
    """Open one connection that sends nothing and one that sends half a prelude; return
    whether the worker closed each within 5 s (its handshake deadline is 1.5 s)."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as idle,
        socket.create_connection(("127.0.0.1", port), timeout=5) as stalled,
    ):
        stalled.sendall(b"ARPC\x02\x00")
        return _closed_by_peer(idle, 5.0), _closed_by_peer(stalled, 5.0)


def _at_baseline(baseline: dict[str, int]) -> Callable[[], bool]:
    """Whether both sides hold as many descriptors as at ``baseline`` (this process's count
    includes both proxies' sockets, so every connection between the two shows in it)."""
    return lambda: _fds() == baseline["driver"] and _on_r1(fns.open_fds) == baseline["r1"]


def _running_on_r1() -> int:
    return int(asyncrpc.rpc_sync("r1", fns.metrics)["running_requests"])


def _on_r1(fn: Callable[[], Any]) -> Any:
    """``fn()`` on r1, or None if the call failed typed (a poll then tries again)."""
    try:
        return asyncrpc.rpc_sync("r1", fn)
    except asyncrpc.AsyncRpcError:
        return None


def _settled(name: str) -> Callable[[], bool]:
    def check() -> bool:
        gc.collect()
        here = asyncrpc.get_debug_info()
        try:
            there = asyncrpc.rpc_sync(name, fns.rref_debug)
        except asyncrpc.AsyncRpcError:  # typed: try again (the poll is bounded)
            return False
        keys = ("owner_rrefs", "user_rrefs", "pending_forks", "pending_users")
        return all(here[k] == 0 and there[k] == 0 for k in keys)

    return check


class _Soak:
    """Calls both ways while the connection is dropped; each future must end, once."""

    def __init__(self, proxies: list[Any]) -> None:
        self.proxies = proxies
        self.ok = self.typed = self.hung = self.wrong = 0
        self.errors: dict[str, int] = {}

    def drop(self) -> None:
        for proxy in self.proxies:
            proxy.drop()
        for proxy in self.proxies:
            proxy.heal()

    def settle(self, future: Any, expected: Any) -> None:
        try:
            value = future.wait(10.0)
        except asyncrpc.AsyncRpcError as exc:  # RpcTimeoutError included: typed
            self.typed += 1
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
            return
        except TimeoutError:  # the future itself did not end: a hang
            self.hung += 1
            return
        if expected is not None and value != expected:
            self.wrong += 1
        else:
            self.ok += 1

    def round(self, i: int) -> None:
        futures = [
            (asyncrpc.rpc_async("r1", fns.echo, args=(i,)), i),
            (asyncrpc.rpc_async("r1", fns.sleep, args=(0.02,)), "slept"),
            (asyncrpc.rpc_async("r1", fns.call_back, args=("driver",)), "driver"),
        ]
        rref = asyncrpc.remote("r1", fns.add, args=(i, 1), timeout=2.0)
        held = asyncrpc.rpc_async("r1", fns.hold, args=(asyncrpc.RRef(i),))
        # Deliberate jitter, not ordering: the drop lands at varied points of the calls.
        time.sleep(random.uniform(0.0, 0.01))
        self.drop()
        for future, expected in futures:
            self.settle(future, expected)
        self.settle(held, None)
        try:
            self.settle(rref.to_here_future(timeout=5.0), i + 1)
        except asyncrpc.AsyncRpcError:  # unusable already (timed out): typed
            self.typed += 1
        del rref

    def summary(self) -> dict[str, Any]:
        return {"ok": self.ok, "typed": self.typed, "hung": self.hung, "wrong": self.wrong,
                "errors": self.errors}  # fmt: skip


def _next_call_after(soak: _Soak) -> dict[str, Any]:
    """Drop the link; time until a call succeeds again (a call racing the drop may fail
    typed: it went out on the dying connection), and how many attempts it took."""
    soak.drop()
    started = time.monotonic()
    for tries in range(1, 11):  # bounded
        try:
            asyncrpc.rpc_sync("r1", fns.add, args=(1, 1), timeout=5.0)
        except asyncrpc.AsyncRpcError:
            continue
        return {"s": time.monotonic() - started, "attempts": tries}
    return {"s": None, "attempts": 10}


@scenario("heal", *_BEHIND, option("--drops", type=int, default=100), **_DEFAULTS)
def heal(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, r1}; each listens behind a FaultProxy run here (``--port`` and
    ``--proxy-port`` are r1's), so every connection between them crosses a proxy. Drops a
    live connection mid-call, calls again, holds RRefs across a drop, lets strangers claim
    each name, then soaks ``--drops`` drops; graceful shutdown at the end."""
    mine, my_proxy = free_port(), free_port()
    proxies = [FaultProxy(args.port, args.proxy_port), FaultProxy(mine, my_proxy)]
    _init(args, listen_port=mine, advertise_port=my_proxy, unix_sockets=False,
          heartbeat_interval=0.5, heartbeat_timeout=5.0, handshake_timeout=1.5)  # fmt: skip
    soak = _Soak(proxies)
    obs: Observations = {}
    obs["warm"] = attempt(lambda: asyncrpc.rpc_sync("r1", fns.add, args=(1, 2)))
    # RRefs held across the drop: one r1 owns, one we own that r1 holds.
    kept = [asyncrpc.remote("r1", fns.add, args=(20, 22)), asyncrpc.RRef("driver's")]
    obs["kept_before"] = attempt(lambda: kept[0].to_here(timeout=5.0))
    asyncrpc.rpc_sync("r1", fns.hold, args=(kept[1],))
    baseline = {"driver": _fds(), "r1": asyncrpc.rpc_sync("r1", fns.open_fds)}
    # A live connection dropped in the middle of a call.
    slow = asyncrpc.rpc_async("r1", fns.sleep, args=(30.0,), timeout=0)
    obs["slow_running"] = poll(lambda: _running_on_r1() >= 1, 10.0)
    soak.drop()
    obs["in_flight"] = attempt(lambda: slow.wait(10.0))
    obs["next_call"] = attempt(lambda: asyncrpc.rpc_sync("r1", fns.add, args=(2, 3)))
    obs["call_back"] = attempt(lambda: asyncrpc.rpc_sync("r1", fns.call_back, args=("driver",)))
    obs["kept_after"] = attempt(lambda: kept[0].to_here(timeout=5.0))
    # Calls made once the link is known down leave, in order, on the new one.
    lost = asyncrpc.get_metrics()["connections_lost"]
    soak.drop()
    poll(lambda: asyncrpc.get_metrics()["connections_lost"] > lost, 5.0)
    ordered = [asyncrpc.rpc_async("r1", fns.inline_record, args=(i,)) for i in range(50)]
    obs["ordered"] = attempt(lambda: asyncrpc.wait_all(ordered))
    obs["arrivals"] = asyncrpc.rpc_sync("r1", fns.arrivals)
    # Strangers claim each name and hang up: nobody becomes lost. Each hangs up once the
    # worker has answered, so the worker holds its connection; behind a proxy that stays
    # half-open until the worker's handshake deadline closes it (1.5 s on either side).
    # Then the descriptor counts are back to the baseline's. (Not to counts taken just
    # before the strangers came: those could include a connection of the drop above still
    # in its handshake, which also closes meanwhile; the counts then never came back.)
    obs["strays_answered"] = [_stray(args.proxy_port, "driver", 0), _stray(my_proxy, "r1", 1)]
    obs["strays_closed"] = poll(_at_baseline(baseline), 10.0)
    obs["after_strays"] = attempt(lambda: asyncrpc.rpc_sync("r1", fns.add, args=(3, 4)))
    obs["lost_after_strays"] = asyncrpc.get_debug_info()["lost_peers"]
    # Strangers that never finish a handshake: idle, and stalled in the middle of a prelude.
    obs["idle_closed"], obs["stalled_closed"] = _stalled(args.port)
    obs["next_call_after_drop"] = [_next_call_after(soak) for _ in range(20)]
    # The soak.
    started = time.monotonic()
    for i in range(args.drops):
        soak.round(i)
    obs["soak_s"] = time.monotonic() - started
    obs["soak"] = soak.summary()
    obs["after_soak"] = attempt(lambda: asyncrpc.rpc_sync("r1", fns.add, args=(4, 5)))
    # Back to baseline: RRefs released everywhere, descriptors, pool threads.
    kept.clear()
    asyncrpc.rpc_sync("r1", fns.drop_held)
    obs["rrefs_settled"] = poll(_settled("r1"), 15.0)
    obs["rref_debug"] = {"driver": asyncrpc.get_debug_info(), "r1": _on_r1(fns.rref_debug)}
    # Forks whose frames died with a connection: asked about, and undone where lost.
    obs["forks_queried"] = asyncrpc.get_debug_info()["forks_queried"]
    obs["ref_log_acked"] = poll(
        lambda: (
            asyncrpc.get_debug_info()["unacked_ref_frames"] == 0
            and (_on_r1(fns.debug_info) or {}).get("unacked_ref_frames") == 0
        ),
        10.0,
    )
    obs["fds_back"] = poll(_at_baseline(baseline), 10.0)
    obs["fds"] = {"baseline": baseline, "driver": _fds(), "r1": _on_r1(fns.open_fds)}
    obs["r1_metrics"] = _on_r1(fns.metrics)
    obs["metrics"] = asyncrpc.get_metrics()
    obs["lost_peers"] = asyncrpc.get_debug_info()["lost_peers"]
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=20.0))
    for proxy in proxies:
        proxy.close()
    report(obs)
    return 0


# -- names claimed by strangers while their workers redial ---------------------------------


def _claim(port: int, claim: str, rank: int) -> tuple[socket.socket, bool | None]:
    """A stranger claims to be worker ``claim`` and stays, silent after its Hello. Returns
    its socket and whether the worker challenged the claim (None: it did not answer)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(_hello(claim, rank))
    decoder, frames = FrameDecoder(), list[Any]()
    try:
        while not frames:  # bounded: each read waits 5 s at most, and returns b"" at EOF
            data = sock.recv(65536)
            if not data:
                return sock, None
            frames = decoder.feed(data)
    except OSError:  # reset, or no answer in time
        return sock, None
    return sock, getattr(decode_message(frames[0].fields), "accepted", False) is True


def _open(sock: socket.socket) -> bool:
    """Whether the worker still holds the stranger's connection (nothing more was sent)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


@scenario("claimed_name", *_BEHIND, **_DEFAULTS)
def claimed_name(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, s1}; both listen behind FaultProxies run here (``--port`` and
    ``--proxy-port`` are s1's; s1 gives a handshake 30 s). Strangers claim each worker's
    name at the other and stay; the link is cut; the driver's redial must get through at
    once, whatever the claims."""
    mine, my_proxy = free_port(), free_port()
    to_s1, to_me = FaultProxy(args.port, args.proxy_port), FaultProxy(mine, my_proxy)
    _init(args, listen_port=mine, advertise_port=my_proxy, unix_sockets=False,
          handshake_timeout=30.0)  # fmt: skip
    obs: Observations = {}
    obs["warm"] = attempt(lambda: asyncrpc.rpc_sync("s1", fns.add, args=(1, 2)))
    # A claim while the link is up: s1 refuses it (already connected); the stranger stays.
    up, obs["challenged_while_up"] = _claim(args.port, "driver", 0)
    held = [up]
    # The link is cut, and the proxies cut every redial at once (each side's own redial
    # fails: unavailable, not lost) until the claims below are in place.
    to_s1.drop()
    to_me.drop()

    def claimed(port: int, name: str, rank: int) -> Callable[[], bool]:
        def challenged() -> bool:  # once the worker has seen the link go
            sock, accepted = _claim(port, name, rank)
            if accepted is not True:  # refused (the worker still dials, or is connected)
                sock.close()
                return False
            held.append(sock)
            return True

        return challenged

    # Claims while the link is down: each worker challenges one, and waits (30 s on either
    # side) for an Auth that never comes.
    obs["challenged_at_s1"] = poll(claimed(args.port, "driver", 0), 10.0)
    obs["challenged_here"] = poll(claimed(mine, "s1", 1), 10.0)
    to_s1.heal()  # the driver's dials reach s1 again; s1's dials still cannot reach us
    obs["redial"] = attempt(lambda: asyncrpc.rpc_sync("s1", fns.add, args=(3, 4), timeout=10))
    obs["claims_held"] = [_open(sock) for sock in held]  # live claims all through the redial
    obs["call_back"] = attempt(
        lambda: asyncrpc.rpc_sync("s1", fns.call_back, args=("driver",), timeout=10)
    )
    for sock in held:
        sock.close()
    to_me.heal()
    s1_info = attempt(lambda: asyncrpc.rpc_sync("s1", fns.debug_info, timeout=10))["value"]
    obs["lost_peers"] = {"driver": asyncrpc.get_debug_info()["lost_peers"],
                         "s1": (s1_info or {}).get("lost_peers")}  # fmt: skip
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=20.0))
    to_s1.close()
    to_me.close()
    report(obs)
    return 0


# -- shutdown with a dead peer never contacted ----------------------------------------------


@scenario("dead_peer", **_DEFAULTS)
def dead_peer(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, d1, d2}. Prints ``STARTED`` once joined, without calling anybody;
    the test then SIGKILLs d1 and writes ``KILLED``; then a graceful shutdown with the
    default 60 s limit."""
    args.shutdown_timeout = 60.0
    _init(args)
    obs: Observations = {}
    print("STARTED", flush=True)
    obs["stdin"] = sys.stdin.readline().strip()
    obs["shutdown"] = attempt(asyncrpc.shutdown)
    report(obs)
    return 0


# -- scenario: an autograd release lost with its connection (found by the chaos soak) --


def _contexts_on(name: str) -> int:
    return int(asyncrpc.rpc_sync(name, chaos_fns.rref_counts, timeout=10.0)["autograd_contexts"])


@scenario("release_after_drop", *_BEHIND, **_DEFAULTS)
def release_after_drop(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, k1}; both listen behind FaultProxies run here (``--port`` and
    ``--proxy-port`` are k1's). A context reaches k1; its release leaves into a black hole
    and the connection is then reset: k1 must still drop the context."""
    mine, my_proxy = free_port(), free_port()
    proxies = [FaultProxy(args.port, args.proxy_port), FaultProxy(mine, my_proxy)]
    opts = options(args, listen_port=mine, advertise_port=my_proxy, unix_sockets=False)
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=opts)
    obs: Observations = {}
    layer = asyncrpc.remote("k1", chaos_fns.make_layer, args=(0,))
    with dist_autograd.context() as context_id:
        _, y = asyncrpc.rpc_sync("k1", chaos_fns.forward, args=("k", layer, torch.ones(2, 8)))
        dist_autograd.backward(context_id, [y.sum()])
        obs["during"] = _contexts_on("k1")
        for proxy in proxies:
            proxy.blackhole()
    # The release is on its way into the black hole; then the link resets.
    poll(lambda: False, 0.3)
    for proxy in proxies:
        proxy.drop()
        proxy.heal()
    obs["released"] = poll(lambda: _contexts_on("k1") == 0, 15.0)
    obs["after"] = _contexts_on("k1")
    del layer
    asyncrpc.shutdown(timeout=20.0)
    for proxy in proxies:
        proxy.close()
    report(obs)
    return 0
