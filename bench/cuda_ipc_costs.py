"""What each CUDA IPC step costs the host, on an idle GPU and behind a busy one.

    python bench/cuda_ipc_costs.py          # needs a CUDA device; two processes on GPU 0

The CUDA path's design rests on which of torch's IPC calls return at once and which wait
for the GPU (and whether they hold the GIL while they do). Only real hardware settles it:
this script times each step in a producer and a consumer process, with the GPU idle and
with a long kernel queued (``torch.cuda._sleep``), and a Python thread ticking every
millisecond meanwhile: its longest gap says whether a step stopped every thread (the GIL
held) or only its caller. Figures go to docs/cuda.md.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

MIB = 1 << 20
NBYTES = 16 * MIB
BUSY_CYCLES = 400_000_000  # a few hundred ms of one kernel
REPEATS = 5


class _Ticker:
    """A thread that wakes every millisecond; ``gap()`` is its longest sleep since reset."""

    def __init__(self) -> None:
        self._gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        for _ in range(10_000_000):  # bounded; stopped by close()
            if self._stop.is_set():
                return
            time.sleep(0.001)
            now = time.perf_counter()
            self._gap = max(self._gap, now - last)
            last = now

    def reset(self) -> None:
        time.sleep(0.005)
        self._gap = 0.0

    def gap(self) -> float:
        time.sleep(0.005)
        return self._gap

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _timed(ticker: _Ticker, step: Callable[[], Any]) -> tuple[float, float, Any]:
    ticker.reset()
    start = time.perf_counter()
    value = step()
    took = time.perf_counter() - start
    return took * 1e3, ticker.gap() * 1e3, value


def _row(name: str, samples: list[tuple[float, float]]) -> dict[str, Any]:
    return {
        "step": name,
        "host ms (median)": round(statistics.median(s[0] for s in samples), 3),
        "host ms (max)": round(max(s[0] for s in samples), 3),
        "other thread's longest gap ms": round(max(s[1] for s in samples), 3),
    }


def _busy() -> None:
    torch.cuda._sleep(BUSY_CYCLES)  # type: ignore[no-untyped-call]


def producer(conn: Any) -> list[dict[str, Any]]:
    ticker = _Ticker()
    source = torch.ones(NBYTES, dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.current_stream(0)
    rows = []
    for busy in (False, True):
        clones, shares, events = [], [], []
        for _ in range(REPEATS):
            torch.cuda.synchronize()
            if busy:
                _busy()
            ms, gap, exported = _timed(ticker, source.clone)
            clones.append((ms, gap))
            ms, gap, desc = _timed(ticker, exported.untyped_storage()._share_cuda_)
            shares.append((ms, gap))

            def event() -> Any:
                ev = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
                ev.record(stream)
                return ev, ev.ipc_handle()  # type: ignore[no-untyped-call]

            ms, gap, (ev, handle) = _timed(ticker, event)
            events.append((ms, gap))
            conn.send((busy, desc, handle))
            conn.recv()  # the consumer is done with it
            del exported, ev
        label = "busy GPU" if busy else "idle GPU"
        rows += [
            _row(f"producer: clone 16 MiB ({label})", clones),
            _row(f"producer: _share_cuda_ of a fresh storage ({label})", shares),
            _row(f"producer: interprocess event + ipc_handle ({label})", events),
        ]
    conn.send(None)
    ticker.close()
    return rows


def _open(stream: Any, desc: tuple[Any, ...]) -> Any:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device, mem, size, offset, counter, counter_offset, event, sync = desc
    with torch.cuda.stream(stream):
        return rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor, (NBYTES,), (1,), 0, torch.UntypedStorage, torch.uint8,
            device, mem, size, offset, False, counter, counter_offset, event, sync,
        )  # fmt: skip


def _open_event(stream: Any, handle: bytes) -> Any:
    ev = torch.cuda.Event.from_ipc_handle(0, handle)  # type: ignore[no-untyped-call]
    stream.wait_event(ev)
    return ev


def consumer(conn: Any) -> None:
    ticker = _Ticker()
    stream = torch.cuda.Stream(0)  # type: ignore[no-untyped-call]
    idle = torch.cuda.Stream(0)  # type: ignore[no-untyped-call]
    samples: dict[str, list[tuple[float, float]]] = {}
    for _ in range(2 * REPEATS + 1):  # bounded: the producer sends 2 * REPEATS, then None
        message = conn.recv()
        if message is None:
            break
        busy, desc, handle = message
        label = "busy GPU" if busy else "idle GPU"
        if busy:
            _busy()  # this process's own long kernel, on its default stream
        ms, gap, opened = _timed(ticker, functools.partial(_open, stream, desc))
        samples.setdefault(f"consumer: open a handle ({label})", []).append((ms, gap))
        ms, gap, ev = _timed(ticker, functools.partial(_open_event, stream, handle))
        samples.setdefault(f"consumer: open an event, wait on it ({label})", []).append((ms, gap))
        with torch.cuda.stream(stream):
            copy = torch.empty(NBYTES, dtype=torch.uint8, device="cuda:0")
            copy.copy_(opened, non_blocking=True)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(stream)
        for _ in range(100_000):  # bounded: the copy runs beside the long kernel
            if copied.query():  # type: ignore[no-untyped-call]
                break
            time.sleep(0.0005)
        if busy:
            _busy()  # a long kernel of ours runs while the opened memory is let go of

        def drop() -> None:
            nonlocal opened
            with torch.cuda.stream(idle):
                opened = None  # torch's deleter: stream sync, counter, handle closed

        ms, gap, _ = _timed(ticker, drop)
        samples.setdefault(f"consumer: let go of it, copy done ({label})", []).append((ms, gap))
        del ev, copy
        conn.send(True)
    conn.send([_row(name, s) for name, s in samples.items()])
    ticker.close()


def main() -> int:
    if not torch.cuda.is_available():
        print("cuda_ipc_costs: skipped, no CUDA device here")
        return 0
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=consumer, args=(theirs,))
    child.start()
    try:
        rows = producer(ours)
        if ours.poll(120):
            rows += ours.recv()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()  # ours, by PID
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
