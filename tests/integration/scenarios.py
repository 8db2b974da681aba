"""Driver programs for integration tests that need a worker group of their own (test layer).

``python -m tests.integration.scenarios NAME [options]`` joins its own group as a separate
process (the pytest process already runs the shared group's "driver"), performs one scenario
and prints one line ``RESULT {json}`` of observations. The test-side half, ``start`` and
``ScenarioProcess``, launches such a process and parses that line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import asyncrpc
from asyncrpc.errors import NotInitializedError

RESULT_PREFIX = "RESULT "
_ROOT = Path(__file__).resolve().parents[2]

Observations = dict[str, Any]


# -- scenario side: helpers ---------------------------------------------------------------


def _options(args: argparse.Namespace) -> asyncrpc.RpcBackendOptions:
    return asyncrpc.RpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=args.rpc_timeout,
        shutdown_timeout=args.shutdown_timeout,
    )


def _error(exc: BaseException | None) -> dict[str, Any] | None:
    """Describe ``exc`` by type (the tests assert on types) and by the fields it carries."""
    if exc is None:
        return None
    return {
        "type": type(exc).__name__,
        "mro": [cls.__name__ for cls in type(exc).__mro__],
        "owner": getattr(exc, "owner", None),  # RRef errors name the owner
        "worker": getattr(exc, "worker", None),
        "message": str(exc),
    }


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; return its value or its error, and how long it took."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # the observation is the error itself
        return {"value": None, "error": _error(exc), "elapsed": time.monotonic() - start}
    return {"value": value, "error": None, "elapsed": time.monotonic() - start}


def _report(observations: Observations) -> None:
    print(RESULT_PREFIX + json.dumps(observations, default=repr), flush=True)


def _poll(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- scenario: a peer is SIGKILLed in the middle of a call --------------------------------


def kill_peer(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1, w2}: a long call to w1 is pending when the test kills w1.

    Protocol: prints ``STARTED`` once the call runs on w1, then reads one line (the test
    writes ``KILLED`` right after SIGKILL) and observes the pending call, a later call, calls
    to w2 and ``shutdown``.
    """
    from tests.integration import remote_fns as fns

    asyncrpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=_options(args))
    obs: Observations = {"w1_pid": asyncrpc.rpc_sync("w1", fns.pid)}
    failed_at: list[float] = []
    called_back = threading.Event()

    def note_failure(_: object) -> None:
        failed_at.append(time.monotonic())
        called_back.set()

    long_call = asyncrpc.rpc_async("w1", fns.sleep, args=(30.0,), timeout=0)
    long_call.add_done_callback(note_failure)
    w2_in_flight = asyncrpc.rpc_async("w2", fns.sleep, args=(1.0,))
    obs["running_on_w1"] = _poll(
        lambda: asyncrpc.rpc_sync("w1", fns.metrics)["running_requests"] >= 1, 5.0
    )
    print("STARTED", flush=True)
    obs["stdin"] = sys.stdin.readline().strip()
    obs["pending"] = _attempt(lambda: long_call.wait(5.0))
    # The done callback runs on the callback pool, possibly after wait() returned.
    called_back.wait(5.0)
    obs["pending_failed_at"] = failed_at[0] if failed_at else None
    obs["later_w1"] = _attempt(lambda: asyncrpc.rpc_sync("w1", fns.add, args=(1, 2)))
    obs["w2_in_flight"] = _attempt(lambda: w2_in_flight.wait(5.0))
    obs["later_w2"] = _attempt(lambda: asyncrpc.rpc_sync("w2", fns.add, args=(1, 2)))
    obs["debug_lost_peers"] = asyncrpc.get_debug_info()["lost_peers"]
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(graceful=args.graceful, timeout=5.0))
    obs["not_initialized_after"] = _attempt(asyncrpc.get_worker_info)["error"]
    _report(obs)
    return 0


# -- scenario: a peer hangs (SIGSTOP) with calls pending ----------------------------------


