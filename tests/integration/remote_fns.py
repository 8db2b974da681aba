"""Functions the integration tests run remotely (importable on every worker)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import warnings
from typing import Any

import torch

import asyncrpc
from asyncrpc.functions import async_execution, inline
from asyncrpc.runtime.current import current_agent


class CustomError(Exception):
    """A user's own exception class."""


def add(a: Any, b: Any) -> Any:
    return a + b


def echo(x: Any) -> Any:
    return x


def noop() -> None:
    return None


def whoami() -> str:
    return asyncrpc.get_worker_info().name


def pid() -> int:
    return os.getpid()


async def async_add(a: Any, b: Any) -> Any:
    await asyncio.sleep(0)
    return a + b


async def async_whoami() -> str:
    await asyncio.sleep(0)
    return asyncrpc.get_worker_info().name


def raise_key_error(key: str) -> None:
    raise KeyError(key)


def raise_os_error() -> None:
    raise OSError(5, "input/output error here")  # EIO: a plain OSError


def raise_custom(message: str) -> None:
    raise CustomError(message)


async def async_raise_value_error() -> None:
    await asyncio.sleep(0)
    raise ValueError("async failure")


def torch_future_after(seconds: float) -> torch.futures.Future[int]:
    """Returns (not marked async_execution) a torch future that never completes."""
    time.sleep(seconds)
    return torch.futures.Future()


def sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


# -- cancellation: an async function notes whether it was cancelled ------------------------
_cancelled: list[str] = []


async def async_sleep_noting_cancel(seconds: float, tag: str) -> str:
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        _cancelled.append(tag)
        raise
    return "finished"


def was_cancelled(tag: str) -> bool:
    return tag in _cancelled


# -- a sync function blocked on an event that a later RPC sets -----------------------------
_events: dict[str, threading.Event] = {}
_events_lock = threading.Lock()


def _event(tag: str) -> threading.Event:
    with _events_lock:
        return _events.setdefault(tag, threading.Event())


def wait_for_event(tag: str, timeout: float) -> bool:
    return _event(tag).wait(timeout)


def set_event(tag: str) -> bool:
    _event(tag).set()
    return True


# -- nested calls --------------------------------------------------------------------------
def nested_add(to: str, a: Any, b: Any) -> Any:
    return asyncrpc.rpc_sync(to, add, args=(a, b))


async def async_nested_add(to: str, a: Any, b: Any) -> Any:
    return await asyncrpc.call(to, add, a, b)


def call_back(caller: str) -> str:
    """Calls back into the worker that called us."""
    return str(asyncrpc.rpc_sync(caller, whoami))


# -- inline --------------------------------------------------------------------------------
def thread_kind() -> str:
    """Which of the callee's threads runs this: its event loop or a pool thread."""
    return "loop" if threading.get_ident() == current_agent().loop.thread_id else "pool"


def thread_name() -> str:
    """The name of the callee's thread that runs this (a lane's, a pool's...)."""
    return threading.current_thread().name


def stop_server_profiler_names() -> list[str]:
    """Stop this worker's server profiler; the names of the requests it recorded."""
    return [event.name for event in asyncrpc.profiling.disable_server_profiler()]


@inline
def inline_thread_kind() -> str:
    return thread_kind()


_arrivals: list[int] = []


@inline
def inline_record(i: int) -> None:
    """Record ``i`` in the order calls arrive (inline: run by the loop as they are read)."""
    _arrivals.append(i)


def arrivals() -> list[int]:
    return list(_arrivals)


@inline
def inline_raises(message: str) -> None:
    raise CustomError(message)


@inline
def inline_blocking_call(to: str) -> Any:
    return asyncrpc.rpc_sync(to, noop)


@inline
@async_execution
def inline_async_exec_add(to: str, a: Any, b: Any) -> asyncrpc.Future[Any]:
    return asyncrpc.rpc_async(to, add, args=(a, b))


# -- async_execution -----------------------------------------------------------------------
@async_execution
def async_exec_add(to: str, a: Any, b: Any) -> asyncrpc.Future[Any]:
    return asyncrpc.rpc_async(to, add, args=(a, b)).then(lambda fut: fut.value() * 10)


