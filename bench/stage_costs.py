"""Time each stage of asyncrpc's small-call path in one process, in microseconds per call.

Stages: pickling and framing a request (as ``Outbox.encode`` does), decoding it,
unpickling, the reply's way back, and the thread hand-offs a call makes (loop -> pool ->
loop on the callee for a ``def`` function; caller thread -> loop -> caller for
``rpc_sync``). A one-worker group runs on a uvloop so the real serializer (with its RRef
hook) is used. Compare the sum with a call's round trip from ``python -m asyncrpc.bench``.

    .venv/bin/python bench/stage_costs.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import asyncrpc
from asyncrpc.bench import workloads
from asyncrpc.protocol.wire import FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import Reply, Request, decode_message
from asyncrpc.runtime.calls.pipeline import CallKind
from asyncrpc.runtime.current import current_agent
from asyncrpc.runtime.futures import Future
from asyncrpc.runtime.threads.loopthread import new_event_loop
from asyncrpc.runtime.threads.pool import WorkerPool
from asyncrpc.testing import free_port

N = 20000


def per_call_us(fn: Callable[[], object], n: int = N, repeat: int = 5) -> float:
    """Best-of-``repeat`` mean time of ``fn()`` in microseconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
    return best


def serde_stages(agent: Any, fn: Any, args: tuple[Any, ...], result: Any) -> dict[str, float]:
    ser, decoder = agent.serializer, FrameDecoder(allocate=agent.serializer.allocate)
    request = Request(1, 60.0, 0, "x", None, None)
    payload, segments, _, _ = ser.dumps((fn, args, {}), context=0)
    pieces = encode_frame(request.to_fields(), payload, segments)
    wire = b"".join(bytes(p) for p in pieces)
    frame = decoder.feed(wire)[0]
    r_payload, r_segments, _, _ = ser.dumps(result, context=0)
    reply_wire = b"".join(bytes(p) for p in encode_frame(Reply(1).to_fields(), r_payload,
                                                          r_segments))  # fmt: skip
    reply = decoder.feed(reply_wire)[0]
    return {
        "caller: Outbox.encode (pickle + Request + frame)":
            per_call_us(lambda: agent.outbox.encode(0, fn, args, {}, 60.0, CallKind.SYNC)),
        "  of which Serializer.dumps((fn, args, {}))":
            per_call_us(lambda: ser.dumps((fn, args, {}), context=0)),
        "  of which encode_frame(header)":
            per_call_us(lambda: encode_frame(request.to_fields(), payload, segments)),
        "callee: FrameDecoder.feed(request bytes)": per_call_us(lambda: decoder.feed(wire)),
        "callee: decode_message(fields)": per_call_us(lambda: decode_message(frame.fields)),
        "callee: Serializer.loads(request)":
            per_call_us(lambda: ser.loads(frame.payload, frame.segments, context=0)),
        "callee: dumps(result) + encode_frame(Reply)":
            per_call_us(lambda: encode_frame(Reply(1).to_fields(),
                                             *ser.dumps(result, context=0)[:2])),
        "caller: FrameDecoder.feed(reply bytes)": per_call_us(lambda: decoder.feed(reply_wire)),
        "caller: Serializer.loads(reply)":
            per_call_us(lambda: ser.loads(reply.payload, reply.segments, context=0)),
        f"request bytes on the wire ({len(wire)} B), reply ({len(reply_wire)} B)": 0.0,
    }  # fmt: skip


async def _median_us(run: Callable[[], Any], n: int = 3000) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await run()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


async def handoff_stages() -> dict[str, float]:
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(16)

    async def loop_only() -> None:
        fut = loop.create_future()
        loop.call_soon(fut.set_result, None)
        await fut

    async def via_pool() -> None:
        # What the callee did for a `def` function before WorkerPool: ThreadPoolExecutor.
        fut = loop.create_future()
        pool.submit(lambda: loop.call_soon_threadsafe(fut.set_result, None))
        await fut

    workers = WorkerPool(16, loop, "stages")

    async def via_workers() -> None:
        # What the callee does now: WorkerPool.submit, run, post back (batched wake-ups).
        fut = loop.create_future()
        workers.submit(lambda: workers.post(fut.set_result, None))
        await fut

    def thread_round_trips(n: int = 3000) -> float:
        # What rpc_sync adds on the caller: thread -> loop (call_soon_threadsafe) and the
        # loop completing an asyncrpc.Future the thread waits on.
        samples = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fut: Future[None] = Future(loop=loop)
            loop.call_soon_threadsafe(fut.set_result, None)
            fut.wait()
            samples.append(time.perf_counter_ns() - t0)
        return statistics.median(samples) / 1e3

    result = {
        "loop only: create_future + call_soon + await": await _median_us(loop_only),
        "callee def hop, ThreadPoolExecutor: loop -> thread -> loop (p50)":
            await _median_us(via_pool),
        "callee def hop, WorkerPool: loop -> thread -> loop (p50)": await _median_us(via_workers),
        "caller rpc_sync hop: thread -> loop -> Future.wait (p50)":
            await asyncio.to_thread(thread_round_trips),
    }  # fmt: skip
    pool.shutdown()
    workers.shutdown()
    return result


async def main() -> None:
    options = asyncrpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}")
    await asyncrpc.init_rpc_async("solo", rank=0, world_size=1, rpc_backend_options=options)
    agent = current_agent()
    try:
        cases = {
            "def no-op": (workloads.noop, (), None),
            "torch.add(ones(2), ones(2))": (torch.add, (torch.ones(2), torch.ones(2)),
                                           torch.ones(2)),
        }  # fmt: skip
        for name, (fn, args, result) in cases.items():
            print(f"\n== serialization and framing, {name} (best of 5, µs per call)")
            for stage, us in serde_stages(agent, fn, args, result).items():
                print(f"  {us:7.2f}  {stage}" if us else f"           {stage}")
        print("\n== thread hand-offs (median µs per round trip)")
        for stage, us in (await handoff_stages()).items():
            print(f"  {us:7.2f}  {stage}")
        print(f"\nthread switch interval: {sys.getswitchinterval() * 1e3:.1f} ms")
    finally:
        await asyncrpc.shutdown_async()
    _ = threading  # imported for readers: the hand-offs above cross threads


if __name__ == "__main__":
    loop = new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