def hang_peer(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1, w2}, heartbeats every 0.2 s, silence limit 1 s.

    Protocol: prints ``STARTED`` once a call with no timeout runs on w1, reads one line (the
    test writes ``STOPPED`` right after SIGSTOP), then observes that call, a later call,
    w2 (under load meanwhile: no false positive), and a graceful shutdown.
    """
    from tests.integration import remote_fns as fns

    options = _options(args)
    options.heartbeat_interval, options.heartbeat_timeout = 0.2, 1.0
    asyncrpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=options)
    obs: Observations = {}
    stuck = asyncrpc.rpc_async("w1", fns.sleep, args=(60.0,), timeout=0)
    obs["running_on_w1"] = _poll(
        lambda: asyncrpc.rpc_sync("w1", fns.metrics)["running_requests"] >= 1, 5.0
    )
    print("STARTED", flush=True)
    obs["stdin"] = sys.stdin.readline().strip()
    stopped_at = time.monotonic()
    # w2 stays busy with a long call and many short ones: it must not be declared lost.
    w2_long = asyncrpc.rpc_async("w2", fns.sleep, args=(3.0,), timeout=0)
    w2_calls = [asyncrpc.rpc_async("w2", fns.add, args=(i, 1)) for i in range(256)]
    obs["pending"] = _attempt(lambda: stuck.wait(30.0))
    obs["detected_after"] = time.monotonic() - stopped_at
    obs["later_w1"] = _attempt(lambda: asyncrpc.rpc_sync("w1", fns.add, args=(1, 2)))
    obs["w2_long"] = _attempt(lambda: w2_long.wait(10.0))
    obs["w2_calls_ok"] = asyncrpc.wait_all(w2_calls) == [i + 1 for i in range(256)]
    obs["debug_lost_peers"] = asyncrpc.get_debug_info()["lost_peers"]
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(timeout=5.0))
    _report(obs)
    return 0


# -- scenario: three hosts (network namespaces) ---------------------------------------------


def multi_host(args: argparse.Namespace) -> int:
    """Rank 0 ("h0") of {h0, h1, h2}, each on a host of its own: calls, RRefs held across
    hosts, a call between the two other hosts, and a graceful shutdown."""
    import torch

    from tests.integration import remote_fns as fns

    options = _options(args)
    options.listen_host = args.listen_host
    asyncrpc.init_rpc("h0", rank=0, world_size=3, rpc_backend_options=options)
    obs: Observations = {}
    obs["h1_add"] = _attempt(lambda: asyncrpc.rpc_sync("h1", fns.add, args=(2, 3)))
    obs["h2_whoami"] = _attempt(lambda: asyncrpc.rpc_sync("h2", fns.whoami))
    holder = [asyncrpc.remote("h2", torch.ones, args=(4,))]
    obs["rref_to_here"] = _attempt(lambda: holder[0].to_here().sum().item())
    # h1 fetches the RRef owned by h2: a connection between the two other hosts.
    obs["h1_fetches_from_h2"] = _attempt(
        lambda: asyncrpc.rpc_sync("h1", fns.rref_sum, args=(holder[0],))
    )
    infos = asyncrpc.get_worker_infos()
    obs["peers"] = {i.name: asyncrpc.rpc_sync(i.name, fns.whoami) for i in infos}
    holder.clear()  # released before the shutdown, which checks for leaks
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(timeout=30.0))
    _report(obs)
    return 0


# -- scenario: mutual TLS -------------------------------------------------------------------


def tls(args: argparse.Namespace) -> int:
    """Rank 0 ("t0") of {t0, t1}, mutual TLS with the certificates in ``--tls-dir``."""
    import torch

    from tests.integration import remote_fns as fns

    options = _options(args)
    tls_dir = Path(args.tls_dir)
    options.tls_cert, options.tls_key = str(tls_dir / "worker.pem"), str(tls_dir / "worker.key")
    options.tls_ca = str(tls_dir / "ca.pem")
    asyncrpc.init_rpc("t0", rank=0, world_size=2, rpc_backend_options=options)
    big = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    obs: Observations = {
        "add": _attempt(lambda: asyncrpc.rpc_sync("t1", fns.add, args=(2, 3))),
        "echo_ok": _attempt(
            lambda: bool(torch.equal(asyncrpc.rpc_sync("t1", fns.echo, args=(big,)), big))
        ),
        "t1_address": list(_address_of(1)),
    }
    print("READY " + json.dumps(obs["t1_address"]), flush=True)
    obs["stdin"] = sys.stdin.readline().strip()  # the test has poked t1 meanwhile
    obs["still_serves"] = _attempt(lambda: asyncrpc.rpc_sync("t1", fns.add, args=(1, 1)))
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(timeout=10.0))
    _report(obs)
    return 0


def _address_of(rank: int) -> tuple[str, int]:
    from asyncrpc.runtime.current import current_agent

    address = current_agent().addresses[rank]
    return address.host, address.port


# -- scenario: faults injected by a proxy in front of each worker ---------------------------


class _Ledger:
    """Every call made, how it ended, and whether its reply was its own payload."""

    def __init__(self) -> None:
        self.calls: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def echo(self, worker: str, tag: str, size: int = 16, timeout: float = 0) -> Any:
        import torch

        from tests.integration import remote_fns as fns

        payload = {"tag": tag, "data": torch.full((size,), float(len(self.calls)))}
        entry: dict[str, Any] = {"ended": 0, "ok": None, "error": None}
        self.calls[tag] = entry

        def ended(done: Any) -> None:
            with self._lock:
                entry["ended"] += 1
                exc = done.exception()
                if exc is None:
                    back = done.value()
                    entry["ok"] = back["tag"] == tag and bool(
                        torch.equal(back["data"], payload["data"])
                    )
                else:
                    entry["error"] = type(exc).__name__

        future = asyncrpc.rpc_async(worker, fns.echo, args=(payload,), timeout=timeout)
        future.add_done_callback(ended)
        return future

    def summary(self) -> dict[str, Any]:
        return {
            "calls": len(self.calls),
            "ended_once": all(e["ended"] == 1 for e in self.calls.values()),
            "mismatched": sum(1 for e in self.calls.values() if e["ok"] is False),
            "by_tag": self.calls,
        }


def faults(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, f1..f4}; fi listens on a fixed port behind a FaultProxy that this
    process runs (``--proxies`` lists listen:proxy ports). f1 is delayed, f2 black-holed,
    f3 dropped, f4 cut mid-frame; heartbeats every 0.2 s, silence limit 1 s."""
    from asyncrpc.testing.faultproxy import FaultProxy
    from tests.integration import remote_fns as fns

    pairs = [tuple(int(p) for p in item.split(":")) for item in args.proxies.split(",")]
    proxies = {f"f{i + 1}": FaultProxy(target, port) for i, (target, port) in enumerate(pairs)}
    options = _options(args)
    options.heartbeat_interval, options.heartbeat_timeout = 0.2, 1.0
    options.unix_sockets = False  # through the proxies, which sit on TCP
    asyncrpc.init_rpc("driver", rank=0, world_size=5, rpc_backend_options=options)
    ledger, obs = _Ledger(), {}
    for name in proxies:  # connect through each proxy first
        ledger.echo(name, f"{name}-warm").wait(10)
    # Delay: calls are slow, not lost.
    proxies["f1"].delay(0.3)
    started = time.monotonic()
    ledger.echo("f1", "f1-delayed").wait(10)
    obs["f1_delayed_s"] = time.monotonic() - started
    proxies["f1"].heal()
    # Black hole: only heartbeats can tell; the pending call fails typed.
    pending = [ledger.echo("f2", f"f2-{i}") for i in range(3)]
    proxies["f2"].blackhole()
    stuck = asyncrpc.rpc_async("f2", fns.sleep, args=(30.0,), timeout=0)
    started = time.monotonic()
    obs["f2_stuck"] = _attempt(lambda: stuck.wait(20))
    obs["f2_detected_s"] = time.monotonic() - started
    # Drop: a reset; the call in flight fails at once.
    slow = asyncrpc.rpc_async("f3", fns.sleep, args=(30.0,), timeout=0)
    time.sleep(0.2)
    proxies["f3"].drop()
    started = time.monotonic()
    obs["f3_pending"] = _attempt(lambda: slow.wait(20))
    obs["f3_detected_s"] = time.monotonic() - started
    # Truncate: the next frame towards f4 is cut in the middle (a 1 MiB payload).
    proxies["f4"].truncate(1000)
    cut = ledger.echo("f4", "f4-cut", size=1 << 18)
    obs["f4_cut"] = _attempt(lambda: cut.wait(20))
    obs["later_f4"] = _attempt(lambda: ledger.echo("f4", "f4-later").wait(5))
    obs["f1_after"] = _attempt(lambda: ledger.echo("f1", "f1-after").wait(10) is not None)
    for future in pending:
        with contextlib.suppress(Exception):
            future.wait(5)
    time.sleep(0.2)  # done callbacks run on the agent's loop
    obs["ledger"] = ledger.summary()
    obs["metrics"] = asyncrpc.get_metrics()
    asyncrpc.shutdown(graceful=False)
    for proxy in proxies.values():
        proxy.close()
    _report(obs)
    return 0