@async_execution
def async_exec_torch_future(value: int) -> torch.futures.Future[int]:
    fut: torch.futures.Future[int] = torch.futures.Future()
    fut.set_result(value + 1)
    return fut


@async_execution
async def async_exec_coroutine(value: int) -> int:
    await asyncio.sleep(0)
    return value * 2


class Calculator:
    @staticmethod
    def static_add(a: Any, b: Any) -> Any:
        return a + b

    @classmethod
    def class_name(cls) -> str:
        return cls.__name__

    @staticmethod
    @async_execution
    def static_async_exec(value: int) -> asyncrpc.Future[int]:
        fut: asyncrpc.Future[int] = asyncrpc.Future()
        fut.set_result(value + 100)
        return fut

    @classmethod
    @async_execution
    def class_async_exec(cls, value: int) -> asyncrpc.Future[str]:
        fut: asyncrpc.Future[str] = asyncrpc.Future()
        fut.set_result(f"{cls.__name__}:{value}")
        return fut


with warnings.catch_warnings():
    # torch.jit.script is deprecated in torch 2.13; ScriptFunctions must still travel.
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.script
    def script_add(x: torch.Tensor, y: int) -> torch.Tensor:
        return x + y


def return_lambda() -> Any:
    return lambda: 1


def tensor_sum(t: torch.Tensor) -> float:
    return float(t.sum())


