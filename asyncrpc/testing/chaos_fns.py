"""The functions the chaos soak's workers run for each other, and the callee half of its
ledger (layer L4, testing).

Every function that does work for an operation records ``(operation key, step)`` in
``CALLEE``: the cross-check in ``asyncrpc.testing.chaos`` proves that no step ran twice and
that every operation its caller saw succeed ran each of its steps exactly once.
"""

from __future__ import annotations

import gc
import os
import re
import threading
import warnings
from collections import Counter
from typing import Any, TypeVar

import torch
from torch import nn

import asyncrpc
from asyncrpc.rref.handle import RRef

__all__ = ["CALLEE", "CalleeLedger", "resources", "rref_counts"]


class CalleeLedger:
    """How many times each (operation, step) ran on this worker; any thread may record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: Counter[str] = Counter()

    def record(self, key: str, step: str) -> None:
        with self._lock:
            self.runs[f"{key}/{step}"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.runs)


CALLEE = CalleeLedger()


def payload(key: str, numel: int) -> dict[str, Any]:
    """The argument of an echo: its own key and a tensor derived from it."""
    seed = sum(key.encode()) % 997
    return {"key": key, "t": torch.arange(numel, dtype=torch.float32) + seed}


def is_echo_of(back: Any, sent: dict[str, Any]) -> bool:
    """Whether ``back`` is ``sent`` again (its own key, an equal tensor)."""
    return (
        isinstance(back, dict)
        and back.get("key") == sent["key"]
        and isinstance(back.get("t"), torch.Tensor)
        and bool(torch.equal(back["t"], sent["t"]))
    )


def echo(key: str, value: Any) -> Any:
    CALLEE.record(key, "echo")
    return value


async def async_echo(key: str, value: Any) -> Any:
    CALLEE.record(key, "async_echo")
    return value


def make_value(key: str, numel: int) -> torch.Tensor:
    """The value a ``remote()`` creates on its owner."""
    CALLEE.record(key, "make")
    return torch.full((numel,), float(numel))


def fetch_and_pass(key: str, rref: RRef[torch.Tensor], to: str, timeout: float) -> float:
    """A user of ``rref`` fetches it, then passes it on to ``to`` (a user-to-user fork)."""
    CALLEE.record(key, "fetch")
    here = float(rref.to_here(timeout=timeout).sum())
    there = asyncrpc.rpc_sync(to, fetch_sum, args=(key, rref), timeout=timeout)
    return here + float(there)


def fetch_sum(key: str, rref: RRef[torch.Tensor]) -> float:
    CALLEE.record(key, "fetch_sum")
    return float(rref.to_here().sum())


# -- distributed autograd: a layer on one worker, trained by another ------------------------


def make_layer(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 8)


def param_rrefs(layer: RRef[nn.Module]) -> list[RRef[torch.Tensor]]:
    """RRefs of the layer's parameters, owned here."""
    return [RRef(p) for p in layer.local_value().parameters()]


def forward(key: str, layer: RRef[nn.Module], x: torch.Tensor) -> tuple[str, torch.Tensor]:
    CALLEE.record(key, "forward")
    return key, layer.local_value()(x)


# -- what the end of the soak reads on every worker -----------------------------------------


def rref_counts() -> dict[str, int]:
    """RRefs this worker owns or uses, and forks not yet settled (after a collection:
    tracebacks of failed calls hold RRefs in reference cycles)."""
    gc.collect()
    info = asyncrpc.get_debug_info()
    keys = ("owner_rrefs", "user_rrefs", "pending_forks", "pending_users")
    counts = {k: int(info[k]) for k in keys}
    counts["autograd_contexts"] = int(info.get("num_autograd_contexts", 0))
    return counts