# -- scenario: a big world on one host -----------------------------------------------------


def big_world(args: argparse.Namespace) -> int:
    """Rank 0 of ``--world-size`` workers named b0..bN: every worker calls every other
    once (all pairs, both ways, concurrently), then a graceful shutdown."""
    from tests.integration import remote_fns as fns

    size = args.world_size
    started = time.monotonic()
    asyncrpc.init_rpc("b0", rank=0, world_size=size, rpc_backend_options=_options(args))
    obs: Observations = {"init_s": time.monotonic() - started}
    names = [f"b{r}" for r in range(size)]
    started = time.monotonic()
    answered = [asyncrpc.rpc_async(n, fns.call_everyone, args=(names,)) for n in names[1:]]
    answered.append(asyncrpc.rpc_async("b0", fns.call_everyone, args=(names,)))
    obs["answers"] = _attempt(lambda: asyncrpc.wait_all(answered))
    obs["calls_s"] = time.monotonic() - started
    started = time.monotonic()
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(timeout=120.0))
    obs["shutdown_s"] = time.monotonic() - started
    _report(obs)
    return 0


# -- scenario: one member of a group (rendezvous variants, duplicates) ---------------------


def _member_options(args: argparse.Namespace) -> object:
    if not args.torch_options:
        return _options(args)
    return _rpc_names(args).TensorPipeRpcBackendOptions(
        init_method=args.init_method, rpc_timeout=args.rpc_timeout, num_worker_threads=8
    )


