"""Functions the CUDA tests run on the callee (importable by worker processes)."""

from __future__ import annotations

import torch


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def add_one(x: torch.Tensor) -> torch.Tensor:
    # A kernel on the callee's current stream, reading the argument.
    return x + 1


async def async_add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def slow_fill(n: int, value: float, cycles: int) -> torch.Tensor:
    """A reply whose kernel is still queued when the function returns."""
    y = torch.zeros(n, device="cuda:0")
    torch.cuda._sleep(cycles)
    y.fill_(value)
    return y


def memory_allocated() -> int:
    return torch.cuda.memory_allocated(0)


def stream_ids() -> tuple[int, int]:
    """(current stream, default stream) of cuda:0 on the thread running this function."""
    current = torch.cuda.current_stream(0)
    return int(current.cuda_stream), int(torch.cuda.default_stream(0).cuda_stream)


async def async_stream_ids() -> tuple[int, int]:
    return stream_ids()


HELD: list[torch.Tensor] = []


def hold(x: torch.Tensor) -> int:
    """Keep ``x`` (memory another process may have shared) until this process dies."""
    HELD.append(x)
    return len(HELD)


def cuda_stats() -> dict[str, int]:
    """This worker's CUDA transfer counters (staged copies, stream leases, IPC handles)."""
    import asyncrpc

    info = asyncrpc.get_debug_info()
    return {k: v for k, v in info.items() if k.startswith("cuda_")}
