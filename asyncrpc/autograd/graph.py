"""One worker's part of a distributed backward pass: running its local graph (layer L3).

Two ways to run it. The light one runs torch's engine as ``torch.autograd.grad`` does
(called directly, without that function's Python wrapper): it returns each leaf's
gradient, keeps the original type of an error raised in the graph, and costs nothing
beyond the graph itself (a root that is a leaf without hooks needs no engine at all).
But it never executes the leaves' ``AccumulateGrad`` nodes, so the hooks registered on
them do not fire, and DDP's reducer is such a hook: its parameters would keep their
local, un-reduced gradients, a wrong result with no error.

So a pass that may feed a reducer runs on torch's own distributed engine instead, in a
private torch context kept for the asyncrpc context's life on this worker. That engine
runs those hooks and lets the reducer read and write the gradients of the running context
(never ``.grad``); its gradients for this worker's own leaves stay in the torch context
(the reducer may rewrite them in a later pass) and are read from it. A pass may feed a
reducer when a process group is initialised and the pass reaches an ``nn.Parameter``: DDP
needs both, and torch's engine costs ~0.1 ms to set up and ~2 ms of CPU (on a background
thread) to release per context, so it is not used where it cannot matter.

A small pass of built-in nodes may also run on the event loop (``run_on_loop``), saving
the pool's round trip: a profile function stops it at the first Python frame the graph
would enter, before that code runs, and the pass then runs on a pool thread instead.

On torch's engine an error raised in the graph arrives as a ``RuntimeError`` holding its
text only (the engine keeps no more), as it does in torch.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import queue
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch._C._distributed_autograd as torch_dist_engine

from asyncrpc.autograd.groups import keep_default_group
from asyncrpc.runtime.intraop import one_thread

__all__ = [
    "LOOP_PASS_MAX_ELEMENTS",
    "LOOP_PASS_MAX_NODES",
    "LocalGraph",
    "Plan",
    "plan",
    "plan_holds",
    "reachable_leaves",
]

# (leaf, its gradient from one pass)
Routed = list[tuple[torch.Tensor, Any]]

_NODE_PREFIX = "Error on Node "
# torch's context ids start with the 16-bit worker id it was initialised with; the
# contexts made here never leave this process, so any id in range will do.
_MAX_WORKER_ID = 2**16 - 1

# A pass runs on the event loop (no pool round trip: two thread wake-ups less per backward
# hop) only when it is small enough not to hold the loop up: at most this many nodes, and
# this many elements over its roots and leaves (a Linear(64, 64) layer's pass at batch 32
# has 5 nodes and ~6,400 elements and takes ~40 µs; 2^16 elements stay well under 1 ms).
LOOP_PASS_MAX_NODES = 256
LOOP_PASS_MAX_ELEMENTS = 1 << 16


def reachable_leaves(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that the graph of ``roots`` reaches."""
    walk = _walk_leaves(roots, max_nodes=None)
    assert walk is not None  # with no bound the walk never gives up
    return walk[0]


# What a walk of a graph found: its leaves, their elements in all, whether one of them
# is an ``nn.Parameter`` (which DDP's reducer may watch), and whether the pass may call
# Python code that can be seen ahead (a custom Function's backward, a leaf's hook; a hook
# on an inner tensor cannot be). Counted on the way: a pass pays for one loop over its
# graph, not four.
Walk = tuple[list[torch.Tensor], int, bool, bool]


def _small_graph_leaves(roots: Sequence[torch.Tensor]) -> Walk | None:
    """The walk for a pass that may run on the loop: None as soon as the graph has more
    than ``LOOP_PASS_MAX_NODES`` nodes or a leaf off the CPU (a CUDA graph runs on
    torch's device threads, where the guard below cannot see)."""
    return _walk_leaves(roots, max_nodes=LOOP_PASS_MAX_NODES, cpu_only=True)