def _rpc_names(args: argparse.Namespace) -> Any:
    if args.names_from == "asyncrpc":
        return asyncrpc
    import torch.distributed.rpc as torch_rpc

    return torch_rpc


def _delay_registration(seconds: float) -> None:
    """Fault injection: the thread that called init_rpc registers the new agent late.

    Models that thread being descheduled between the agent's start (on its loop thread)
    and ``set_agent``; nothing in the library is changed.
    """
    import asyncrpc.api
    from asyncrpc.runtime.current import set_agent

    def late(agent: Any) -> None:
        time.sleep(seconds)
        set_agent(agent)

    vars(asyncrpc.api)["set_agent"] = late


def member(args: argparse.Namespace) -> int:
    """Join as ``--name``/``--rank``, call each ``--call`` peer, then shut down.

    The call is ``--call-fn`` (``pid``, or ``whoami`` which needs the callee's agent
    registered); each outcome is recorded, never raised.

    Exits 1 when init_rpc fails (the error is in the JSON), 0 otherwise.
    """
    from tests.integration import remote_fns as fns

    backend = None
    if args.torch_options:
        backend = _rpc_names(args).BackendType.TENSORPIPE
    if args.slow_register > 0:
        _delay_registration(args.slow_register)
    rank = -1 if args.rank is None else args.rank
    init = _attempt(
        lambda: asyncrpc.init_rpc(
            args.name, backend, rank, args.world_size, rpc_backend_options=_member_options(args)
        )
    )
    obs: Observations = {"init": init}
    if init["error"] is not None:
        _report(obs)
        return 1
    obs["rank"] = asyncrpc.get_worker_info().id
    obs["world"] = [info.name for info in asyncrpc.get_worker_infos()]
    obs["rpc_timeout"] = asyncrpc.get_rpc_timeout()
    obs["thread_pool_size"] = asyncrpc.get_metrics()["thread_pool_size"]
    fn = fns.whoami if args.call_fn == "whoami" else fns.pid
    obs["pid"] = os.getpid()
    obs["calls"] = {
        peer: _attempt(functools.partial(asyncrpc.rpc_sync, peer, fn)) for peer in args.call
    }
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(timeout=args.shutdown_timeout))
    _report(obs)
    return 0 if obs["shutdown"]["error"] is None else 3