def describe_tensor(t: torch.Tensor) -> dict[str, Any]:
    return {
        "dtype": str(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "requires_grad": t.requires_grad,
        "is_param": isinstance(t, torch.nn.Parameter),
    }


def same_object(a: Any, b: Any) -> bool:
    return a is b


def metrics() -> dict[str, Any]:
    return asyncrpc.get_metrics()


def debug_info() -> dict[str, Any]:
    return asyncrpc.get_debug_info()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def zeros(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


def chain(depth: int, here: str, there: str) -> int:
    """A blocking ``def`` that calls ``there``, which calls back here...: ``depth`` nested
    ``rpc_sync`` calls, each holding a pool thread while it waits."""
    if depth <= 0:
        return 0
    return int(asyncrpc.rpc_sync(there, chain, args=(depth - 1, there, here))) + 1


async def blocking_rpc_on_loop() -> Any:
    """Runs on the agent's loop: a blocking rpc_sync there must raise, not deadlock."""
    return asyncrpc.rpc_sync(asyncrpc.get_worker_info().name, noop)


# -- RRefs ---------------------------------------------------------------------------------
class Counter:
    """A stateful object held behind an RRef on its owner."""

    def __init__(self, start: int = 0) -> None:
        self.count = start
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"count": self.count}  # a copy travels without its lock

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        self._lock = threading.Lock()

    def increment(self, by: int = 1) -> int:
        with self._lock:
            self.count += by
            return self.count

    def value(self) -> int:
        return self.count

    def runs_on(self) -> str:
        return thread_kind()

    @inline
    def inline_runs_on(self) -> str:
        return thread_kind()

    async def slow_value(self) -> int:
        await asyncio.sleep(0.01)
        return self.count

    @async_execution
    def deferred_add(self, by: int) -> asyncrpc.Future[int]:
        fut: asyncrpc.Future[int] = asyncrpc.Future()
        fut.set_result(self.increment(by))
        return fut


class ParameterServer:
    """A model held on its owner and updated by several trainers at once."""

    def __init__(self, features: int = 8) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(features, 1)
        self.lock = threading.Lock()
        self.updates = 0

    def get_weights(self) -> dict[str, torch.Tensor]:
        with self.lock:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def apply_grads(self, grads: dict[str, torch.Tensor], lr: float) -> int:
        with self.lock, torch.no_grad():
            for name, param in self.model.named_parameters():
                param.sub_(lr * grads[name])
            self.updates += 1
            return self.updates


def make_counter(start: int) -> Counter:
    return Counter(start)


def fetch(rref: asyncrpc.RRef[Any]) -> Any:
    return rref.to_here()


def total(tensor: torch.Tensor) -> float:
    return float(tensor.sum())


def forward_to(rref: asyncrpc.RRef[Any], to: str) -> Any:
    """A user passes the RRef on to a third worker (a user-to-user fork)."""
    return asyncrpc.rpc_sync(to, fetch, args=(rref,))


_held: list[Any] = []


def hold(obj: Any) -> int:
    _held.append(obj)
    return len(_held)


def drop_held() -> int:
    count = len(_held)
    _held.clear()
    import gc

    gc.collect()
    return count


def rref_debug() -> dict[str, Any]:
    import gc

    gc.collect()  # tracebacks of failed calls hold RRefs in reference cycles
    info = asyncrpc.get_debug_info()
    return {k: info[k] for k in ("owner_rrefs", "user_rrefs", "pending_forks", "pending_users")}


def owned_here(value: Any) -> asyncrpc.RRef[Any]:
    """Returns an RRef this worker owns (an RRef as a result)."""
    return asyncrpc.RRef(value)


def sum_nested(tree: dict[str, Any]) -> int:
    """Fetch every RRef in a nested container and add the values."""
    total = 0
    for item in tree["list"]:
        total += item.to_here()
    total += tree["inner"]["rref"].to_here()
    return total


def is_owner_of(rref: asyncrpc.RRef[Any]) -> bool:
    return rref.is_owner()


def local_value_of(rref: asyncrpc.RRef[Any]) -> Any:
    return rref.local_value()


def train_steps(ps: asyncrpc.RRef[ParameterServer], steps: int) -> int:
    """A trainer on a worker: pull weights and push gradients through proxies."""
    last = 0
    for _ in range(steps):
        weights = ps.rpc_sync().get_weights()
        grads = {k: torch.ones_like(v) for k, v in weights.items()}
        last = ps.rpc_sync().apply_grads(grads, 0.01)
    return last


# -- RRef fault scenarios (tests/scenarios/rref.py) ---------------------------------------


def fetch_held(index: int) -> Any:
    """``to_here()`` of the RRef this worker holds at ``index`` (see ``hold``)."""
    return _held[index].to_here()


def forward_held(index: int, to: str) -> int:
    """Pass the held RRef at ``index`` on to worker ``to``, which holds it too."""
    return int(asyncrpc.rpc_sync(to, hold, args=(_held[index],)))


def hold_remotes(to: str, count: int, pending_sleep: float = 0.0) -> int:
    """Create ``count`` RRefs owned by ``to`` with remote() and hold them, each fetched once
    (so confirmed); with ``pending_sleep`` > 0 also hold one whose value is still computing."""
    for i in range(count):
        rref = asyncrpc.remote(to, make_counter, args=(i,))
        rref.to_here()
        _held.append(rref)
    if pending_sleep > 0:
        _held.append(asyncrpc.remote(to, sleep, args=(pending_sleep,), timeout=0))
    return len(_held)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage the received tensor lives in (what actually crossed the wire)."""
    return int(t.untyped_storage().nbytes())


def torch_ops(x: torch.Tensor) -> torch.Tensor:
    """A few torch ops, for the profiler tests to find on the callee."""
    return torch.mm(x, x).add(1)


async def async_torch_ops(x: torch.Tensor) -> torch.Tensor:
    y = torch.mm(x, x)
    await asyncio.sleep(0.01)  # other requests may run on the loop meanwhile
    return y.sub(1)


def torch_ops_then_fail(x: torch.Tensor) -> None:
    torch.mm(x, x)
    raise CustomError("failed after its ops")


def scoped_torch_ops(x: torch.Tensor) -> torch.Tensor:
    """torch ops inside a record_function scope of their own."""
    with torch.autograd.profiler.record_function("##scope##"):
        return torch.mm(x, x).add(1)


def nested_torch_add(to: str, x: torch.Tensor) -> torch.Tensor:
    """An op here, then an RPC of an op to ``to`` (the profiler sees both, nested)."""
    y = torch.mm(x, x)
    return asyncrpc.rpc_sync(to, torch.add, args=(y, 1))  # type: ignore[no-any-return]


@async_execution
def async_exec_torch_add(to: str, x: torch.Tensor) -> asyncrpc.Future[torch.Tensor]:
    """Replies when an RPC to ``to`` it starts, and does not wait for, completes."""
    return asyncrpc.rpc_async(to, torch.add, args=(x, 1))


async def profile_await_call_here(to: str) -> list[str]:
    """On an asyncio worker: profile an ``await call`` made on the agent's own loop."""
    with torch.profiler.profile() as prof:
        await asyncrpc.call(to, torch_ops, torch.ones(4, 4))
    return [e.key for e in prof.key_averages()]


def rref_sum(rref: asyncrpc.RRef[torch.Tensor]) -> float:
    """Fetch an RRef owned by another worker and sum it (a call between two callees)."""
    return float(rref.to_here().sum().item())


def call_everyone(names: list[str]) -> int:
    """Call every other worker once, all at the same time; return how many answered right."""
    me = asyncrpc.get_worker_info().name
    futures = {n: asyncrpc.rpc_async(n, whoami) for n in names if n != me}
    return sum(1 for n, f in futures.items() if f.wait() == n)


# -- shared memory (tests/integration/test_shared_memory.py) -------------------------------


def filled(numel: int, value: float) -> torch.Tensor:
    return torch.full((numel,), value)


def held_sums() -> list[float]:
    return [float(t.sum()) for t in _held if isinstance(t, torch.Tensor)]


def scale_in_place(t: torch.Tensor, factor: float) -> float:
    """Write into a received tensor (shared memory is mapped writable) and sum it."""
    t.mul_(factor)
    return float(t.sum())


def mapped_chunks_of(pid: int) -> int:
    """How many of worker ``pid``'s shared-memory chunks this process maps now."""
    import gc

    gc.collect()
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if f"asyncrpc-{pid}-" in line)