def _walk_leaves(
    roots: Sequence[torch.Tensor], max_nodes: int | None, cpu_only: bool = False
) -> Walk | None:
    """The leaves the graph of ``roots`` reaches (see ``Walk``); None past ``max_nodes``
    nodes, or at a leaf off the CPU when ``cpu_only``."""
    leaves: list[torch.Tensor] = []
    elements, params, python = 0, False, False
    seen: set[Any] = set()
    stack: list[Any] = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:  # bounded by the graph (and max_nodes): each node is expanded once
        node = stack.pop()
        if node is None or node in seen:
            continue
        if max_nodes is not None and len(seen) >= max_nodes:
            return None
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            if cpu_only and not variable.is_cpu:
                return None
            leaves.append(variable)
            elements += variable.numel()
            params = params or isinstance(variable, torch.nn.Parameter)
            python = python or bool(variable._backward_hooks)
            continue
        # torch's own nodes are C++ classes; a custom Function's is a Python class
        python = python or type(node).__module__ != "builtins"
        stack.extend(child for child, _ in node.next_functions)
    return leaves, elements, params, python


class Plan(NamedTuple):
    """A pass planned ahead from the tensors of one message this worker sent (``plan``):
    the walk of their graph, made while the receiver was busy, not in its hop."""

    grad_fns: tuple[Any, ...]  # the roots' nodes when planned: a root changed since
    # (an in-place op gives it another node) makes the plan stale
    walk: Walk
    small: bool  # whether it may run as a small pass (the walk stopped at no bound)


def plan(roots: Sequence[torch.Tensor]) -> Plan | None:
    """The plan of a pass from ``roots``, every one a non-leaf tensor requiring grad;
    None where one is not (such a pass is planned as it runs)."""
    grad_fns = []
    for root in roots:
        if not root.requires_grad or root.grad_fn is None:
            return None
        grad_fns.append(root.grad_fn)
    return Plan(tuple(grad_fns), *_walk(roots))


def _walk(roots: Sequence[torch.Tensor]) -> tuple[Walk, bool]:
    """The walk of the graph of ``roots``, and whether its pass is small enough for the
    loop (``_small_graph_leaves``: where not, it is walked without bounds)."""
    walk = _small_graph_leaves(roots)
    if walk is not None:
        return walk, True
    walk = _walk_leaves(roots, max_nodes=None)
    assert walk is not None  # with no bound the walk never gives up
    return walk, False


def runs_after_reply(plan: Plan, received: Mapping[int, Any]) -> bool:
    """Whether a pass planned as ``plan`` may run after its hop's reply is written: it
    sends no gradient on (no leaf of the walk is in ``received``, by id), is small, runs
    the light way (not torch's engine: no reducer can be fed), and calls no Python code
    that a walk can see. Nothing such a pass does can fail but for a hook on an inner
    tensor (see ``AutogradContext.run_late``)."""
    leaves, _, params, python = plan.walk
    if not plan.small or python or _may_feed_reducer(params):
        return False
    return not any(id(leaf) in received for leaf in leaves)


def plan_holds(plan: Plan, roots: Sequence[torch.Tensor]) -> bool:
    """Whether ``plan`` holds for a pass from ``roots`` (the tensors it was made for)."""
    grad_fns = plan.grad_fns
    if len(grad_fns) != len(roots):
        return False
    for grad_fn, root in zip(grad_fns, roots, strict=True):  # noqa: SIM110 (no generator)
        if root.grad_fn is not grad_fn:
            return False
    return True


class _PythonInGraph(Exception):
    """Raised by the guard of a pass on the loop where the graph was about to call Python
    code (a hook, a custom Function's backward, a saved-tensor hook): none of it has run."""


def _refuse_python(frame: Any, event: str, arg: Any) -> None:
    # A profile function sees every Python frame this thread enters; a pass of built-in
    # nodes enters none. torch's own Function plumbing and this module's _Entry are known
    # to be harmless; the first other frame is stopped before its first line runs.
    if event == "call" and frame.f_globals.get("__name__") not in _HARMLESS_MODULES:
        raise _PythonInGraph


_HARMLESS_MODULES = frozenset({"torch.autograd.function", __name__})


