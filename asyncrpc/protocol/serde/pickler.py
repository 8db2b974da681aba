"""The serializer: pickle with out-of-band tensors, custom reducers and RRef hooks (layer L1).

``Serializer.dumps`` turns a value into a pickle payload plus raw tensor segments and
``loads`` turns them back. All per-call state lives in a per-call Pickler or Unpickler, so
one configured serializer serves many threads at once (msgspec style, no thread-locals):
``dumps`` returns all it made, the references its ``persistent_dump`` hook minted too.
"""

from __future__ import annotations

import io
import pickle
import types
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

import torch

from asyncrpc.errors import AsyncRpcError, SerializationError
from asyncrpc.errorstate import reduce_exception
from asyncrpc.protocol.serde.buffers import ReceiveBuffers
from asyncrpc.protocol.serde.policy import DEFAULT, TensorPolicy
from asyncrpc.protocol.serde.reducers import (
    MissingReferenceError,
    ReduceFn,
    ReducerRegistry,
    default_registry,
)
from asyncrpc.protocol.serde.tensors import (
    SMALL_TENSOR_BYTES,
    Segment,
    TensorDescriptor,
    export_tensor,
    import_tensor,
    is_small_tensor,
    rebuild_small_tensor,
    reduce_small_tensor,
    reduce_tensor_fallback,
)

__all__ = ["Discard", "Dumped", "PersistentDump", "PersistentLoad", "Place", "Serializer"]

PersistentDump = Callable[[object, object, list[Any]], tuple[Any, ...] | None]
"""``persistent_dump(obj, context, made)``: a picklable tuple standing for ``obj``, or None.

It appends to ``made`` what it minted for this message (the RRef layer: the forks a
pickled RRef becomes), and ``dumps`` returns that list with the payload."""

Discard = Callable[[Any, list[Any]], None]
"""``discard(context, made)``: what ``persistent_dump`` minted for a value that then failed
to pickle; no message carries it (the RRef layer undoes the forks)."""

PersistentLoad = Callable[[tuple[Any, ...], object], object]
"""``persistent_load(tuple, context)``: the object a ``persistent_dump`` tuple stands for."""

Place = Callable[[list[Segment], list[object], object], list[Segment]]
"""``place(segments, keepalive, context)``: where a pickled value's segments travel.

Called once per ``dumps`` that made segments, after pickling succeeded; ``keepalive[i]``
is the tensor whose memory ``segments[i]`` views. It returns the segments to send (the
agent moves large ones into shared memory for a peer on the same host) and may append to
``keepalive`` what must live as long as the frame.
"""


class Dumped(NamedTuple):
    """What ``dumps`` made of one value (a named tuple: made once per message, cheaply)."""

    payload: bytes
    segments: list[Segment]  # ``(memoryview, tag)`` over the tensors' own memory
    keepalive: list[object]  # what keeps those segments valid until they are written
    made: list[Any] | None  # what ``persistent_dump`` minted for it (None: nothing)


_PROTOCOL: Final = 5
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter

# Types the persistent_dump hook is never asked about: builtin scalars and containers and
# torch's small value types. They make up most of any object graph and are never RRefs.
_PLAIN: Final = frozenset(
    {
        int,
        float,
        complex,
        bool,
        str,
        bytes,
        bytearray,
        type(None),
        tuple,
        list,
        dict,
        set,
        frozenset,
        torch.dtype,
        torch.device,
        torch.Size,
        torch.layout,
        torch.memory_format,
    }
)

# Objects pickle saves by reference (module + qualified name): a failure means the name
# does not lead back to them, so the error tells the user where to define them.
_BY_REFERENCE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)


