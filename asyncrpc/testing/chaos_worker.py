"""``python -m asyncrpc.testing.chaos_worker``: one worker of the chaos soak (layer L4, testing).

It joins the group behind its FaultProxy, warms up, and on the conductor's word (one line
on stdin each: GO, STOP, RELEASE, CHECK, EXIT) runs a mixed load on three lanes, stops it,
drops what it holds, checks that its RRef counts reach zero and writes its ledger (both
halves) to ``--out``. It answers each word with one stdout line ``WORD {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import math
import random
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.optim import DistributedOptimizer
from asyncrpc.runtime.futures.callbacks import CALLBACK_POOL_SIZE, CALLBACK_THREAD_NAME
from asyncrpc.testing import chaos_fns as fns

log = logging.getLogger(__name__)

CALL_TIMEOUT = 10.0  # every call's own limit; an operation that outlives it + GRACE hung
GRACE = 30.0
POOL_THREADS = 8


@dataclass
class Op:
    """One operation as its caller saw it: which steps it needs, how often it ended, how."""

    kind: str
    steps: list[str]  # "worker|key/step": what must have run once if it succeeded
    ended: int = 0
    outcome: str = "pending"


def classify(exc: BaseException) -> str:
    """``typed:Name`` for the runtime's errors, ``untyped:Name`` for anything else."""
    prefix = "typed" if isinstance(exc, asyncrpc.AsyncRpcError) else "untyped"
    return f"{prefix}:{type(exc).__name__}"


