"""Device maps as a call-pipeline hook (layer L2.45): which of the callee's devices a CUDA
tensor lands on, for requests and for their replies.

torch's rule: a caller's map (its device -> the callee's) applies to the request, and the
same map read backwards to the reply. The caller knows both, so its request carries the
backward map in a header field (``dm``) and the callee applies it to the reply; the callee
needs no copy of its callers' options. Without a map the serializer's default refuses a
CUDA tensor with an error that says what to do.

How the bytes cross is the ``Transfer``'s: ``HostTransfer`` below waits for the device on
the spot (where no GPU is set up), ``StagedTransfer`` (``staging.py``) never does: its
frames wait in the pipeline's ``ready`` stages and the first user of received tensors
orders its streams after their copies (the callee's function, the caller's
``Future.value``).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, cast

import torch

from asyncrpc.errors import InitError, SerializationError
from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.protocol.wire import Allocator
from asyncrpc.runtime.calls.pipeline import (
    CallHook,
    IncomingCall,
    ItemReady,
    ItemsIn,
    OutgoingCall,
    StreamLinks,
)
from asyncrpc.runtime.cuda.callee import RequestStreams
from asyncrpc.runtime.cuda.devices import CudaStream
from asyncrpc.runtime.cuda.ipc import FIELD as IPC_FIELD
from asyncrpc.runtime.cuda.ipc import STREAM_FIELD

__all__ = [
    "FIELD",
    "DeviceMapError",
    "DeviceMapHook",
    "HostCopy",
    "HostTransfer",
    "Transfer",
    "check_device_maps",
]

FIELD = "dm"  # the header field this hook owns: the reply's map, "cuda:i" -> "cuda:j"
_ITEMS = object()  # the key of a stream's item policy in its call's state


class DeviceMapError(InitError, ValueError):
    """``device_maps`` or ``devices`` name devices this worker cannot use, or a map is not
    one-to-one (raised by ``init_rpc``; a ``ValueError`` as torch's, and an ``InitError``)."""


def check_device_maps(
    name: str,
    device_maps: Mapping[str, Mapping[str, str]] | None,
    devices: list[str] | None,
    device_count: int,
) -> None:
    """Check this worker's own device options before it joins, as torch checks them: no
    duplicated device, only CPU or existing CUDA devices, each map one-to-one, and a map's
    sources among ``devices`` when those are given. (A map's targets are the callee's
    devices: the callee checks what it receives.)

    Raises:
        DeviceMapError: naming the worker, the map and what is wrong with it.
    """
    listed = list(devices or [])
    if len(set(listed)) != len(listed):
        raise DeviceMapError(f"worker {name!r} lists a device twice: devices = {listed}")
    bad = [d for d in listed if not _exists(d, device_count)]
    if bad:
        raise DeviceMapError(
            f"worker {name!r} names devices it does not have: {bad} (devices = {listed}, "
            f"CUDA device count = {device_count})"
        )
    for callee, mapping in (device_maps or {}).items():
        targets = list(mapping.values())
        if len(set(targets)) != len(targets):
            raise DeviceMapError(
                f"worker {name!r}'s device map for {callee!r} is not one-to-one: two devices "
                f"map to one ({dict(mapping)})"
            )
        sources = list(mapping)
        if listed:
            stray = [d for d in sources if d not in listed]
            if stray:
                raise DeviceMapError(
                    f"worker {name!r}'s device map for {callee!r} maps {stray}, which are not "
                    f"in its devices {listed}"
                )
        else:
            missing = [d for d in sources if not _exists(d, device_count)]
            if missing:
                raise DeviceMapError(
                    f"worker {name!r}'s device map for {callee!r} maps devices it does not "
                    f"have: {missing} (CUDA device count = {device_count})"
                )


def _exists(device: str, device_count: int) -> bool:
    if device == "cpu":
        return True
    index = cuda_index(device)
    return index is not None and index < device_count


def cuda_index(device: str) -> int | None:
    """0 for "cuda:0"; None for any other device string (no index: not ours to guess)."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        return None
    return int(index)


class Transfer(Protocol):
    """How one agent moves CUDA tensors: one policy per message, and the waits it needs."""

    def policy(self, device_map: Mapping[str, str], peer: int | None = None) -> TensorPolicy:
        """The tensor policy of one message sent to (or received from) ``peer`` under
        ``device_map``."""
        ...

    def field_out(self, peer: int) -> Any:
        """What the next message to ``peer`` carries in the IPC field (None: nothing)."""
        ...

    def field_in(self, peer: int, value: Any) -> None:
        """Take the IPC field a message from ``peer`` carried (None: it had none)."""
        ...

    def ready(self, policy: TensorPolicy) -> Awaitable[None] | None:
        """What a frame pickled under ``policy`` must wait for before it is written."""
        ...

    def before_use(self, policy: TensorPolicy) -> Callable[[], None] | None:
        """What the first thread to use tensors unpickled under ``policy`` calls first."""
        ...

    def serve(self, request: TensorPolicy, reply: TensorPolicy) -> RequestStreams | None:
        """The pool streams a request runs on (None: its thread's current streams)."""
        ...

    def allocator(self, plain: Allocator) -> Allocator:
        """The wire's allocator of receive memory, given the one for host segments."""
        ...

    def items_out(self, device_map: Mapping[str, str], peer: int | None = None) -> TensorPolicy:
        """The policy of the items of one stream sent to ``peer`` under ``device_map``;
        where it has a ``take`` method, each item's frame waits for what ``take`` returns
        after it (``ItemReady``)."""
        ...

    def links(self, peer: int) -> StreamLinks | None:
        """What the stream frames with ``peer`` carry for this transfer (None: nothing)."""
        ...

    def items_in(self, peer: int) -> ItemsIn | None:
        """The policy of the items of one stream received from ``peer`` (None: the
        defaults)."""
        ...

    def remember(self, value: Any, streams: list[CudaStream]) -> None:
        """A value kept here (a remote() result) was made on ``streams``: sending it later
        waits for that work."""
        ...

    def on_peer_lost(self, peer: int) -> None:
        """``peer`` is gone for good: drop what it shared with this worker."""
        ...


class HostCopy(TensorPolicy):
    """Maps devices and copies through host memory, waiting for the device on the spot.

    The simplest correct transfer: ``to_host`` synchronizes the tensor's current stream
    (so the kernels that wrote it are done) and copies it to pageable memory; the receiver
    copies the segment to its device with a blocking copy. The staged transfer does the
    same work without blocking any thread.
    """

    __slots__ = ("device_map",)

    def __init__(self, device_map: Mapping[str, str]) -> None:
        self.device_map = device_map

    def to_host(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        target = self.device_map.get(str(tensor.device))
        if target is None:
            return super().to_host(tensor)  # raises: the map does not name this device
        torch.cuda.current_stream(tensor.device).synchronize()
        return target, tensor.detach().cpu()


class HostTransfer:
    """``HostCopy`` for every message: nothing to wait for afterwards."""

    def policy(self, device_map: Mapping[str, str], peer: int | None = None) -> TensorPolicy:
        return HostCopy(device_map)

    def field_out(self, peer: int) -> Any:
        return None

    def field_in(self, peer: int, value: Any) -> None:
        pass

    def ready(self, policy: TensorPolicy) -> Awaitable[None] | None:
        return None

    def before_use(self, policy: TensorPolicy) -> Callable[[], None] | None:
        return None

    def serve(self, request: TensorPolicy, reply: TensorPolicy) -> RequestStreams | None:
        return None

    def allocator(self, plain: Allocator) -> Allocator:
        return plain  # every segment lands in host memory; the policy copies it over

    def items_out(self, device_map: Mapping[str, str], peer: int | None = None) -> TensorPolicy:
        return HostCopy(device_map)  # each item's copy is done once it is pickled

    def links(self, peer: int) -> StreamLinks | None:
        return None  # nothing is shared: stream frames carry nothing for it

    def items_in(self, peer: int) -> ItemsIn | None:
        return None  # the default copies each segment to its device on the spot

    def remember(self, value: Any, streams: list[CudaStream]) -> None:
        pass  # the host copy waits for the sending thread's streams on the spot

    def on_peer_lost(self, peer: int) -> None:
        pass  # nothing was shared


class DeviceMapHook(CallHook):
    """Gives each call to a mapped callee, and each reply to a mapped caller, its map, and
    holds their frames and orders their users' streams as the transfer says."""

    fields = frozenset({FIELD, IPC_FIELD, STREAM_FIELD})

    def __init__(
        self,
        device_maps: Mapping[str, Mapping[str, str]] | None,
        transfer: Transfer | None = None,
    ) -> None:
        self._maps = {callee: dict(m) for callee, m in (device_maps or {}).items() if m}
        self._backward = {callee: _inverse(m) for callee, m in self._maps.items()}
        self.transfer: Transfer = transfer if transfer is not None else HostTransfer()

    def __repr__(self) -> str:
        return f"DeviceMapHook({sorted(self._maps)})"

    # -- caller ----------------------------------------------------------------------------

    def active(self) -> bool:
        return bool(self._maps)

    def prepare(self, call: OutgoingCall) -> None:
        forward = self._maps.get(call.callee)
        if forward is None:
            return
        backward = self._backward[call.callee]
        transfer, peer = self.transfer, call.callee_rank
        call.policy.devices = transfer.policy(forward, peer)
        call.reply_policy.devices = transfer.policy(backward, peer)
        call.headers[FIELD] = backward
        ipc = transfer.field_out(peer)
        if ipc is not None:
            call.headers[IPC_FIELD] = ipc

    def ready(self, call: OutgoingCall) -> Awaitable[None] | None:
        return self.transfer.ready(call.policy.devices)

    def completed(
        self, call: OutgoingCall, headers: dict[str, Any] | None, error: BaseException | None
    ) -> None:
        if headers is not None:
            self.transfer.field_in(call.callee_rank, headers.get(IPC_FIELD))
        if error is None:
            call.on_value = self.transfer.before_use(call.reply_policy.devices)

    # -- callee ----------------------------------------------------------------------------

    def receiving(self, call: IncomingCall) -> None:
        backward = call.headers.get(FIELD)
        if backward is None:
            return
        transfer, peer = self.transfer, call.caller_rank
        transfer.field_in(peer, call.headers.get(IPC_FIELD))
        call.policy.devices = transfer.policy({}, peer)  # receiving needs no map
        call.reply_policy.devices = transfer.policy(_checked(backward, call.caller), peer)

    def incoming(self, call: IncomingCall) -> None:
        streams = self.transfer.serve(call.policy.devices, call.reply_policy.devices)
        if streams is not None:  # pool streams, ordered after the data, made current
            call.state[self] = streams
            # A remote() value stays here and leaves later (to_here), pickled on other
            # streams: whoever sends it first must wait for the work that made it.
            made = self.transfer.remember if call.remote else None
            call.wrap(functools.partial(streams.wrap, coroutine=call.coroutine, made=made))
            return
        first = self.transfer.before_use(call.policy.devices)
        if first is not None:
            call.wrap(functools.partial(_after, first=first, coroutine=call.coroutine))

    def replying(self, call: IncomingCall, ok: bool, value: Any) -> None:
        if FIELD in call.headers:
            ipc = self.transfer.field_out(call.caller_rank)
            if ipc is not None:
                call.reply_headers[IPC_FIELD] = ipc
        streams = call.state.get(self)
        if streams is not None:
            streams.replied(ok, call.remote)

    def reply_ready(self, call: IncomingCall) -> Awaitable[None] | None:
        ready = self.transfer.ready(call.reply_policy.devices)
        streams = call.state.get(self)
        return ready if streams is None else streams.leave(ready)

    def stream_items(self, call: IncomingCall, policy: TensorPolicy | None) -> TensorPolicy | None:
        # A callee's items follow the reply's map, as its reply would; a stream argument's
        # items (this worker's, read by the peer) follow this worker's own map to that
        # peer, as the request that carried it did.
        if call.own_items:
            device_map: Mapping[str, str] | None = self._maps.get(call.caller)
        else:
            device_map = getattr(call.reply_policy.devices, "device_map", None)
        if not device_map:
            return policy  # nothing mapped: a CUDA tensor is refused, naming its device
        # To the stream's reader, by handle where a call to it would go so.
        items = self.transfer.items_out(device_map, call.caller_rank)
        take = getattr(items, "take", None)  # a staged one: each item's frame is held
        if take is not None:
            call.state[_ITEMS] = take
        return items

    def items_ready(self, call: IncomingCall) -> ItemReady | None:
        return cast("ItemReady | None", call.state.get(_ITEMS))

    def items_in(self, peer: int) -> ItemsIn | None:
        return self.transfer.items_in(peer)

    def stream_links(self, peer: int) -> StreamLinks | None:
        return self.transfer.links(peer)

    def stream_received(self, peer: int, headers: dict[str, Any]) -> None:
        value = headers.pop(STREAM_FIELD, None)
        if value is not None:
            self.transfer.field_in(peer, value)

    def debug_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"device_maps": {c: dict(m) for c, m in self._maps.items()}}
        stats = getattr(self.transfer, "stats", None)
        if stats is not None:
            info.update(stats())
        return info


def _after(
    fn: Callable[..., Any], first: Callable[[], None], coroutine: bool
) -> Callable[..., Any]:
    """``fn``, calling ``first`` on the thread that runs it, just before (same convention)."""
    if coroutine:

        async def run_coroutine(*args: Any, **kwargs: Any) -> Any:
            first()
            return await fn(*args, **kwargs)

        return run_coroutine

    def run(*args: Any, **kwargs: Any) -> Any:
        first()
        return fn(*args, **kwargs)

    return run


def _inverse(device_map: Mapping[str, str]) -> dict[str, str]:
    return {v: k for k, v in device_map.items()}


def _checked(value: object, caller: str) -> dict[str, str]:
    """The reply map a caller sent, checked: strings naming CUDA devices both ways."""
    if isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) and k.startswith("cuda") and v.startswith("cuda")
        for k, v in value.items()
    ):
        return value
    raise SerializationError(f"worker {caller!r} sent a malformed device map: {value!r}")
