"""The host cost of each CUDA operation a call's transfer makes, one at a time (GPU).

A small CUDA call costs asyncrpc about 1 ms of CPU per process on an H100 machine
(``bench/cuda_call_profile.py``), and the samples land in the seam's few lines that queue
copies and record events. This prints the wall and CPU time per operation, averaged over
``--repeats`` runs, with the GPU idle, so the transfer can be built from the cheap ones.

    python bench/cuda_op_costs.py
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def _time(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    for _ in range(min(repeats, 50)):  # warm
        fn()
    torch.cuda.synchronize()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(repeats):  # bounded by --repeats
        fn()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    torch.cuda.synchronize()
    return wall / repeats * 1e6, cpu / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--nbytes", type=int, default=1024)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_op_costs: skipped, no CUDA device here")
        return 0
    n = args.nbytes
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    src = torch.ones(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(max(n, 1 << 16), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    reused = torch.cuda.Event()  # type: ignore[no-untyped-call]
    reused.record(side)
    ipc_reused = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
    ipc_reused.ipc_handle()  # type: ignore[no-untyped-call]
    storage = src.untyped_storage()

    from asyncrpc.runtime.cuda.real import CudaDevices, _OnStream

    gpu = CudaDevices()

    def on_stream() -> None:
        with _OnStream(side):
            pass

    def d2d_on() -> None:
        with _OnStream(side):
            dst[:n].copy_(src, non_blocking=True)

    def stream_ctx() -> None:
        with torch.cuda.stream(side):
            pass

    def new_event() -> None:
        torch.cuda.Event().record(side)  # type: ignore[no-untyped-call]

    def new_ipc_event() -> None:
        event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
        event.record(side)
        event.ipc_handle()  # type: ignore[no-untyped-call]

    def span() -> None:
        s = torch.empty(0, dtype=torch.uint8, device=src.device)
        s.set_(storage, 0, (n,), (1,))

    def d2d_current() -> None:
        dst[:n].copy_(src, non_blocking=True)

    def d2d_side() -> None:
        with torch.cuda.stream(side):
            dst[:n].copy_(src, non_blocking=True)

    def d2h() -> None:
        pinned.copy_(src, non_blocking=True)

    def h2d() -> None:
        pinned.to("cuda", non_blocking=True)

    rows: list[tuple[str, Callable[[], Any]]] = [
        ("python call (floor)", lambda: None),
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        ("CudaDevices.current_stream (cached)", lambda: gpu.current_stream(0)),
        ("with _OnStream(side): pass", on_stream),
        ("with torch.cuda.stream(side): pass", stream_ctx),
        ("torch.cuda.Event() + record (new)", new_event),
        ("event.record (reused)", lambda: reused.record(side)),
        ("interprocess event new + record + handle", new_ipc_event),
        ("interprocess event.record (reused)", lambda: ipc_reused.record(side)),
        ("event.query()", reused.query),
        ("stream.wait_event", lambda: side.wait_event(reused)),
        ("empty(0) + set_ (a span)", span),
        ("torch.empty(n) on the GPU", lambda: torch.empty(n, dtype=torch.uint8, device="cuda")),
        ("record_stream", lambda: src.record_stream(side)),
        ("copy_ d2d, current stream", d2d_current),
        ("copy_ d2d, in stream ctx", d2d_side),
        ("copy_ d2d, in _OnStream", d2d_on),
        ("copy_ d2h into pinned", d2h),
        ("to(cuda) from pinned", h2d),
        ("a kernel (add_)", lambda: src.add_(0)),
        ("slice dst[:n]", lambda: dst[:n]),
        ("torch.cuda.synchronize() idle", torch.cuda.synchronize),
    ]
    print(f"{'operation':45s} {'wall us':>9s} {'cpu us':>9s}  ({args.repeats} each, {n} bytes)")
    for label, fn in rows:
        wall, cpu = _time(fn, args.repeats)
        print(f"{label:45s} {wall:9.1f} {cpu:9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
