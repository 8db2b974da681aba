"""Functions the distributed autograd tests run on workers (importable on every worker)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import asyncrpc
from asyncrpc import autograd as dist_autograd
from asyncrpc.functions import async_execution
from asyncrpc.optim import LocalOptimizer
from asyncrpc.rref.handle import RRef
from asyncrpc.runtime.current import current_agent

# Pool threads may build layers concurrently: seeding torch's one global generator and
# drawing the initial weights must be one step, or two layers could share draws.
_SEEDED = threading.Lock()


def make_linear(seed: int, n_in: int, n_out: int) -> nn.Linear:
    with _SEEDED:
        torch.manual_seed(seed)
        return nn.Linear(n_in, n_out)


def forward(module: RRef[nn.Module], x: torch.Tensor) -> torch.Tensor:
    return module.local_value()(x)


async def async_forward(module: RRef[nn.Module], x: torch.Tensor) -> torch.Tensor:
    await asyncio.sleep(0.001)  # other requests may run meanwhile
    return torch.tanh(module.local_value()(x))


def forward_then(
    module: RRef[nn.Module], x: torch.Tensor, next_worker: str, next_module: RRef[nn.Module]
) -> torch.Tensor:
    """A -> B -> C: run this worker's layer, then the next worker's, nested."""
    h = torch.relu(module.local_value()(x))
    return asyncrpc.rpc_sync(next_worker, forward, args=(next_module, h))


def forward_then_detached(
    module: RRef[nn.Module], x: torch.Tensor, next_worker: str, next_module: RRef[nn.Module]
) -> torch.Tensor:
    """``forward_then``, with what goes to the next worker cut from this worker's graph:
    the backward ends on the next worker, which sent nothing back."""
    h = torch.relu(module.local_value()(x)).detach()
    return asyncrpc.rpc_sync(next_worker, forward, args=(next_module, h)) * 2


def grads_of(context_id: int, module: RRef[nn.Module]) -> list[torch.Tensor | None]:
    """The context's gradients of the module's parameters, on their owner."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in module.local_value().parameters()]


def params_have_no_grad(module: RRef[nn.Module]) -> bool:
    return all(p.grad is None for p in module.local_value().parameters())


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b + b


def echo(x: Any) -> Any:
    return x


def fail_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _FailBackward.apply(x)


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise KeyError("broken backward")


def die_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _DieBackward.apply(x)


class _DieBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGKILL)
        return grad


def num_contexts() -> int:
    return int(asyncrpc.get_debug_info()["num_autograd_contexts"])


def param_rrefs(module: RRef[nn.Module]) -> list[RRef[torch.Tensor]]:
    """RRefs of the module's parameters, owned here (torch's ``parameter_rrefs``)."""
    return [RRef(p) for p in module.local_value().parameters()]


def weights(module: RRef[nn.Module]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.local_value().parameters()]


@async_execution
def scaled_by_peer(to: str, x: torch.Tensor) -> Any:
    """An @async_execution function whose coroutine makes a nested call in the context."""

    async def run() -> torch.Tensor:
        y = await asyncrpc.call(to, product, x, x)
        return y * 2

    return run()


class FailingOptimizer(torch.optim.SGD):
    """An optimizer whose constructor fails on its owner."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        raise ValueError(f"no optimizer with lr={lr}")


def total(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def open_context() -> int:
    """Open a distributed autograd context here (not allowed inside another one)."""
    with dist_autograd.context() as context_id:
        return context_id


class Scale(nn.Module):
    """x * w, with w a parameter of ones."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class FetchTwice(nn.Module):
    """A plain (pool-thread) method that fetches an RRef inside the caller's context."""

    def forward(self, y: RRef[torch.Tensor]) -> torch.Tensor:
        return y.to_here() * 2


def hops_received() -> int:
    return int(asyncrpc.get_debug_info()["autograd_hops_received"])


def passes_planned() -> int:
    return int(asyncrpc.get_debug_info()["autograd_passes_planned_ahead"])


def coded_calls_received() -> int:
    return int(asyncrpc.get_metrics()["coded_calls_received"])


def passes_on_loop() -> int:
    return int(asyncrpc.get_debug_info()["autograd_passes_on_loop"])


def scale_factor() -> float:
    return 3.0


def forward_hooked_by_peer(module: RRef[nn.Module], x: torch.Tensor, peer: str) -> torch.Tensor:
    """A forward whose output carries a tensor hook that makes a blocking call: user code
    in the graph, which must run on a pool thread (on the loop, rpc_sync would raise)."""
    y = module.local_value()(x)
    y.register_hook(lambda grad: grad * asyncrpc.rpc_sync(peer, scale_factor))
    return y


def steps_on_loop() -> int:
    return LocalOptimizer.steps_on_loop


def steps_here() -> int:
    return LocalOptimizer.steps_here


_step_hooks: list[Any] = []
_step_hook_on_loop: list[bool] = []


def hook_optimizer_steps() -> None:
    """A global step pre-hook (user code) that records whether it ran on the loop."""

    def record(*_: Any) -> None:
        _step_hook_on_loop.append(threading.get_ident() == current_agent().loop.thread_id)

    _step_hooks.append(register_optimizer_step_pre_hook(record))


def unhook_optimizer_steps() -> list[bool]:
    """Remove the hook; returns, per step it saw, whether it ran on the loop."""
    while _step_hooks:
        _step_hooks.pop().remove()
    seen, _step_hook_on_loop[:] = list(_step_hook_on_loop), []
    return seen


def hops_replied_first() -> int:
    return int(asyncrpc.get_debug_info()["autograd_hops_replied_first"])


def forward_inner_hook_fails(module: RRef[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The layer's forward with a hook on an inner tensor that raises in the backward:
    a hook no walk of the graph can see."""
    h = module.local_value()(x)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise KeyError("hook of an inner tensor")

    h.register_hook(fail)
    return torch.relu(h)