class _Entry(torch.autograd.Function):
    """The node through which a gradient enters this worker's graph at a root that is a
    leaf (a tensor this worker sent, whose gradient came back): the leaf's hooks see the
    gradient there, as they do behind torch's send function. Nothing is copied."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()  # a new tensor on the same memory (the input itself would
        # make autograd build a view of it, which sparse tensors do not have)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Seed(torch.autograd.Function):
    """A scalar whose backward hands each root its gradient, as ``grad_outputs`` would:
    torch's engine only starts from scalar roots whose gradient is one."""

    @staticmethod
    def forward(ctx: Any, grads: tuple[Any, ...], *roots: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Any, ...]:
        grads, ctx.grads = ctx.grads, None  # the graph is retained; these need not be
        return (None, *grads)


# torch's autograd engine, called directly: torch.autograd.grad wraps it in Python frames
# that the guard of a pass on the loop would have to tell from user code.
_ENGINE: Any = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

# Function.apply is untyped in torch's stubs.
_enter: Callable[[torch.Tensor], torch.Tensor] = _Entry.apply  # type: ignore[assignment]
_seed: Callable[..., torch.Tensor] = _Seed.apply  # type: ignore[assignment]


class LocalGraph:
    """Runs one context's passes on this worker, one at a time (torch's engine refuses two
    at once in one context), and keeps its torch context if it needed one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._torch_context: int | None = None
        # Received leaves whose gradients torch's engine hands to _deposit (never to the
        # torch context): their AccumulateGrad nodes, held so the hooks stay on them.
        self._hooked: dict[int, Any] = {}
        self._outbox: dict[int, tuple[torch.Tensor, Any]] | None = None
        self._outbox_lock = threading.Lock()  # CUDA graphs run on device threads

    def run(
        self, roots: Sequence[torch.Tensor], grad_outputs: Sequence[Any],
        received: Callable[[], Mapping[int, torch.Tensor]], rank: int,
        planned: Plan | None = None,
    ) -> tuple[Routed, bool]:  # fmt: skip
        """One pass: the gradients it gives, and whether they were computed by torch's
        engine (then only the received leaves' ones are listed; the others stay in the
        torch context, see ``gradients``). ``received()``: id -> received leaf; ``rank``:
        this worker's; ``planned``: the plan made for ``roots`` (``plan``), where it still
        holds (``plan_holds``).

        Raises the graph's error as torch reports it.
        """
        if planned is not None:
            direct: Routed = []
            pairs = list(zip(roots, grad_outputs, strict=True))
            walk, small = planned.walk, planned.small
        else:
            direct, pairs = _split_roots(roots, grad_outputs)
            walk, small = _walk([root for root, _ in pairs])
        leaves, elements, params, _ = walk
        if not leaves:
            return direct, False
        with self._lock:
            if _may_feed_reducer(params):
                return direct + self._run_on_torch_engine(pairs, received, rank), True
        if not small or elements + _root_elements(pairs) > LOOP_PASS_MAX_ELEMENTS:
            return direct + _engine_pass(pairs, leaves), False
        # A pass small enough for the loop runs on one intra-op thread wherever it runs:
        # the thread waiting in backward() too (a parallel region's other threads, asleep
        # since the last message, cost more than they give: runtime/intraop.py).
        with one_thread():
            return direct + _engine_pass(pairs, leaves), False

    def run_on_loop(
        self, roots: Sequence[torch.Tensor], grad_outputs: Sequence[Any]
    ) -> Routed | None:
        """The light pass, run on the calling thread (the event loop) only where it is
        small, on the CPU, cannot feed a reducer, and calls no Python code; otherwise
        None, with nothing run (then ``run`` it on a pool thread, where user code may
        block). What it returns is what ``run`` would.

        Raises the graph's error as torch reports it (an error in a built-in node).
        """
        planned = _plan_loop_pass(roots, grad_outputs)
        if planned is None:
            return None
        direct, pairs, leaves = planned
        if not leaves:
            return direct
        # No collection meanwhile: a finalizer it ran would be Python code the guard stops.
        # One intra-op thread: the loop must not wait at a parallel region's barrier.
        collecting = gc.isenabled()
        gc.disable()
        with one_thread():
            sys.setprofile(_refuse_python)
            try:
                routed = _engine_pass(pairs, leaves)
            except _PythonInGraph:
                return None
            finally:
                sys.setprofile(None)
                if collecting:
                    gc.enable()
        return direct + routed

    @property
    def on_torch_engine(self) -> bool:
        """Whether a pass of this context ran on torch's engine (it may feed a reducer)."""
        return self._torch_context is not None

    def gradients(self) -> dict[Any, Any]:
        """The gradients torch's engine accumulated for this worker's own leaves."""
        with self._lock:
            if self._torch_context is None:
                return {}
            return dict(torch_dist_engine.get_gradients(self._torch_context))

    def close(self) -> None:
        """Release the torch context, if any, on a background thread (it is slow)."""
        with self._lock:
            context_id, self._torch_context = self._torch_context, None
            self._hooked.clear()
        if context_id is not None:
            _releaser().put(context_id)

    def _run_on_torch_engine(
        self, pairs: list[tuple[torch.Tensor, Any]],
        received: Callable[[], Mapping[int, torch.Tensor]], rank: int,
    ) -> Routed:  # fmt: skip
        if self._torch_context is None:
            self._torch_context = _new_torch_context(rank)
        keep_default_group()  # a reducer may hold it: see groups.py
        for leaf_id, leaf in received().items():
            if leaf_id not in self._hooked:
                self._hooked[leaf_id] = _hook_accumulator(
                    leaf, functools.partial(self._deposit, leaf_id, leaf)
                )
        with torch.enable_grad():
            seed = _seed(tuple(g for _, g in pairs), *(r for r, _ in pairs))
        self._outbox = {}
        try:
            torch_dist_engine.backward(self._torch_context, [seed], True)
            return list(self._outbox.values())
        except RuntimeError as exc:
            text = str(exc)  # torch's engine already says which node; our caller says it
            if text.startswith(_NODE_PREFIX):
                text = text.partition(": ")[2]
            raise RuntimeError(text) from exc
        finally:
            self._outbox = None

    def _deposit(self, leaf_id: int, leaf: torch.Tensor, grad_inputs: Any) -> Any:
        """A received leaf's gradient, in a pass on torch's engine: taken for sending, and
        kept out of the torch context (``(None,)``)."""
        outbox = self._outbox
        if outbox is None:  # a pass of the light way, or a local backward: not ours
            return None
        grad = grad_inputs[0]
        if grad is None:
            return None
        with self._outbox_lock:
            held = outbox.get(leaf_id)
            outbox[leaf_id] = (leaf, grad if held is None else held[1] + grad)
        return (None,)


