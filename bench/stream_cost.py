"""Streams against calls: small items, 1 MiB tensors, and a stalled consumer's memory.

    python bench/stream_cost.py [--rounds 3] [--items 20000] [--calls 3000] [--tensors 200]
                                [--grpc-python /path/to/venv/bin/python]

Each round starts a fresh pair of workers on 127.0.0.1 (this process, on uvloop with
``init_rpc_async``, and one server) and measures, in the same run:

- small items: a stream of ``--items`` ints (a plain generator on the server's pool),
  items/s, beside one ``await asyncrpc.call`` of a no-op per item, calls/s; the same
  ints the other way, as a stream argument (``stream_arg(range(n))``, advanced on this
  worker's pool, read by an ``async def`` on the server's loop), items/s; and a
  bidirectional stream echoing them (``await b.send(i)`` from one task, the replies read
  by another), items/s each way;
- 1 MiB float32 tensors: a stream of ``--tensors`` of them, MB/s one way, beside the echo
  bandwidth of the same tensor (2 x bytes / median round trip, as the main bench);
- a stalled consumer: a stream of fresh 1 MiB tensors with a window of 8 whose consumer
  takes one item and then waits 1 s: how many items the producer made, the shared memory
  it lent for them (items to a peer on this host travel through it, so that is where they
  wait), and how much the consumer's resident memory grew;
- the same with fresh 16 MiB tensors, the default item window (128) and a byte window of
  64 MiB: the bytes stop the producer at 4 items, where the items alone would allow 2 GiB.

Each small-item row also gives the CPU time both processes spent on it, per item (per
call for the calls): user + system time from ``/proc/PID/stat``, this process's and the
server's, over the row, divided by its count. Medians over rounds. With ``--grpc-python``
(a Python with grpcio installed), the same small-item and 1 MiB rates of gRPC's server
streaming and unary calls (``grpc.aio``, bytes messages, no protobuf) are measured by
``bench/grpc_stream.py`` under that Python.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import uvloop

import asyncrpc
from asyncrpc.bench import workloads as fns
from asyncrpc.testing import free_port, spawn_worker, stop_workers

MIB_FLOATS = 1 << 18
STALL_WINDOW = 8
# The byte-window row: 4 items of 16 MiB by default; the full size is
# STALL_ITEM_MIB=64 STALL_WINDOW_MIB=256 (1.3 GiB of memory while it runs).
STALL_ITEM_MIB = int(os.environ.get("STALL_ITEM_MIB", "16"))
STALL_WINDOW_MIB = int(os.environ.get("STALL_WINDOW_MIB", "64"))


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


class _Cpu:
    """CPU seconds of this process and the server, between two readings."""

    def __init__(self, server: int) -> None:
        self._pids = (os.getpid(), server)
        self._start = self._now()

    def _now(self) -> float:
        return sum(_cpu_s(pid) for pid in self._pids)

    def us_per(self, count: int) -> float:
        """CPU µs per item since this was made (or last asked)."""
        now = self._now()
        spent, self._start = now - self._start, now
        return spent / count * 1e6


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _small(items: int, calls: int, server: int) -> dict[str, float]:
    for _ in range(200):  # warm-up: connection, code paths
        await asyncrpc.call("server", fns.noop)
    cpu = _Cpu(server)
    started = time.perf_counter()
    for _ in range(calls):
        await asyncrpc.call("server", fns.noop)
    calls_per_s = calls / (time.perf_counter() - started)
    out = {"calls_per_s": calls_per_s, "calls_cpu_us": cpu.us_per(calls)}
    started = time.perf_counter()
    count = 0
    async for _ in asyncrpc.stream("server", fns.stream_items, items):
        count += 1
    out["items_per_s"] = count / (time.perf_counter() - started)
    out["items_cpu_us"] = cpu.us_per(items)
    assert count == items
    # The same stream read with `for` on another thread (a synchronous consumer).
    started = time.perf_counter()
    count = await asyncio.to_thread(
        lambda: sum(1 for _ in asyncrpc.stream("server", fns.stream_items, items))
    )
    out["sync_items_per_s"] = count / (time.perf_counter() - started)
    out["sync_items_cpu_us"] = cpu.us_per(items)
    out["client_items_per_s"] = await _client_stream(items)
    out["client_items_cpu_us"] = cpu.us_per(items)
    out["bidi_items_per_s"] = await _bidi(items)
    out["bidi_items_cpu_us"] = cpu.us_per(items)
    return out


async def _client_stream(items: int) -> float:
    """A stream argument of ``items`` ints, read on the server's loop; items/s."""
    started = time.perf_counter()
    count = await asyncrpc.call("server", fns.stream_count, asyncrpc.stream_arg(range(items)))
    assert count == items
    return items / (time.perf_counter() - started)


async def _bidi(items: int) -> float:
    """``items`` ints echoed on a bidirectional stream, sent and read at once; items/s."""
    started = time.perf_counter()
    link = asyncrpc.bidi("server", fns.bidi_echo)

    async def send() -> None:
        for i in range(items):
            await link.send(i)
        link.done_sending()

    sender = asyncio.ensure_future(send())
    count = 0
    async for _ in link:
        count += 1
    await sender
    assert count == items
    return items / (time.perf_counter() - started)


