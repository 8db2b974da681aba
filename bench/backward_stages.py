"""Where one hop of ``dist_autograd.backward`` spends its time, stage by stage.

The "backward alone" row of a plain user program (issue 33's ``plain_step.py``): inside a
context, ``y = rpc_sync("w1", forward, args=(rref, xg))`` through an RRef'd
``Linear(64, 64)`` + relu, then ``backward(ctx, [y.sum()])`` timed alone. Two spawned
processes; both stamp named events with ``time.perf_counter_ns`` (one clock for the whole
host: CLOCK_MONOTONIC), and the events of each backward are put on one time line. For
each event: the median time since ``backward()`` began, and the median step from the
event before it. CPU per backward (user + system, each process) is read around the loop.

The stamps are wrappers put around a few functions at start (the local passes, the
hand-over to the loop, frames in and out, the credit); each costs ~1 µs.

    .venv/bin/python bench/backward_stages.py [--n 400] [--rounds 1]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

# (event, wall ns, this thread's CPU ns, thread id)
STAMPS: list[tuple[str, int, int, int]] = []
_ARMED = [False]


def stamp(name: str) -> None:
    if _ARMED[0]:
        STAMPS.append((name, time.perf_counter_ns(), time.thread_time_ns(), threading.get_ident()))


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def forward(rref: Any, x: torch.Tensor) -> torch.Tensor:
    return rref.local_value()(x)  # type: ignore[no-any-return]


def arm(on: bool) -> None:
    _ARMED[0] = on


def take_stamps() -> list[tuple[str, int, int, int]]:
    out = list(STAMPS)
    STAMPS.clear()
    return out


def rusage_us() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_utime + r.ru_stime) * 1e6


def _wrap(owner: Any, name: str, label: str, end: bool = True) -> None:
    inner = getattr(owner, name, None)
    if inner is None:  # renamed since: say so rather than stop the run
        print(f"backward_stages: no {name} on {owner!r}; not stamped", file=sys.stderr)
        return

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stamp(label)
        try:
            return inner(*args, **kwargs)
        finally:
            if end:
                stamp(label + " end")

    setattr(owner, name, wrapper)


def install(side: str) -> None:
    """Wrap the stages of a backward hop with stamps (``side``: "c" or "s")."""
    import asyncrpc.autograd as ag
    from asyncrpc.autograd import engine
    from asyncrpc.autograd.feature import context_table
    from asyncrpc.runtime.current import current_agent

    _, table = context_table()
    agent = current_agent()
    if side == "c":
        _wrap(ag, "local_pass", "c thread: local pass")
    hop = engine.Hop
    _wrap(hop, "onward", f"{side}: onward (send on, or reply)")
    _wrap(hop, "follow", f"{side} loop: a reply brought gradients back", end=False)
    _wrap(agent.outbox, "start", f"{side} loop: write request")
    _wrap(engine, "loop_pass", f"{side} loop: loop pass")
    # On the loop as the request arrives; "end": when it returned its future.
    _wrap(engine, "grads_arrived", f"{side} loop: grads_arrived")
    _wrap(hop, "run_on_thread", f"{side} thread: hop's pass")
    # A hop on a lane: run by the callee's lane thread.
    _wrap(engine, "grads_here", f"{side} lane thread: grads_here")
    _wrap(hop, "_pass", f"{side} thread: a pass on this thread (Hop._pass)")
    # A coded hop on a lane (the root's one hop): served by the callee's lane thread.
    from asyncrpc.runtime.lanes.server import LaneServer

    _wrap(LaneServer, "_serve_coded", f"{side} lane thread: a coded hop")
    _wrap(hop, "run_here", f"{side} thread: the hop's pass (run_here)")
    _wrap(table.credits, "hand_back", f"{side}: credit handed back", end=False)
    if os.environ.get("STAGES_FINE"):
        _install_fine(side, agent)
    _install_io(side, agent)


def _install_fine(side: str, agent: Any) -> None:
    """Stamps around the parts of a local pass and of sending a hop."""
    from asyncrpc.autograd import engine, graph
    from asyncrpc.protocol.serde import pickler
    from asyncrpc.runtime import intraop

    parts = ("_plan_loop_pass", "_engine_pass", "_split_roots", "_small_graph_leaves",
             "_group_initialised", "_root_elements")  # fmt: skip
    for name in parts:
        if hasattr(graph, name):
            _wrap(graph, name, f"{side}:   {name}")
    _wrap(engine, "_route", f"{side}:   _route")
    from asyncrpc.runtime.lanes import client as lane_client
    from asyncrpc.runtime.lanes import frames as lane_frames

    _wrap(agent.outbox, "call_future", f"{side}:   call_future")
    _wrap(agent.outbox, "call_coded_on_lane", f"{side}:   call_coded_on_lane")
    # Inside a coded hop: the codec's parts, looked up at call time in its module.
    from asyncrpc.autograd import hopwire
    from asyncrpc.runtime.calls import outbox as outbox_module
    from asyncrpc.runtime.lanes import server as lane_server

    for name in ("reduce_small_tensor", "rebuild_small_tensor", "_dump_batches",
                 "_load_batches", "_unpack"):  # fmt: skip
        _wrap(hopwire, name, f"{side}:     hopwire.{name}")
    _wrap(hopwire.msgpack, "packb", f"{side}:     msgpack.packb")
    _wrap(outbox_module, "encode_frame", f"{side}:     encode_frame (outbox)")
    _wrap(lane_server, "encode_frame", f"{side}:     encode_frame (lane server)")
    _wrap(lane_frames.BlockingFrames, "write", f"{side}:   lane write")
    _wrap(lane_frames.BlockingFrames, "read", f"{side}:   lane read")
    _wrap(lane_client.CallerLanes, "call", f"{side}:   lane call")
    _wrap(agent.outbox, "encode", f"{side}:   encode")
    _wrap(intraop.one_thread, "__enter__", f"{side}:   one_thread enter")
    _wrap(pickler.Serializer, "loads", f"{side}:   loads")
    _wrap(pickler.Serializer, "dumps", f"{side}:   dumps")
    for name in ("_then_follow", "_summed", "collect_all", "by_sender", "split"):
        if hasattr(engine, name):
            _wrap(engine, name, f"{side}:   {name}")


def _install_io(side: str, agent: Any) -> None:
    """Stamps for frames in and replies out on the loop (lanes are not seen here)."""
    from asyncrpc.protocol.wire.messages import Kind

    write = agent.dispatcher._write

    def write_reply(*args: Any) -> None:
        stamp(f"{side} loop: write reply")
        write(*args)

    agent.dispatcher._write = write_reply
    on_frame = agent.on_frame

    def frame_in(conn: Any, frame: Any) -> None:
        kind = frame.fields[0] if frame.fields else None
        label = "reply" if kind == Kind.REPLY else "request" if kind == Kind.REQUEST else kind
        stamp(f"{side} loop: {label} in")
        on_frame(conn, frame)

    agent.on_frame = frame_in


def _loop_thread_time(agent: Any) -> float:
    import concurrent.futures

    fut: concurrent.futures.Future[float] = concurrent.futures.Future()
    agent.loop.aio.call_soon_threadsafe(lambda: fut.set_result(time.thread_time()))
    return fut.result(timeout=10) * 1e6


def server_call(what: str) -> Any:
    if what == "install":
        install("s")
        return None
    if what == "arm":
        arm(True)
        return rusage_us()
    if what == "disarm":
        arm(False)
        return rusage_us(), take_stamps()
    raise ValueError(what)


def worker(rank: int, port: int, out: str, n: int) -> None:
    import asyncrpc as rpc
    import asyncrpc.autograd as ag
    from asyncrpc.runtime.current import current_agent

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        rref = rpc.remote("w1", Layer)
        xg = torch.randn(32, 64, requires_grad=True)
        agent = current_agent()
        install("c")
        rpc.rpc_sync("w1", server_call, args=("install",))
        wall: list[float] = []

        def once(armed: bool) -> None:
            with ag.context() as c:
                y = rpc.rpc_sync("w1", forward, args=(rref, xg))
                loss = y.sum()
                arm(armed)
                t0 = time.perf_counter_ns()
                stamp("c thread: backward() called")
                ag.backward(c, [loss])
                stamp("c thread: backward() returned")
                wall.append((time.perf_counter_ns() - t0) / 1e3)
                arm(False)

        for _ in range(max(20, n // 8)):
            once(False)
        wall.clear()
        s_cpu0 = rpc.rpc_sync("w1", server_call, args=("arm",))
        c_cpu0, c_thread0, c_loop0 = rusage_us(), time.thread_time() * 1e6, _loop_thread_time(agent)
        for _ in range(n):
            once(True)
        time.sleep(0.05)  # the replies of the last hop come back
        c_cpu1, c_thread1, c_loop1 = rusage_us(), time.thread_time() * 1e6, _loop_thread_time(agent)
        s_cpu1, s_stamps = rpc.rpc_sync("w1", server_call, args=("disarm",))
        result = {
            "wall": wall,
            "client_stamps": take_stamps(),
            "server_stamps": s_stamps,
            # The forward calls are inside the loop too: subtracted by the caller.
            "cpu": {"client": (c_cpu1 - c_cpu0) / n, "server": (s_cpu1 - s_cpu0) / n,
                    "client thread": (c_thread1 - c_thread0) / n,
                    "client loop": (c_loop1 - c_loop0) / n},
        }  # fmt: skip
        with open(out, "w") as f:
            json.dump(result, f)
    rpc.shutdown()


def _cpu_steps(stamps: list[list[Any]]) -> list[tuple[int, str, float | None]]:
    """(wall ns, event, CPU µs its thread used since that thread's event before, if any)."""
    last: dict[int, int] = {}
    out: list[tuple[int, str, float | None]] = []
    for name, t, cpu, thread in stamps:
        before = last.get(thread)
        last[thread] = cpu
        out.append((t, name, None if before is None else (cpu - before) / 1e3))
    return out


def timeline(result: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(event, median µs since backward() began, median µs since the event before, median
    CPU µs of its thread since that thread's event before)."""
    server = [(t, "  " + name, cpu) for t, name, cpu in _cpu_steps(result["server_stamps"])]
    events = sorted(server + _cpu_steps(result["client_stamps"]), key=lambda e: e[0])
    starts = [t for t, name, _ in events if name == "c thread: backward() called"]
    offsets: dict[str, list[float]] = {}
    steps: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for i, t0 in enumerate(starts):
        t_end = starts[i + 1] if i + 1 < len(starts) else float("inf")
        seen: dict[str, int] = {}
        prev = t0
        for t, name, cpu in (e for e in events if t0 <= e[0] < t_end):
            seen[name] = seen.get(name, 0) + 1
            key = name if seen[name] == 1 else f"{name} #{seen[name]}"
            offsets.setdefault(key, []).append((t - t0) / 1e3)
            steps.setdefault(key, []).append((t - prev) / 1e3)
            cpus.setdefault(key, []).append(0.0 if cpu is None else cpu)
            prev = t
    order = {key: statistics.median(xs) for key, xs in offsets.items()}
    keys = sorted(order, key=order.__getitem__)
    return [
        (k, order[k], statistics.median(steps[k]), statistics.median(cpus[k]))
        for k in keys
        if len(offsets[k]) > len(starts) // 2
    ]


def run_once(n: int) -> dict[str, Any]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen([sys.executable, __file__, "--_worker", str(r), str(port), out, str(n)],
                         env=env, stdout=subprocess.DEVNULL)
        for r in range(2)
    ]  # fmt: skip
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    with open(out) as f:
        text = f.read()
    os.unlink(out)
    return json.loads(text) if text else {}


def report(result: dict[str, Any]) -> None:
    wall = sorted(result["wall"])
    print(f"backward() p50 {wall[len(wall) // 2]:.0f} µs, p10 {wall[len(wall) // 10]:.0f}, "
          f"p90 {wall[len(wall) * 9 // 10]:.0f} ({len(wall)} passes)")  # fmt: skip
    print("CPU µs per iteration (forward + backward): "
          + ", ".join(f"{k} {v:.0f}" for k, v in result["cpu"].items()))  # fmt: skip
    print(f"{'event (server indented)':58} {'at µs':>8} {'step µs':>8} {'thread CPU µs':>14}")
    for name, at, step, cpu in timeline(result):
        print(f"{name:58} {at:8.1f} {step:8.1f} {cpu:14.1f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        rank, port, out, n = sys.argv[2:6]
        worker(int(rank), int(port), out, int(n))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.rounds):
        result = run_once(args.n)
        if not result:
            print("the run failed")
            continue
        report(result)
        print()


if __name__ == "__main__":
    main()
