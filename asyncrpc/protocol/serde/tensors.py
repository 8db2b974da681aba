"""Out-of-band tensors: descriptors, raw byte views and zero-copy rebuilding (layer L1).

A dense tensor never enters the pickle stream: the pickler replaces it by a small descriptor
tuple and its bytes travel as a raw segment; the receiver rebuilds it as a view over the
buffer its allocator made, without copying the bytes again.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from typing import Any, Final

import torch

from asyncrpc.errors import SerializationError
from asyncrpc.protocol.serde.policy import DEFAULT, TensorPolicy

__all__ = [
    "SMALL_TENSOR_BYTES",
    "TENSOR_PID",
    "Allocator",
    "Segment",
    "TensorDescriptor",
    "export_tensor",
    "import_tensor",
    "is_small_tensor",
    "memory_view",
    "rebuild_small_tensor",
    "rebuild_sparse_tensor",
    "reduce_small_tensor",
    "reduce_tensor_fallback",
]

Allocator = Callable[[int, str], tuple[object, memoryview]]
"""The wire's allocator: ``(nbytes, tag) -> (owner, writable memoryview of exactly nbytes)``."""

Segment = tuple[memoryview, str]
"""A sent segment: the bytes and their tag (the device the receiver must put them on)."""

# (TENSOR_PID, segment index, dtype name, shape, stride, storage offset in elements within
# the segment, requires_grad, is nn.Parameter, receiver's device).
TensorDescriptor = tuple[int, int, str, tuple[int, ...], tuple[int, ...], int, bool, bool, str]

# The first field of a tensor's descriptor: a version tag of its layout, so a descriptor
# is told apart from other tuples in tests and in a malformed payload's error.
TENSOR_PID: Final = 0

SMALL_TENSOR_BYTES: Final = 16384
"""Dense CPU tensors up to this size travel inside the pickle, not as segments: a segment
costs a receive buffer (a torch allocation, cold between messages), a read of its own and a
frame piece, ~50 µs of round trip for an 8 KiB tensor on the 2-core VM; copying 16 KiB into
the pickle and out again costs a few. At 32 KiB the two ways cost the same, at 64 KiB the
copies lose (bench/RESULTS.md, "Tensors inside the pickle up to 16 KiB")."""