class LockHolder:
    """Something that cannot be pickled (it holds a lock), made where remote() runs it."""

    def __init__(self, value: Any) -> None:
        self.lock = threading.Lock()
        self.value = value
        self.made_in = os.getpid()


def make_lock_holder(value: Any) -> LockHolder:
    return LockHolder(value)


async def async_make_lock_holder(value: Any) -> LockHolder:
    await asyncio.sleep(0)
    return LockHolder(value)


@async_execution
def async_exec_lock_holder(value: Any) -> asyncrpc.Future[LockHolder]:
    future: asyncrpc.Future[LockHolder] = asyncrpc.Future()
    future.set_result(LockHolder(value))
    return future


def remote_to_self_here(value: Any) -> tuple[bool, int, Any]:
    """Runs on a worker: remote() to its own name, as torch's tutorials do; the value stays."""
    rref = asyncrpc.remote(asyncrpc.get_worker_info().name, make_lock_holder, args=(value,))
    held = rref.to_here()
    return held is rref.local_value(), held.made_in, held.value


# -- liveness and losses (scenarios.faults: hang_defaults) ---------------------------------
@inline
def busy_inline(seconds: float) -> float:
    """Hold the callee's event loop for ``seconds`` in pure Python (a user's long
    ``@inline`` function): its loop answers nothing meanwhile, its process lives."""
    end = time.monotonic() + seconds
    spins = 0
    while time.monotonic() < end:
        spins += 1
    return seconds


_caller_losses: list[list[Any]] = []


def watch_my_caller() -> bool:
    """Remember this caller's end (asyncrpc.on_caller_lost), as a server keeping state
    for it would."""
    asyncrpc.on_caller_lost(lambda e: _caller_losses.append([e.worker, e.evidence]))
    return True


def caller_losses() -> list[list[Any]]:
    return list(_caller_losses)


def register_with(name: str) -> bool:
    """Call ``name``'s ``watch_my_caller``: ``name`` then watches this worker."""
    return bool(asyncrpc.rpc_sync(name, watch_my_caller))