def rref_entries() -> dict[str, list[str]]:
    """The RRef entries behind ``rref_counts`` (what a leak report names), and for each
    user RRef object still alive here, what holds it (``_holders``)."""
    from asyncrpc.rref.handle import RRef, current_rrefs

    forks = getattr(current_rrefs(), "forks", None)
    entries: dict[str, list[str]] = {} if forks is None else forks.describe()
    gc.collect()
    alive = [o for o in _live(RRef) if not o.is_owner()]
    entries["held_by"] = [f"{o!r}: {_holders(o, {id(alive)})}" for o in alive[:10]]
    if alive:  # calls that ended but are still held: what holds them
        from asyncrpc.runtime.calls.pending import PendingCall

        calls = _live(PendingCall)
        entries["calls_held_by"] = [
            f"call {c.request.target} to {c.peer}: {_holders(c, {id(calls)})}" for c in calls[:5]
        ]
    return entries


T = TypeVar("T")


def _live(cls: type[T]) -> list[T]:
    """The objects of ``cls`` the collector tracks in this process."""
    with warnings.catch_warnings():  # isinstance on some of torch's modules warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, cls)]


_OURS = ("rref_entries", "_holders", "<listcomp>", "<genexpr>")


def _holders(target: object, exclude: set[int], depth: int = 6) -> str:
    """The chains of objects that refer to ``target``, by type (frames by function), a few
    levels up: enough to name the table or frame that keeps an RRef alive."""
    import types

    def name(obj: object) -> str:
        if isinstance(obj, types.FrameType):
            return f"frame {obj.f_code.co_name} ({obj.f_code.co_filename.rsplit('/', 1)[-1]})"
        if isinstance(obj, (tuple, list)):  # what else it holds says whose it is
            kinds = ",".join(type(item).__qualname__ for item in obj[:5])
            return f"{type(obj).__qualname__}[{len(obj)}: {kinds}]"
        if isinstance(obj, dict):
            keys = ",".join(str(k)[:20] for k in list(obj)[:5])
            return f"dict[{len(obj)}: {keys}]"
        return type(obj).__qualname__

    # Our own lists (the frontier, each get_referrers answer) refer to what they hold:
    # their ids are excluded, and no tuple or iterator of ours is made over them.
    objects: list[object] = [target]
    paths: list[str] = [""]
    exclude = exclude | {id(objects), id(paths)}
    for _ in range(depth):  # bounded: a few levels, a few referrers each
        next_objects: list[object] = []
        next_paths: list[str] = []
        exclude |= {id(next_objects), id(next_paths)}
        for i in range(len(objects)):
            referrers = gc.get_referrers(objects[i])
            exclude.add(id(referrers))
            taken = 0
            for j in range(len(referrers)):
                ref = referrers[j]
                if id(ref) in exclude or (
                    isinstance(ref, types.FrameType) and ref.f_code.co_name in _OURS
                ):
                    continue
                next_objects.append(ref)
                next_paths.append(f"{paths[i]} <- {name(ref)}")
                taken += 1
                if taken == 3:
                    break
            del referrers
        if not next_objects:
            break
        objects, paths = next_objects[:12], next_paths[:12]
        exclude |= {id(objects), id(paths)}
    chains = paths
    return "; ".join(chains[:8])


def thread_kinds() -> dict[str, int]:
    """Live threads by name, digits dropped ("asyncrpc-pool-3" counts as "asyncrpc-pool-")."""
    kinds = Counter(re.sub(r"\d+", "", t.name) for t in threading.enumerate())
    return dict(sorted(kinds.items()))


def resources() -> dict[str, int]:
    """Open file descriptors, threads (and how many are the RPC pool's) and memory of this
    process: resident, and proportional (PSS shares a page among the processes mapping it)."""
    rss = pss = 0
    with open(f"/proc/{os.getpid()}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    with open(f"/proc/{os.getpid()}/smaps_rollup", encoding="ascii") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
    return {
        "fds": len(os.listdir(f"/proc/{os.getpid()}/fd")),
        "threads": threading.active_count(),
        "pool_threads": int(asyncrpc.get_metrics()["thread_pool_threads"]),
        "os_threads": len(os.listdir(f"/proc/{os.getpid()}/task")),
        "rss_kib": rss,
        "pss_kib": pss,
    }