_Parameter = torch.nn.Parameter
_UINT8 = torch.uint8
_STRIDED = torch.strided
_COMPRESSED_LAYOUTS = frozenset(
    {torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)

# Every dtype this torch knows, by its name without the "torch." prefix ("float8_e4m3fn").
# Aliases (torch.float, torch.half...) are the same objects and collapse onto one name.
_DTYPE_NAMES: Final[dict[torch.dtype, str]] = {
    value: str(value).removeprefix("torch.")
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}
_DTYPES: Final[dict[str, torch.dtype]] = {name: dtype for dtype, name in _DTYPE_NAMES.items()}

# PyMemoryView_FromMemory wraps raw memory without creating a ctypes array type per length
# ((c_char * n) would fill ctypes' array-type cache with one type per distinct size).
_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ: Final = 0x100
_PYBUF_WRITE: Final = 0x200


def memory_view(address: int, nbytes: int, *, writable: bool) -> memoryview:
    """Return a byte memoryview over ``nbytes`` of raw memory at ``address`` (no copy).

    The view does not keep the memory alive: the caller keeps its owner (a tensor).

    Args:
        address: the first byte, e.g. ``tensor.data_ptr()``.
        nbytes: the length in bytes.
        writable: whether the view may be written through.

    Returns:
        A one-dimensional memoryview of format ``"B"``.
    """
    if nbytes == 0:
        # Empty tensors may have a null data pointer; an empty bytearray is always valid.
        return memoryview(bytearray())
    view: memoryview = _from_memory(address, nbytes, _PYBUF_WRITE if writable else _PYBUF_READ)
    return view


def export_tensor(
    tensor: torch.Tensor, key: int, policy: TensorPolicy = DEFAULT
) -> tuple[TensorDescriptor, Segment, torch.Tensor] | None:
    """Describe a dense tensor and expose the bytes it touches, or None to let torch reduce it.

    Layout rule: the segment is the smallest storage span the tensor touches, sent with the
    tensor's own strides (a transpose or permute keeps its strides, an expanded tensor sends
    only its distinct elements). A view with gaps keeps its strides too while the gaps
    are small (at most the tensor's size, or ``GAP_BYTES``); past that (``x[:, 0]`` of a
    big matrix) the tensor is sent ``.contiguous()`` instead, so a segment is never
    bigger than twice ``numel * element_size`` plus ``GAP_BYTES``. Conjugate and negative
    bits are resolved first.

    Args:
        tensor: a ``torch.Tensor`` or ``nn.Parameter`` (exact types).
        key: the index its segment will have.
        policy: the message's tensor policy; it brings a tensor not in CPU memory to the
            host and names the receiver's device (``TensorPolicy.to_host``).

    Returns:
        ``(descriptor, segment, keepalive tensor backing the segment)``, or None for
        sparse, quantized and meta tensors (torch's own ``__reduce_ex__`` handles them).

    Raises:
        SerializationError: the policy cannot send a tensor of this device.
    """
    if tensor.layout is not _STRIDED or tensor.is_quantized or tensor.is_meta:
        return None
    is_param = type(tensor) is _Parameter
    requires_grad = tensor.requires_grad
    if tensor.is_cpu:
        device = "cpu"
    else:
        device, tensor = policy.to_host(tensor)
    tensor, stride, nbytes = _resolved_span(tensor)
    # A tensor the policy left on its device went by a handle named in its tag (CUDA IPC):
    # no bytes travel, the receiver's ``to_device`` opens the handle.
    view = memory_view(tensor.data_ptr(), nbytes, writable=False) if tensor.is_cpu else _NONE
    shape = tuple(tensor.shape)
    dtype = _DTYPE_NAMES[tensor.dtype]
    descriptor = (TENSOR_PID, key, dtype, shape, stride, 0, requires_grad, is_param, device)
    return descriptor, (view, device), tensor


_NONE = memoryview(b"")


def _resolved_span(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """Resolve conjugate and negative bits; return the tensor, its strides and its size.

    The size, in bytes from ``data_ptr()``, is the storage span the tensor touches, or the
    tensor made contiguous when that span has gaps (see ``export_tensor``).
    """
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    stride: tuple[int, ...] = tensor.stride()
    span = _span(tensor, stride)
    numel = tensor.numel()
    # A view with gaps keeps its strides (as torch sends it) while the gaps cost little:
    # at most the tensor's own size, or GAP_BYTES. Past that it is sent contiguous.
    if span > 2 * numel and (span - numel) * tensor.element_size() > GAP_BYTES:
        tensor = tensor.detach().contiguous()
        stride = tensor.stride()
        span = tensor.numel()
    return tensor, stride, span * tensor.element_size()


def is_small_tensor(tensor: torch.Tensor, limit: int = SMALL_TENSOR_BYTES) -> bool:
    """True for a dense CPU tensor of at most ``limit`` bytes: it goes in the pickle."""
    return (
        tensor.layout is _STRIDED
        and tensor.is_cpu
        and tensor.numel() * tensor.element_size() <= limit
        and not tensor.is_quantized
    )


def reduce_small_tensor(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Reduce a small dense CPU tensor (``is_small_tensor``) to one bytes object.

    Below a few KiB a segment costs more than the bytes: a buffer to allocate and map on
    the receiver, a descriptor and a frame piece, about 10 µs a tensor. The layout and the
    bytes are packed in one ``bytes``, so the pickler visits four objects, not twenty (it
    calls back into Python for each). Pickle's memo still makes a tensor sent twice arrive
    as one object.
    """
    flags = tensor.requires_grad | (type(tensor) is _Parameter) << 1
    tensor, stride, nbytes = _resolved_span(tensor)
    name = _DTYPE_NAMES[tensor.dtype].encode()
    ndim = tensor.dim()
    layout = struct.pack(f"<B{len(name)}sBB{2 * ndim}q", len(name), name, ndim, flags,
                         *tensor.shape, *stride)  # fmt: skip
    data = ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
    return rebuild_small_tensor, (layout + data,)


def rebuild_small_tensor(packed: bytes) -> torch.Tensor:
    """Rebuild a tensor ``reduce_small_tensor`` packed (into a copy of its bytes).

    Uses as few torch calls as it can: each goes through torch's dispatcher, which costs
    several µs when its code is cold, as it is between two messages.

    Raises:
        SerializationError: the packed layout is malformed or names an unknown dtype.
    """
    try:
        name_len = packed[0]
        dtype = _DTYPES[packed[1 : 1 + name_len].decode()]
        ndim, flags = packed[1 + name_len], packed[2 + name_len]
        offset = 3 + name_len
        dims = struct.unpack_from(f"<{2 * ndim}q", packed, offset)
    except (IndexError, KeyError, UnicodeDecodeError, struct.error) as exc:
        raise SerializationError(f"malformed small tensor: {exc}") from exc
    shape, stride = dims[:ndim], dims[ndim:]
    data = bytearray(memoryview(packed)[offset + 16 * ndim :])
    if not data:
        tensor = torch.empty(shape, dtype=dtype).as_strided(shape, stride)
    else:
        tensor = torch.frombuffer(data, dtype=dtype)
        if ndim != 1 or stride != (1,) or shape[0] != tensor.numel():
            tensor = tensor.as_strided(shape, stride)
    if flags & 2:
        return _Parameter(tensor, requires_grad=bool(flags & 1))
    if flags & 1:
        tensor.requires_grad_(True)
    return tensor


# Gaps a strided view may carry over the wire (see _resolved_span).
GAP_BYTES = 4096


def _span(tensor: torch.Tensor, stride: tuple[int, ...]) -> int:
    """Return how many storage elements ``tensor`` touches, from its first one to its last."""
    if tensor.is_contiguous():
        return tensor.numel()
    span = 1
    for size, step in zip(tensor.shape, stride, strict=True):
        if size == 0:
            return 0
        span += (size - 1) * step
    return span


def import_tensor(
    descriptor: tuple[Any, ...], owner: object, policy: TensorPolicy = DEFAULT
) -> torch.Tensor:
    """Rebuild a tensor from its descriptor and the owner of its received segment.

    CPU tensors are views of the owner's memory (no copy); others are moved to their device
    by ``policy.to_device``.

    Args:
        descriptor: the tuple ``export_tensor`` made.
        owner: what ``allocate`` returned for the segment (a uint8 tensor), or any
            bytes-like object holding the segment; an exception stands for a segment that
            could not be received (e.g. shared memory that is gone) and is raised here.
        policy: the message's tensor policy (moves a segment tagged with a device there).

    Returns:
        The tensor, an ``nn.Parameter`` when one was sent, with its requires_grad flag.

    Raises:
        SerializationError: an unknown dtype name, or the segment could not be received.
    """
    if isinstance(owner, BaseException):
        raise SerializationError(f"a tensor could not be received: {owner}") from owner
    _, _, dtype_name, shape, stride, offset, requires_grad, is_param, device = descriptor
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise SerializationError(f"this torch has no dtype {dtype_name!r}")
    base = owner if isinstance(owner, torch.Tensor) else _buffer_to_tensor(owner)
    if device != "cpu":
        # Move the segment, not the rebuilt view: it is exactly the span the view touches,
        # so its strides survive even where the view overlaps itself.
        base = policy.to_device(base, device)
    if dtype is not _UINT8:
        base = base.view(dtype)
    tensor = base.as_strided(shape, stride, offset)
    if is_param:
        return _Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _buffer_to_tensor(owner: object) -> torch.Tensor:
    """View a bytes-like segment owner as a flat uint8 tensor (copying only read-only ones)."""
    view = memoryview(owner).cast("B")  # type: ignore[arg-type]  # TypeError if not a buffer
    if view.nbytes == 0:
        return torch.empty(0, dtype=_UINT8)
    if view.readonly:
        view = memoryview(bytearray(view))  # torch.frombuffer wants a writable buffer.
    return torch.frombuffer(view, dtype=_UINT8)


def reduce_tensor_fallback(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Reduce a tensor that ``export_tensor`` declined, or None to let pickle call torch.

    Sparse tensors go through torch's own ``__reduce_ex__`` (their dense parts then travel
    out-of-band), with the rebuild function swapped: torch's appends every rebuilt sparse
    tensor to a global list that only ``torch.load`` drains, a leak under plain pickle.
    """
    if tensor.layout is _STRIDED:
        return None
    reduced: tuple[Any, ...] = tensor.__reduce_ex__(5)  # type: ignore[no-untyped-call]
    if reduced[0] is torch._utils._rebuild_sparse_tensor:
        return (rebuild_sparse_tensor, *reduced[1:])
    return reduced


def rebuild_sparse_tensor(layout: torch.layout, data: tuple[Any, ...]) -> torch.Tensor:
    """Rebuild a sparse tensor from torch's reduction (``torch._utils._rebuild_sparse_tensor``).

    Invariants are checked when ``torch.sparse.check_sparse_tensor_invariants`` is enabled,
    as ``torch.load`` does, but per tensor and without torch's global list.

    Args:
        layout: the sparse layout.
        data: torch's reduction of the tensor's parts.

    Returns:
        The sparse tensor.

    Raises:
        SerializationError: a layout this function does not know.
    """
    check: bool = torch.sparse.check_sparse_tensor_invariants.is_enabled()  # type: ignore[no-untyped-call]
    if layout is torch.sparse_coo:
        indices, values, size, *rest = data
        return torch.sparse_coo_tensor(
            indices, values, size, check_invariants=check, is_coalesced=rest[0] if rest else None
        )
    if layout in _COMPRESSED_LAYOUTS:
        compressed, plain, values, size = data
        return torch.sparse_compressed_tensor(
            compressed, plain, values, size, layout=layout, check_invariants=check
        )
    raise SerializationError(f"cannot rebuild a sparse tensor of layout {layout}")