# -- scenario: calls sent while the first connection is being made ------------------------


def first_calls_in_order(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1}: fire many calls to w1 before any connection to it exists.

    The first ones wait for the connection; the later ones find it made. Observes the order
    in which w1's loop ran them (an ``@inline`` function records each as it is read).
    """
    from tests.integration import remote_fns as fns

    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=_options(args))
    futures = []
    for i in range(400):  # paced: the calls straddle the moment the connection is made
        futures.append(asyncrpc.rpc_async("w1", fns.inline_record, args=(i,)))
        time.sleep(0.0001)
    obs: Observations = {"calls": _attempt(lambda: asyncrpc.wait_all(futures) and None)}
    obs["arrivals"] = asyncrpc.rpc_sync("w1", fns.arrivals)
    obs["shutdown"] = _attempt(lambda: asyncrpc.shutdown(timeout=args.shutdown_timeout))
    _report(obs)
    return 0


# -- scenario: the asyncio style (the agent on the program's own loop) ---------------------


async def _cancelled_remotely(tag: str) -> bool:
    from tests.integration import remote_fns as fns

    for _ in range(100):
        if await asyncrpc.call("w1", fns.was_cancelled, tag):
            return True
        await asyncio.sleep(0.02)
    return False


async def _asyncio_checks(obs: Observations) -> None:
    from asyncrpc.runtime.current import current_agent
    from tests.integration import remote_fns as fns

    agent = current_agent()
    obs["agent_on_running_loop"] = agent.loop is asyncio.get_running_loop()
    obs["agent_on_this_thread"] = agent.loop_thread_id == threading.get_ident()
    obs["loop_threads"] = [t.name for t in threading.enumerate() if t.name == "asyncrpc-driver"]
    obs["call"] = await asyncrpc.call("w1", fns.add, 20, 22)
    try:
        async with asyncio.timeout(0.3):
            obs["finished"] = await asyncrpc.call(
                "w1", fns.async_sleep_noting_cancel, 20.0, "asyncio-style"
            )
        obs["timeout_error"] = None
    except TimeoutError as exc:
        obs["timeout_error"] = _error(exc)
    obs["remote_cancelled"] = await _cancelled_remotely("asyncio-style")
    obs["blocking_on_loop"] = _attempt(lambda: asyncrpc.rpc_sync("w1", fns.add, args=(1, 1)))
    obs["from_thread"] = await asyncio.to_thread(asyncrpc.rpc_sync, "w1", fns.add, (2, 3))
    obs["call_after_thread"] = await asyncrpc.call("w1", fns.async_add, 1, 2)


async def _asyncio_style(args: argparse.Namespace) -> Observations:
    obs: Observations = {"threads_before": threading.active_count()}
    async with asyncrpc.worker(
        "driver", rank=0, world_size=2, rpc_backend_options=_options(args)
    ) as info:
        obs["info"] = [info.name, info.id]
        obs["threads_inside"] = threading.active_count()
        await _asyncio_checks(obs)
    obs["shut_down"] = _attempt(asyncrpc.get_worker_info)["error"]
    return obs


def asyncio_style(args: argparse.Namespace) -> int:
    """Rank 0 of {driver, w1} under ``async with asyncrpc.worker(...)`` on asyncio.run."""
    _report(asyncio.run(_asyncio_style(args)))
    return 0


# -- scenario: the API before init_rpc and after shutdown ----------------------------------


def not_initialized(args: argparse.Namespace) -> int:
    """rpc_sync before init_rpc, a group of one, then rpc_sync after its shutdown."""
    from tests.integration import remote_fns as fns

    obs: Observations = {
        "before": _attempt(lambda: asyncrpc.rpc_sync("solo", fns.add, args=(1, 2)))["error"]
    }
    asyncrpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=_options(args))
    obs["during"] = asyncrpc.rpc_sync("solo", fns.add, args=(1, 2))
    asyncrpc.shutdown()
    obs["after"] = _attempt(lambda: asyncrpc.rpc_sync("solo", fns.add, args=(1, 2)))["error"]
    obs["is_runtime_error"] = isinstance(NotInitializedError(), RuntimeError)
    _report(obs)
    return 0


SCENARIOS: dict[str, Callable[[argparse.Namespace], int]] = {
    "kill_peer": kill_peer,
    "hang_peer": hang_peer,
    "multi_host": multi_host,
    "tls": tls,
    "faults": faults,
    "big_world": big_world,
    "member": member,
    "asyncio_style": asyncio_style,
    "not_initialized": not_initialized,
    "first_calls_in_order": first_calls_in_order,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--init-method", default="env://")
    parser.add_argument("--name", default="driver")
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--rpc-timeout", type=float, default=10.0)
    parser.add_argument("--shutdown-timeout", type=float, default=10.0)
    parser.add_argument("--graceful", type=int, default=1)
    parser.add_argument("--torch-options", action="store_true")
    # Where --torch-options takes TensorPipeRpcBackendOptions and BackendType from: torch,
    # or asyncrpc's own names of them (a program whose only change is the import).
    parser.add_argument("--names-from", choices=["torch", "asyncrpc"], default="torch")
    parser.add_argument("--call", action="append", default=[])
    parser.add_argument("--call-fn", choices=("pid", "whoami"), default="pid")
    parser.add_argument("--slow-register", type=float, default=0.0)
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--tls-dir", default="")
    parser.add_argument("--proxies", default="")
    args = parser.parse_args(argv)
    args.graceful = bool(args.graceful)
    return SCENARIOS[args.scenario](args)


# -- test side: start a scenario process and read its result ------------------------------


class ScenarioProcess:
    """A scenario process we started: its output lines arrive through a reader thread."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def text(self) -> str:
        return "".join(self.output)

    def wait_line(self, wanted: str, timeout: float) -> str:
        """Wait for an output line that is ``wanted`` or starts with it and a space; return
        it. AssertionError with the output if none comes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {wanted!r} within {timeout} s:\n{self.text()}") from None
            if line is None:
                raise AssertionError(f"exited before {wanted!r}:\n{self.text()}")
            if line == wanted or line.startswith(wanted + " "):
                return line

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def result(self, timeout: float) -> tuple[int, Observations]:
        """Wait for the exit; return the exit code and the parsed ``RESULT`` line."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"scenario still running after {timeout} s:\n{self.text()}"
            ) from None
        self._reader.join(5)
        for line in self.output:
            if line.startswith(RESULT_PREFIX):
                return code, json.loads(line[len(RESULT_PREFIX) :])
        raise AssertionError(f"no RESULT line (exit code {code}):\n{self.text()}")

    def kill(self) -> None:
        """SIGKILL the process (by the PID we started) if it still runs, reap it, close pipes."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._reader.join(5)  # EOF once the process is gone: the pipe can then be closed
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def start(
    scenario: str,
    *args: str,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
    module: str = "tests.integration.scenarios",
) -> ScenarioProcess:
    """Start ``python -m tests.integration.scenarios scenario *args`` from the repository root.

    Args:
        scenario: one of ``SCENARIOS`` (of ``module``).
        *args: its command-line options.
        env: extra environment variables.
        prefix: a launcher that execs the command in place (``ip netns exec NS``).
        module: the scenario module (another one with the same ``main`` and output).

    Returns:
        The running process; the caller stops it with ``kill`` in a ``finally``.
    """
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    process = subprocess.Popen(
        [*prefix, sys.executable, "-m", module, scenario, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=_ROOT,
    )
    return ScenarioProcess(process)


if __name__ == "__main__":
    sys.exit(main())