class _Pickler(pickle.Pickler):
    """One ``dumps`` call: collects tensor segments and consults the hooks for each object."""

    def __init__(
        self,
        file: io.BytesIO,
        reducers: dict[type, ReduceFn],
        hook: PersistentDump | None,
        context: object,
        policy: TensorPolicy | None,
        inline_bytes: int,
    ) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        self._inline_bytes = inline_bytes
        self._reducers = reducers
        self._hook = hook
        self._context = context
        # None: the defaults, asked nothing per tensor (the common case costs no call).
        self._policy = policy
        # id(tensor) -> its descriptor: the same tensor twice is one segment. The tensors
        # stay alive (the object being pickled holds them), so ids cannot be reused.
        self._exported: dict[int, TensorDescriptor] = {}
        self.segments: list[Segment] = []
        self.keepalive: list[object] = []
        # What the persistent_dump hook minted for this message (see PersistentDump).
        self.made: list[Any] = []
        # The last non-plain object seen; when pickling fails, it is the culprit (pickle
        # saves depth first and fails inside the object it entered last).
        self.last: object = None

    # Every hook runs in ``reducer_override``, which pickle calls only for objects it has
    # no exact-type rule for, after its memo: not for ints, strings, tuples, lists or dicts,
    # which make up most of a message. (A ``persistent_id`` method would be called back for
    # every one of them, ~26 Python calls for a backward hop's few objects, and costs a
    # few µs a message even when the code is warm.) An object the hooks replace is saved
    # as a call of a marker function (``_tensor_ref``, ``_hooked_ref``) that the unpickler
    # resolves to its own method; the memo makes a second appearance the same object.
    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is _Tensor or cls is _Parameter:
            self.last = obj
            return self._reduce_tensor(obj)
        if cls in _PLAIN:
            return NotImplemented
        self.last = obj
        if self._hook is not None:
            pid = self._hook(obj, self._context, self.made)
            if pid is not None:
                return _hooked_ref, (pid,)
        reduce_fn = self._reducers.get(cls)
        if reduce_fn is not None:
            return reduce_fn(obj)
        if isinstance(obj, BaseException):
            # An exception in a value (returned, or held by one) is rebuilt from its state,
            # as a raised one is: its class need not take its args back (see errorstate).
            return reduce_exception(obj) or NotImplemented
        return NotImplemented

    def _reduce_tensor(self, tensor: torch.Tensor) -> Any:
        """A plain tensor: a segment outside the payload, or its bytes inside (small)."""
        policy = self._policy
        if (policy is None or not policy.met(tensor)) and is_small_tensor(
            tensor, self._inline_bytes
        ):
            # Called once per tensor (pickle's memo answers a second appearance), in the
            # order segments are exported too: the policy sees one sequence.
            if policy is not None:
                policy.exported(tensor)
            return reduce_small_tensor(tensor)
        descriptor = self._tensor_id(tensor)
        if descriptor is not None:
            return _tensor_ref, (descriptor,)
        reduced = reduce_tensor_fallback(tensor)
        return NotImplemented if reduced is None else reduced

    def _tensor_id(self, tensor: torch.Tensor) -> TensorDescriptor | None:
        descriptor = self._exported.get(id(tensor))
        if descriptor is None:
            policy = self._policy
            exported = export_tensor(tensor, len(self.segments), policy or DEFAULT)
            if exported is None:
                return None
            descriptor, segment, keep = exported
            self.segments.append(segment)
            self.keepalive.append(keep)
            self._exported[id(tensor)] = descriptor
            if policy is not None:
                policy.exported(tensor)
        return descriptor


def _tensor_ref(descriptor: TensorDescriptor) -> torch.Tensor:
    """Marker for a tensor sent as a segment: ``_Unpickler`` reads it as its own method."""
    raise SerializationError("a tensor segment reference outside asyncrpc's unpickler")


def _hooked_ref(pid: tuple[Any, ...]) -> object:
    """Marker for an object the ``persistent_dump`` hook replaced (see ``_tensor_ref``)."""
    raise SerializationError("a hook reference outside asyncrpc's unpickler")