def _split_roots(
    roots: Sequence[torch.Tensor], grad_outputs: Sequence[Any]
) -> tuple[Routed, list[tuple[torch.Tensor, Any]]]:
    """The roots of a pass that are plain leaves, routed with their gradients as they are,
    and the (root, gradient) pairs of the others; roots not requiring grad are left out.

    A leaf root (a tensor this worker made and sent, whose gradient came back) has no
    graph behind it: its gradient is the one received, which is all a pass would give it
    unless it has hooks. One with hooks (or a parameter, which DDP's reducer may watch)
    is entered through ``_Entry``, so that its hooks see the gradient.
    """
    direct: Routed = []
    pairs: list[tuple[torch.Tensor, Any]] = []
    for root, grad in zip(roots, grad_outputs, strict=True):
        if not root.requires_grad:
            continue
        if root.grad_fn is not None:
            pairs.append((root, grad))
        elif type(root) is torch.Tensor and not root._backward_hooks:
            direct.append((root, grad))
        else:
            with torch.enable_grad():
                pairs.append((_enter(root), grad))
    return direct, pairs


def _engine_pass(pairs: list[tuple[torch.Tensor, Any]], leaves: list[torch.Tensor]) -> Routed:
    """The leaves' gradients from one run of torch's engine (as ``torch.autograd.grad``
    gives them, without its Python wrapper: the gradients here are the graph's own)."""
    grads = _ENGINE.run_backward(
        tuple(root for root, _ in pairs),
        tuple(grad for _, grad in pairs),
        True,  # keep the graph: other hops of the context may run it again
        False,
        tuple(leaves),
        True,  # allow unused leaves
        False,  # return the leaves' gradients, never accumulate into .grad
    )
    return [(leaf, grad) for leaf, grad in zip(leaves, grads, strict=True) if grad is not None]