class CallerLedger:
    """Every operation this worker started, and how it ended (any thread may end one)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: dict[str, Op] = {}
        self._lock = threading.Lock()
        self._seq = 0

    def start(self, kind: str, steps: list[tuple[str, str]]) -> str:
        with self._lock:
            self._seq += 1
            key = f"{self.name}-{self._seq}"
            self.ops[key] = Op(kind, [f"{w}|{key}/{s}" for w, s in steps])
        return key

    def end(self, key: str, outcome: str) -> None:
        with self._lock:
            op = self.ops[key]
            op.ended += 1
            if op.ended == 1:
                op.outcome = outcome

    def summary(self) -> dict[str, Any]:
        with self._lock:
            ops = list(self.ops.values())
        outcomes: dict[str, int] = {}
        for op in ops:
            outcomes[op.outcome] = outcomes.get(op.outcome, 0) + 1
        return {"ops": len(ops), "outcomes": outcomes}

    def dump(self) -> dict[str, list[Any]]:
        with self._lock:
            return {k: [o.kind, o.outcome, o.ended, o.steps] for k, o in self.ops.items()}


@dataclass
class Trainer:
    """Two layers on two peers, and a DistributedOptimizer over both."""

    peers: tuple[str, str]
    layers: list[asyncrpc.RRef[Any]] = field(default_factory=list)
    optimizer: DistributedOptimizer | None = None

    def build(self, seed: int) -> None:
        self.layers = [asyncrpc.remote(p, fns.make_layer, args=(seed + i,)) for i, p in
                       enumerate(self.peers)]  # fmt: skip
        params: list[asyncrpc.RRef[Any]] = []
        for peer, layer in zip(self.peers, self.layers, strict=True):
            params += asyncrpc.rpc_sync(peer, fns.param_rrefs, args=(layer,))
        self.optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)

    def drop(self) -> None:
        self.layers, self.optimizer = [], None


class Load:
    """The mixed load of one worker: a sync lane, an autograd lane and an asyncio lane."""

    def __init__(self, name: str, names: list[str], seed: int) -> None:
        self.name, self.names = name, names
        self.ledger = CallerLedger(name)
        self.stop = threading.Event()
        self.rng = random.Random(seed)
        me = names.index(name)
        self.trainer = Trainer((names[(me + 1) % len(names)], names[(me + 2) % len(names)]))
        self.seed = seed

    def _peer(self, rng: random.Random) -> str:
        return rng.choice(self.names)

    # -- the operations ---------------------------------------------------------------------

    def sync_echo(self, rng: random.Random) -> None:
        to = self._peer(rng)
        key = self.ledger.start("sync", [(to, "echo")])
        sent = fns.payload(key, rng.choice((4, 64, 4096)))
        try:
            back = asyncrpc.rpc_sync(to, fns.echo, args=(key, sent), timeout=CALL_TIMEOUT)
        except Exception as exc:  # the outcome is the error's type
            self.ledger.end(key, classify(exc))
            return
        self.ledger.end(key, "ok" if fns.is_echo_of(back, sent) else "wrong")

    def futures(self, rng: random.Random) -> None:
        """Four ``rpc_async`` calls; each ends in its done callback (counted: once)."""
        pending = []
        for _ in range(4):
            to = self._peer(rng)
            key = self.ledger.start("future", [(to, "echo")])
            sent = fns.payload(key, rng.choice((4, 256)))
            future = asyncrpc.rpc_async(to, fns.echo, args=(key, sent), timeout=CALL_TIMEOUT)
            future.add_done_callback(self._ender(key, sent))
            pending.append(future)
        for future in pending:
            with contextlib.suppress(Exception):  # the callback records the outcome
                future.wait(CALL_TIMEOUT + GRACE)

    def _ender(self, key: str, sent: dict[str, Any]) -> Callable[[Any], None]:
        def ended(done: Any) -> None:
            exc = done.exception()
            if exc is not None:
                self.ledger.end(key, classify(exc))
            else:
                self.ledger.end(key, "ok" if fns.is_echo_of(done.value(), sent) else "wrong")

        return ended

    def remote_fork(self, rng: random.Random) -> None:
        """``remote()`` on a; the RRef goes to b, which passes it on to c; then deleted."""
        a, b, c = rng.sample(self.names, 3)
        key = self.ledger.start("remote", [(a, "make"), (b, "fetch"), (c, "fetch_sum")])
        numel = rng.choice((3, 100))
        try:
            rref = asyncrpc.remote(a, fns.make_value, args=(key, numel), timeout=CALL_TIMEOUT)
            future = asyncrpc.rpc_async(
                b, fns.fetch_and_pass, args=(key, rref, c, CALL_TIMEOUT), timeout=GRACE
            )
            del rref
            total = future.wait(GRACE + CALL_TIMEOUT)
        except Exception as exc:  # the outcome is the error's type
            self.ledger.end(key, classify(exc))
            return
        self.ledger.end(key, "ok" if total == 2.0 * numel * numel else "wrong")

    def autograd_step(self, rng: random.Random) -> None:
        """Forward through two peers' layers, distributed backward, optimizer step."""
        p1, p2 = self.trainer.peers
        key = self.ledger.start("autograd", [(p1, "forward"), (p2, "forward")])
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        try:
            with dist_autograd.context() as context_id:
                k1, h = asyncrpc.rpc_sync(
                    p1, fns.forward, args=(key, self.trainer.layers[0], x), timeout=CALL_TIMEOUT
                )
                k2, y = asyncrpc.rpc_sync(
                    p2,
                    fns.forward,
                    args=(key, self.trainer.layers[1], torch.relu(h)),
                    timeout=CALL_TIMEOUT,
                )
                loss = y.pow(2).mean()
                dist_autograd.backward(context_id, [loss])
                assert self.trainer.optimizer is not None
                self.trainer.optimizer.step(context_id)
        except Exception as exc:  # the outcome is the error's type
            self.ledger.end(key, classify(exc))
            return
        good = k1 == key and k2 == key and math.isfinite(float(loss))
        self.ledger.end(key, "ok" if good else "wrong")

    async def async_calls(self, rng: random.Random) -> None:
        """Eight concurrent ``await asyncrpc.call`` on this thread's own event loop."""

        async def one(to: str) -> None:
            key = self.ledger.start("async", [(to, "async_echo")])
            sent = fns.payload(key, rng.choice((4, 64)))
            try:
                back = await asyncio.wait_for(
                    asyncrpc.call(to, fns.async_echo, key, sent), CALL_TIMEOUT + GRACE
                )
            except asyncrpc.AsyncRpcError as exc:  # RpcTimeoutError included: typed
                self.ledger.end(key, classify(exc))
                return
            except TimeoutError:  # wait_for's own limit: the call outlived its bound
                self.ledger.end(key, "hung")
                return
            except Exception as exc:  # the outcome is the error's type
                self.ledger.end(key, classify(exc))
                return
            self.ledger.end(key, "ok" if fns.is_echo_of(back, sent) else "wrong")

        await asyncio.gather(*(one(self._peer(rng)) for _ in range(8)))

    # -- lanes ------------------------------------------------------------------------------

    def _lane(self, index: int, ops: list[Callable[[random.Random], None]]) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while not self.stop.is_set():
            rng.choice(ops)(rng)
            time.sleep(rng.uniform(0.0, 0.02))

    def _async_lane(self) -> None:
        rng = random.Random(self.seed * 1000 + 99)

        async def run() -> None:
            while not self.stop.is_set():
                await self.async_calls(rng)
                await asyncio.sleep(rng.uniform(0.0, 0.02))

        asyncio.run(run())

    def warm_up(self) -> None:
        """One of each kind to every peer (connections, pools, autograd threads exist)."""
        rng = random.Random(self.seed)
        self.trainer.build(self.seed)
        for _ in self.names:
            self.sync_echo(rng)
            self.futures(rng)
            self.remote_fork(rng)
        self.autograd_step(rng)
        asyncio.run(self.async_calls(rng))

    def run(self) -> list[threading.Thread]:
        lanes = [
            threading.Thread(target=self._lane, args=(1, [self.sync_echo, self.futures,
                                                          self.remote_fork])),
            threading.Thread(target=self._lane, args=(2, [self.autograd_step])),
            threading.Thread(target=self._async_lane),
        ]  # fmt: skip
        for lane in lanes:
            lane.daemon = True  # a lane stuck in a hung call must not keep the process
            lane.start()
        return lanes