class _Unpickler(pickle.Unpickler):
    """One ``loads`` call: rebuilds tensors from segments and hook tuples through the hook."""

    def __init__(
        self,
        file: io.BytesIO,
        owners: Sequence[object],
        hook: PersistentLoad | None,
        context: object,
        policy: TensorPolicy | None,
    ) -> None:
        super().__init__(file)
        self._owners = owners
        self._hook = hook
        self._context = context
        self._policy = policy
        # segment index -> tensor: a tensor sent twice arrives as one object.
        self._tensors: dict[int, torch.Tensor] = {}

    def _tensor_ref(self, descriptor: TensorDescriptor) -> torch.Tensor:
        key = descriptor[1]
        tensor = self._tensors.get(key)
        if tensor is None:
            if not 0 <= key < len(self._owners):
                raise SerializationError(
                    f"the payload names tensor segment {key} of {len(self._owners)}"
                )
            policy = self._policy
            tensor = import_tensor(descriptor, self._owners[key], policy or DEFAULT)
            self._tensors[key] = tensor
            if policy is not None:
                policy.imported(tensor)
        return tensor

    def _hooked_ref(self, pid: tuple[Any, ...]) -> object:
        if self._hook is None:
            raise SerializationError(
                "the payload holds an object its sender's hook replaced, and this "
                "serializer has no hook to load it"
            )
        return self._hook(pid, self._context)

    def find_class(self, module_name: str, global_name: str) -> Any:
        try:
            found = super().find_class(module_name, global_name)
        except (ImportError, AttributeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            raise MissingReferenceError(module_name, global_name, reason) from exc
        if found is rebuild_small_tensor and self._policy is not None:
            return self._rebuild_small_tensor  # so the policy sees it, in pickle order
        if found is _tensor_ref:
            return self._tensor_ref
        if found is _hooked_ref:
            return self._hooked_ref
        return found

    def _rebuild_small_tensor(self, packed: bytes) -> torch.Tensor:
        tensor = rebuild_small_tensor(packed)
        assert self._policy is not None
        self._policy.imported(tensor)
        return tensor


class Serializer:
    """Pickle with out-of-band tensors: reusable, configured once, safe from many threads.

    Hooks run in this order for every object pickled: the tensor hook (dense tensors
    become segments), then ``persistent_dump`` (not asked about builtin scalars and
    containers), then the reducer registry (exact type), then pickle's own rules.
    """

    __slots__ = (
        "_buffers",
        "_discard",
        "_inline_bytes",
        "_persistent_dump",
        "_persistent_load",
        "_place",
        "_reducers",
    )

    def __init__(
        self,
        *,
        reducers: ReducerRegistry | None = None,
        persistent_dump: PersistentDump | None = None,
        persistent_load: PersistentLoad | None = None,
        discard: Discard | None = None,
        inline_tensor_bytes: int = SMALL_TENSOR_BYTES,
        place: Place | None = None,
    ) -> None:
        """Configure a serializer.

        Args:
            reducers: the reducer registry; ``default_registry`` (live) when None.
            persistent_dump: ``(obj, context, made) -> tuple | None``; a tuple replaces
                ``obj`` in the stream (the RRef layer turns RRefs into fork descriptors
                here, and appends the forks it minted to ``made``).
            persistent_load: ``(tuple, context) -> obj``, the inverse on the receiver.
            discard: ``(context, made)``, told what ``persistent_dump`` minted for a value
                that failed to pickle.
            inline_tensor_bytes: dense CPU tensors of at most this many bytes are copied
                into the payload instead of travelling as segments; -1 for none.
            place: decides where segments travel (see ``Place``); None sends them as they
                are.
        """
        self._inline_bytes = inline_tensor_bytes
        self._place = place
        self._buffers = ReceiveBuffers()
        self._reducers = (default_registry if reducers is None else reducers).table
        self._persistent_dump = persistent_dump
        self._persistent_load = persistent_load
        self._discard = discard

    def dumps(
        self,
        obj: object,
        *,
        context: object = None,
        policy: TensorPolicy | None = None,
    ) -> Dumped:
        """Pickle ``obj``; its dense tensors become raw segments outside the payload.

        Args:
            obj: the value.
            context: handed to ``persistent_dump`` (e.g. the destination worker).
            policy: the message's tensor policy (see ``policy.py``); None keeps the
                defaults: small CPU tensors inline, CUDA tensors refused.

        Returns:
            ``(payload, segments, keepalive, made)``: segments are ``(memoryview, tag)``
            over the tensors' own memory (no copy) and ``keepalive`` holds those tensors;
            keep it until the bytes are written, and do not modify the tensors before then.
            ``made`` lists what ``persistent_dump`` minted for this value (None: nothing):
            the caller sends it with the message or undoes it. Nothing else is retained: a
            failed call leaves no state behind (what was minted goes to ``discard``).

        Raises:
            SerializationError: something cannot be pickled (the cause is chained; the
                message names the offending type). Errors of asyncrpc's own tree raised by
                hooks or reducers propagate unchanged.
        """
        buffer = io.BytesIO()
        pickler = _Pickler(
            buffer, self._reducers, self._persistent_dump, context, policy, self._inline_bytes
        )
        try:
            pickler.dump(obj)
        except BaseException as exc:
            if pickler.made and self._discard is not None:
                self._discard(context, pickler.made)  # no message will carry them
            if isinstance(exc, AsyncRpcError) or not isinstance(exc, Exception):
                raise
            raise SerializationError(_describe_failure(pickler.last, exc)) from exc
        segments = pickler.segments
        if segments and self._place is not None:
            segments = self._place(segments, pickler.keepalive, context)
        return Dumped(buffer.getvalue(), segments, pickler.keepalive, pickler.made or None)

    def loads(
        self,
        payload: bytes | bytearray | memoryview,
        segments: Sequence[object],
        *,
        context: object = None,
        policy: TensorPolicy | None = None,
    ) -> Any:
        """Unpickle a payload whose tensors arrived as ``segments``.

        Args:
            payload: the pickle payload ``dumps`` made.
            segments: the segment owners ``allocate`` made, in order (any bytes-like
                object works too).
            context: handed to ``persistent_load`` (e.g. the sending worker).
            policy: the message's tensor policy (``imported``, ``to_device``); None keeps
                the defaults.

        Returns:
            The value. CPU tensors are views of the segment owners' memory.

        Raises:
            MissingReferenceError: a function or class named in the payload cannot be
                found here (``module``, ``qualname`` and ``reason`` say which and why).
            SerializationError: anything else fails (the cause is chained).
        """
        unpickler = _Unpickler(
            io.BytesIO(payload), segments, self._persistent_load, context, policy
        )
        try:
            return unpickler.load()
        except AsyncRpcError:
            raise
        except Exception as exc:
            raise SerializationError(
                f"cannot unpickle the payload: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            # The memo holds the unpickler's own bound methods (``find_class`` hands them
            # out for the marker functions), a cycle through the unpickler: left to the
            # collector, it would keep every object of the message alive until the next
            # collection, received RRefs too (their owners would wait for the release).
            unpickler.memo.clear()

    def allocate(self, nbytes: int, tag: str) -> tuple[object, memoryview]:
        """The wire's ``Allocator``: an uninitialized uint8 tensor and a view of its bytes.

        Large buffers come from a pool and are recycled once no received tensor uses them
        (see ``asyncrpc.protocol.serde.buffers``). Call it from one thread (the agent's loop).

        Args:
            nbytes: the segment's length.
            tag: the segment's tag (the target device); the bytes land in CPU memory either
                way and ``loads`` moves them.

        Returns:
            ``(owner, writable memoryview of exactly nbytes)``; pass the owners to ``loads``.
        """
        return self._buffers.segment(nbytes, tag)  # CPU memory whatever the tag


def _describe_failure(culprit: object, exc: Exception) -> str:
    """Say which object could not be pickled and, for named objects, how to fix it."""
    if isinstance(exc, RecursionError):
        return f"cannot pickle the value: the object graph is too deep ({exc})"
    if culprit is None:
        return f"cannot pickle the value: {type(exc).__name__}: {exc}"
    kind = type(culprit).__name__
    if isinstance(culprit, _BY_REFERENCE):
        module = getattr(culprit, "__module__", None)
        name = getattr(culprit, "__qualname__", None) or getattr(culprit, "__name__", "?")
        return (
            f"cannot pickle {kind!r} object {module}.{name}: {exc}; define it at module "
            "level in a module importable on both the caller and the callee"
        )
    return f"cannot pickle {kind!r} object: {type(exc).__name__}: {exc}"