async def _tensors(n: int) -> dict[str, float]:
    tensor = torch.ones(MIB_FLOATS)
    size = tensor.numel() * 4
    for _ in range(5):  # warm-up: shared-memory probe, chunks of this size
        await asyncrpc.call("server", fns.echo, tensor)
    times = []
    for _ in range(30):
        started = time.perf_counter()
        await asyncrpc.call("server", fns.echo, tensor)
        times.append(time.perf_counter() - started)
    echo = 2 * size / statistics.median(times) / 1e6
    started = time.perf_counter()
    got = 0
    async for item in asyncrpc.stream("server", fns.stream_tensors, n, MIB_FLOATS):
        got += item.numel() * 4
    stream = got / (time.perf_counter() - started) / 1e6
    return {"echo_mb_per_s": echo, "stream_mb_per_s": stream}


async def _stalled(
    key: str, floats: int, window: int | None = None, window_bytes: int | None = None
) -> dict[str, float]:
    before = _rss_mib()
    stream = asyncrpc.rpc_stream(
        "server", fns.stream_fresh_tensors, args=(key, floats), window=window,
        window_bytes=window_bytes,
    )  # fmt: skip
    first = await anext(stream)
    await asyncio.sleep(1.0)  # the consumer stalls; the producer should stop at the window
    made, lent = await asyncrpc.call("server", fns.stream_progress, key)
    grown = _rss_mib() - before
    await stream.aclose()
    del first
    return {f"{key}_made": made, f"{key}_lent_mib": lent / (1 << 20), f"{key}_rss_mib": grown}


async def _client(init: str, args: argparse.Namespace, server: int) -> dict[str, float]:
    options = asyncrpc.RpcBackendOptions(init_method=init, rpc_timeout=120.0)
    async with asyncrpc.worker("client", rank=0, world_size=2, rpc_backend_options=options):
        out = await _small(args.items, args.calls, server)
        out.update(await _tensors(args.tensors))
        out.update(await _stalled("stall", MIB_FLOATS, window=STALL_WINDOW))
        out.update(
            await _stalled(
                "bytes", STALL_ITEM_MIB * MIB_FLOATS, window_bytes=STALL_WINDOW_MIB << 20
            )
        )
    return out


def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    init = f"tcp://127.0.0.1:{free_port()}"
    server = spawn_worker("server", 1, 2, init, log_dir=log_dir)
    try:
        return uvloop.run(_client(init, args, server.pid))
    finally:
        stop_workers([server], timeout=30)


def grpc_figures(python: str, args: argparse.Namespace) -> dict[str, float]:
    script = Path(__file__).with_name("grpc_stream.py")
    cmd = [python, str(script), "--items", str(args.items), "--calls", str(args.calls)]
    cmd += ["--messages", str(args.tensors)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=3_000)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--grpc-python", default="")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(args, Path(tmp)) for _ in range(args.rounds)]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    calls = med("calls_per_s")
    echo, stream = med("echo_mb_per_s"), med("stream_mb_per_s")
    print(f"asyncrpc, medians of {args.rounds} rounds (CPU: both processes, per item)")
    print(f"  await call per item      {calls:12,.0f} calls/s {'':9} {med('calls_cpu_us'):7.1f} µs")
    rows = (
        ("stream, async for", "items"), ("stream, for (a thread)", "sync_items"),
        ("stream_arg, async for", "client_items"), ("bidi echo, send + read", "bidi_items"),
    )  # fmt: skip
    for label, key in rows:
        rate = med(f"{key}_per_s")
        cpu = med(f"{key}_cpu_us")
        print(f"  {label:<24} {rate:12,.0f} items/s   {rate / calls:6.1f}x {cpu:7.1f} µs")
    # On a loaded machine the rates of a round move together: the ratio of each round
    # (a stream and the calls it is compared with, measured one after the other) is the
    # steadier figure.
    ratios = {
        key: statistics.median(r[key] / r["calls_per_s"] for r in runs)
        for key in ("items_per_s", "client_items_per_s", "bidi_items_per_s")
    }
    print(
        f"  medians of the rounds' ratios to the calls: stream {ratios['items_per_s']:.1f}x, "
        f"stream_arg {ratios['client_items_per_s']:.1f}x, bidi {ratios['bidi_items_per_s']:.1f}x"
    )
    print(f"  echo 1 MiB               {echo:12,.0f} MB/s")
    print(f"  stream of 1 MiB tensors  {stream:12,.0f} MB/s      {stream / echo:6.2f}x of echo")
    print(
        f"  stalled consumer, window {STALL_WINDOW}: producer made {med('stall_made'):.0f} "
        f"items of 1 MiB; shared memory lent by it {med('stall_lent_mib'):.0f} MiB; "
        f"consumer RSS +{med('stall_rss_mib'):.0f} MiB"
    )
    print(
        f"  stalled consumer, {STALL_WINDOW_MIB} MiB byte window: producer made "
        f"{med('bytes_made'):.0f} items of {STALL_ITEM_MIB} MiB; shared memory lent by it "
        f"{med('bytes_lent_mib'):.0f} MiB; consumer RSS +{med('bytes_rss_mib'):.0f} MiB"
    )
    print(f"  rounds: {json.dumps(runs)}")
    if args.grpc_python:
        g = grpc_figures(args.grpc_python, args)
        print("gRPC (grpc.aio, bytes messages), same host")
        print(f"  unary call per item      {g['unary_per_s']:12,.0f} calls/s")
        ratio = g["stream_items_per_s"] / g["unary_per_s"]
        print(
            f"  server streaming         {g['stream_items_per_s']:12,.0f} items/s   {ratio:6.1f}x"
        )
        print(f"  streaming 1 MiB messages {g['stream_mb_per_s']:12,.0f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