# -- the conductor's words ----------------------------------------------------------------


def _line(text: str) -> None:
    # One write per line: the progress thread and the main thread both write to stdout.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _say(word: str, data: Any = None) -> None:
    _line(f"{word} {json.dumps(data)}")


def _expect(word: str) -> bool:
    line = sys.stdin.readline()
    if not line:
        return False  # the conductor is gone: exit
    if line.strip() != word:
        raise SystemExit(f"expected {word!r}, got {line.strip()!r}")
    return True


def _report_progress(load: Load) -> None:
    while not load.stop.wait(1.0):  # ends with the load
        _line(f"PROGRESS {len(load.ledger.ops)}")


def _poll(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _threads_back(name: str, before: dict[str, int], now: dict[str, int]) -> bool:
    """Every kind of thread is back to its baseline count, except the two pools that keep
    the threads they started up to their size (the RPC pool's stand-ins must have exited)."""
    bounded = {re.sub(r"\d+", "", f"asyncrpc-{name}-"): POOL_THREADS,
               f"{CALLBACK_THREAD_NAME}-": CALLBACK_POOL_SIZE}  # fmt: skip
    return all(n <= bounded.get(kind, before.get(kind, 0)) for kind, n in now.items())


def _settle(load: Load, baseline: dict[str, Any]) -> dict[str, Any]:
    counts: dict[str, int] = {}

    def zero() -> bool:
        counts.update(fns.rref_counts())
        return not any(counts.values())

    rrefs_zero = _poll(zero, 60.0)
    entries = {} if rrefs_zero else fns.rref_entries()  # what is left, for the report
    now: dict[str, Any] = {}

    def back() -> bool:
        gc.collect()
        now.update(fns.resources(), thread_kinds=fns.thread_kinds())
        return now["fds"] <= baseline["fds"] and _threads_back(
            load.name, baseline["thread_kinds"], now["thread_kinds"]
        )

    came_back = _poll(back, 30.0)
    return {"rref_counts": counts, "rrefs_zero": rrefs_zero, "rref_entries": entries,
            "baseline": baseline,
            "end": now, "back": came_back, **load.ledger.summary()}  # fmt: skip


def _options(args: argparse.Namespace) -> asyncrpc.RpcBackendOptions:
    return asyncrpc.RpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=CALL_TIMEOUT,
        shutdown_timeout=60.0,
        num_worker_threads=POOL_THREADS,
        listen_port=args.listen_port,
        advertise_port=args.advertise_port,
        unix_sockets=False,  # through the proxies, which sit on TCP
        shared_memory=False,  # every byte on the socket, where the faults are
        heartbeat_timeout=args.heartbeat_timeout,  # the rest of the heartbeat: defaults
    )


def _preload() -> None:
    # The first optimizer step imports much of torch lazily (seconds of CPU on a loaded
    # machine): paid here, before joining, not inside the warm-up's timed calls.
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.ones(1)
    torch.optim.SGD([param], lr=0.1).step()


def run(args: argparse.Namespace) -> int:
    names = [f"c{r}" for r in range(args.world_size)]
    _preload()
    asyncrpc.init_rpc(names[args.rank], rank=args.rank, world_size=args.world_size,
                      rpc_backend_options=_options(args))  # fmt: skip
    load = Load(names[args.rank], names, args.seed * 100 + args.rank)
    load.warm_up()
    gc.collect()
    baseline = {**fns.resources(), "thread_kinds": fns.thread_kinds()}
    _say("READY", baseline)
    if not _expect("GO"):
        return 2
    lanes = load.run()
    threading.Thread(target=_report_progress, args=(load,), daemon=True).start()
    if not _expect("STOP"):
        return 2
    load.stop.set()
    for lane in lanes:
        lane.join(CALL_TIMEOUT + 2 * GRACE)
    # No worker of the soak dies, so a peer this one declared lost is a false loss (a
    # SIGSTOP is shorter than the heartbeat's limit, a black hole shorter than the
    # silent-link limit).
    debug = asyncrpc.get_debug_info()
    _say("DONE", {"stuck_lanes": sum(lane.is_alive() for lane in lanes),
                  "false_losses": len(debug["lost_peers"]),
                  "liveness_probes": debug["liveness_probes"]})  # fmt: skip
    if not _expect("RELEASE"):
        return 2
    load.trainer.drop()
    gc.collect()
    _say("RELEASED")
    if not _expect("CHECK"):
        return 2
    report = _settle(load, baseline)
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump({"caller": load.ledger.dump(), "callee": fns.CALLEE.snapshot(), **report}, out)
    _say("CHECKED", report)
    if not _expect("EXIT"):
        return 2
    asyncrpc.shutdown(timeout=30.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--listen-port", type=int, required=True)
    parser.add_argument("--advertise-port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--heartbeat-timeout", type=float, default=asyncrpc.RpcBackendOptions().heartbeat_timeout
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"[c{args.rank}] %(levelname)s %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