def _plan_loop_pass(
    roots: Sequence[torch.Tensor], grad_outputs: Sequence[Any]
) -> tuple[Routed, list[tuple[torch.Tensor, Any]], list[torch.Tensor]] | None:
    """The roots routed as they are, the (root, gradient) pairs and the leaves of a pass
    that may run on the loop: small, on the CPU, feeding no reducer, with no profiler
    running; None otherwise."""
    if sys.getprofile() is not None:  # a profiler is on (cProfile): leave it alone
        return None
    # Where CUDA is in use, a node between CPU roots and leaves may still run on one of
    # torch's device threads, where the guard cannot see its hooks: the pool takes those.
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    tensors = [*roots, *(g for g in grad_outputs if isinstance(g, torch.Tensor))]
    if any(not tensor.is_cpu for tensor in tensors):
        return None
    direct, pairs = _split_roots(roots, grad_outputs)
    walk = _small_graph_leaves([root for root, _ in pairs])
    if walk is None:
        return None
    leaves, elements, params, _ = walk
    too_big = elements + _root_elements(pairs) > LOOP_PASS_MAX_ELEMENTS
    # One that may feed a reducer runs on torch's engine (not on the loop).
    if too_big or _may_feed_reducer(params):
        return None
    return direct, pairs, leaves


def _root_elements(pairs: list[tuple[torch.Tensor, Any]]) -> int:
    elements = 0
    for root, _ in pairs:
        elements += root.numel()
    return elements


# A pass that reaches an nn.Parameter may feed DDP's reducer where a process group is
# initialised: DDP needs both (see the module's docstring).
_DISTRIBUTED = torch.distributed.is_available()


def _group_initialised() -> bool:
    return _DISTRIBUTED and torch.distributed.is_initialized()


def _may_feed_reducer(params: bool) -> bool:
    """Whether a pass whose walk found ``params`` (an ``nn.Parameter`` among its leaves)
    may feed DDP's reducer: then it runs on torch's engine."""
    return params and _group_initialised()


def _hook_accumulator(leaf: torch.Tensor, hook: Callable[[Any], Any]) -> Any:
    """Put ``hook`` before ``leaf``'s ``AccumulateGrad`` node; returns the node (the leaf
    holds it only weakly: whoever wants the hook kept must hold it)."""
    with torch.enable_grad():
        view: Any = leaf.view_as(leaf).grad_fn
    accumulator = view.next_functions[0][0]
    accumulator.register_prehook(hook)
    return accumulator


_engine_lock = threading.Lock()
_engine_ready = False


def _new_torch_context(rank: int) -> int:
    """A torch context id. torch makes a context the current one of the thread that makes
    it, and a thread can have one only: so each is made on a thread of its own."""
    global _engine_ready
    with _engine_lock:
        if not _engine_ready:
            try:
                torch_dist_engine._init(rank if 0 <= rank <= _MAX_WORKER_ID else 0)
            except RuntimeError:
                torch_dist_engine._get_max_id()  # initialised already (torch's own RPC)
            _engine_ready = True
    made: list[int] = []
    maker = threading.Thread(
        target=lambda: made.append(torch_dist_engine._new_context()._context_id()),
        name="asyncrpc-torch-context",
    )
    maker.start()
    maker.join()
    if not made:
        raise RuntimeError("torch's distributed autograd refused to make a context")
    return made[0]


_release_queue: queue.SimpleQueue[int] | None = None
_release_lock = threading.Lock()


def _releaser() -> queue.SimpleQueue[int]:
    """The queue of a daemon thread that releases torch contexts: each release costs ~2 ms
    of CPU (torch raises and catches an error for want of its RPC agent) with the GIL
    released, so it is kept off the loop and the pool."""
    global _release_queue
    with _release_lock:
        if _release_queue is None:
            _release_queue = queue.SimpleQueue()
            threading.Thread(
                target=_release_forever, args=(_release_queue,), daemon=True,
                name="asyncrpc-torch-context-release",
            ).start()  # fmt: skip
        return _release_queue


def _release_forever(ids: queue.SimpleQueue[int]) -> None:
    while True:  # a daemon thread, parked on the queue: it ends with the process
        context_id = ids.get()
        with contextlib.suppress(RuntimeError):  # not there any more: nothing to free
            torch_dist_engine._release_context(context_id)
