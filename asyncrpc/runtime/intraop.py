"""Small torch work the library runs itself: BLAS on the calling thread alone, and the
process's OpenMP runtime kept as it was (layer L2).

A small backward pass or optimizer step (``asyncrpc.autograd.graph``, ``asyncrpc.optim``)
multiplies small matrices: MKL's ``sgemm`` opens an OpenMP parallel region even for a
32x64 by 64x64 product. On a busy machine the region's other thread is asleep or
off-core between two messages, and the caller waits at the region's barrier: a
``Linear(64, 64)`` pass measured 3-4x slower on the loop than run single-threaded
(bench/RESULTS.md, "One backward hop"). ``one_thread()`` makes the block's BLAS calls
run on the calling thread: MKL's per-thread setting (``mkl_set_num_threads_local``) is set
and restored. torch's ``set_num_threads`` would not do: it also sets the count every thread
not yet started inherits.

The thread's OpenMP count is left alone: changing it between two regions shrinks and
regrows the thread's OpenMP team, and the user's next region on that thread (a forward
on the thread that called ``backward``) then stalled for milliseconds.

``keep_team()`` is for the loop thread. libgomp (torch's OpenMP runtime on Linux) keeps
the idle threads of every team spinning for 300,000 pauses after a region, about 10 ms on
recent x86, unless it manages more threads than there are cores; then they sleep at
once. Before small passes ran single-threaded, the loop thread's own team (from the
passes' ``sgemm``) kept that count above the cores of a small machine; without it, the
team of the user's thread spun after each of its regions and took one core of two away
from the RPC threads (a training step measured 3-4x slower). The loop thread therefore
still starts its team, once, with one region of the default size.
"""

from __future__ import annotations

import ctypes
import os
import threading
from types import TracebackType
from typing import Any

import torch

__all__ = ["keep_team", "one_thread"]

# More elements than one grain of at::parallel_for (32,768): an op on them opens a region.
_TEAM_ELEMENTS = 1 << 17


def _loaded(fragment: str) -> str | None:
    """The path of a shared library this process has mapped whose file name contains
    ``fragment`` (Linux; None elsewhere or when none is)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:  # bounded by the process's mappings
                path = line.rpartition(" ")[2].strip()
                if fragment in os.path.basename(path) and ".so" in path:
                    return path
    except OSError:
        return None
    return None


def _mkl_setter() -> Any:
    """MKL's ``mkl_set_num_threads_local`` (C interface) in the libtorch torch loaded, or
    None (no MKL, or not found)."""
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return None
    path = _loaded("libtorch_cpu")
    if path is None:
        return None
    try:  # the library already loaded, never a second copy
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded, or no RTLD_NOLOAD on this platform
        return None
    setter = getattr(library, "MKL_Set_Num_Threads_Local", None)
    if setter is not None:
        setter.argtypes = [ctypes.c_int]
        setter.restype = ctypes.c_int
    return setter


_UNSET: Any = object()
_mkl_set_local: Any = _UNSET
_lookup_lock = threading.Lock()


def _setter() -> Any:
    global _mkl_set_local
    if _mkl_set_local is _UNSET:
        with _lookup_lock:
            if _mkl_set_local is _UNSET:
                _mkl_set_local = _mkl_setter()
    return _mkl_set_local


_asked = threading.local()  # .count: this thread asked torch for its thread count


class one_thread:  # lower case: it reads as a function, ``with one_thread():``
    """Run the block's BLAS calls on the calling thread only; restores the thread's
    setting on leaving (~1 µs: two calls into MKL). A no-op without MKL."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        setter = _setter()
        if setter is None:
            self._before = -1
            return
        # torch sets a thread's OpenMP count on its first parallel op, to MKL's count where
        # that is set: asking for it first keeps the block's 1 out of the thread's setting.
        # Once per thread is enough (it is torch's first op there that sets it).
        if not getattr(_asked, "count", False):
            torch.get_num_threads()
            _asked.count = True
        self._before = setter(1)  # the thread's own setting before (0: none)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        if self._before >= 0:
            _mkl_set_local(self._before)


def keep_team() -> None:
    """Start the calling thread's OpenMP team (one region of the thread's default size)
    where torch runs on OpenMP with more than one thread; see the module's docstring."""
    if torch.get_num_threads() > 1 and "OpenMP" in torch.__config__.parallel_info():
        torch.ones(_TEAM_ELEMENTS).add_(1)
