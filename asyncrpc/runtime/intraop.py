"""Torch work the library runs on the event loop runs on one intra-op thread (layer L2).

A small backward pass or optimizer step on the loop (``asyncrpc.autograd.graph``,
``asyncrpc.optim``) calls torch kernels that may open an OpenMP parallel region: MKL's
``sgemm`` does so for a 32x64 by 64x64 product. On a busy machine the region's other
threads are asleep or off-core between two messages, and the loop waits at the region's
barrier for them: a ``Linear(64, 64)`` pass measured 3-4x slower on the loop than run
single-threaded (bench/RESULTS.md, "One backward hop"). Work small enough for the loop
gains nothing from more threads, so ``one_thread()`` runs it on the calling thread alone.

torch's own ``torch.set_num_threads`` cannot do this: besides the calling thread, it sets
the count every thread not yet started inherits. So the OpenMP runtime's per-thread
setting (``omp_set_num_threads``) and MKL's (``mkl_set_num_threads_local``) are set and
restored directly, in the libraries torch loaded. Where they are not found (another
platform, another parallel backend) the block runs as it is.
"""

from __future__ import annotations

import ctypes
import os
import threading
from types import TracebackType
from typing import Any

import torch

__all__ = ["one_thread"]


class _Knobs:
    """The per-thread thread-count setters of the OpenMP runtime and MKL torch loaded."""

    def __init__(self, omp_set: Any, mkl_set_local: Any) -> None:
        self.omp_set = omp_set
        self.mkl_set_local = mkl_set_local


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


def _symbol(path: str | None, name: str) -> Any:
    if path is None:
        return None
    try:  # the library already loaded, never a second copy
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded, or no RTLD_NOLOAD on this platform
        return None
    function = getattr(library, name, None)
    if function is not None:
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int if name.startswith("MKL") else None
    return function


_knobs: _Knobs | None = None
_knobs_lock = threading.Lock()


def _find_knobs() -> _Knobs:
    global _knobs
    with _knobs_lock:
        if _knobs is None:
            omp_set = None
            if "OpenMP" in torch.__config__.parallel_info():
                omp_set = _symbol(_loaded("gomp") or _loaded("iomp5"), "omp_set_num_threads")
            mkl_set = None
            if torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
                mkl_set = _symbol(_loaded("libtorch_cpu"), "MKL_Set_Num_Threads_Local")
            _knobs = _Knobs(omp_set, mkl_set)
        return _knobs


class one_thread:  # lower case: it reads as a function, ``with one_thread():``
    """Run the block's torch kernels on the calling thread only; restores the thread's
    settings on leaving. Cheap (~1 µs): two or four calls into the runtimes."""

    __slots__ = ("_mkl", "_omp")

    def __enter__(self) -> None:
        knobs = _knobs or _find_knobs()
        # torch sets a thread's count on its first parallel op (from the count every new
        # thread inherits): asking for it first makes sure that does not happen inside.
        self._omp = torch.get_num_threads()
        self._mkl = -1
        if self._omp > 1 and knobs.omp_set is not None:
            knobs.omp_set(1)
            if knobs.mkl_set_local is not None:
                self._mkl = knobs.mkl_set_local(1)  # the thread's setting before (0: none)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        if self._omp > 1 and _knobs is not None and _knobs.omp_set is not None:
            _knobs.omp_set(self._omp)
            if self._mkl >= 0 and _knobs.mkl_set_local is not None:
                _knobs.mkl_set_local(self._mkl)
