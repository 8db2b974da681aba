"""Same-host CUDA tensors by handle, no bytes on the wire (layer L2.45, above the device seam).

A tensor for a peer that can open this process's CUDA IPC handles is copied, on the
producer's stream, into a device block exported to that peer (``blocks.py``), and travels
as a handle in its segment's tag (``ipc:<device>:<block>:<nbytes>:<descriptor>``) with an
empty segment. The message leaves once that copy is done (``export`` returns its event,
which the frame's send gate polls: a small copy is done by the time the frame is
written), so the consumer needs nothing to wait on: it maps the block (once per block),
copies the bytes into memory of its own on its copy-in stream, and its users are ordered
after that stream as for staged copies. Neither side's later work touches the other's
memory, and a received tensor can be sent on by handle again (an echo).

Why no interprocess event (an H100 machine, ``bench/cuda_call_profile.py``): recording
one per message and waiting on it in the consumer cost about 0.15 ms of host time per
message, more than the rest of the transfer; the producer's local event costs a few us
and polling it nothing that blocks.

Which peers: decided per peer and direction by a probe that rides on the device-map
hook's header field (``ci``), so no new wire message is needed: the first message to a
same-host peer (``group.same_host``: same boot and host id, Linux, no TLS) carries an
*offer* (this process's boot id and a small tensor by handle); the peer answers in its
next message to us whether its boot id matched and opening it worked (its GPUs are found
by UUID, never by index). Until a yes, tensors go staged; after a no, always. With
``cuda_transfer="ipc"`` same-host peers get handles without a probe. A worker never
sends itself a handle (a process cannot open its own).

Lifetime: once the consumer's copy out of a block is done, it names the block back
(``r`` in the same header field, on its next message to the producer), and the block is
free for the next message. Blocks live as long as the peer: when a peer is lost for good,
the producer drops that peer's blocks, drops the references it held on those it had
opened (torch's shared ref counter: ``Devices.unshare``) and collects them
(``Devices.collect``, torch's ``ipc_collect``); the consumer unmaps what it had mapped of
a lost producer's. Bound: a dead consumer's blocks are freed when its loss is detected
(heartbeat timeout), but for one it opened and never named back before dying (torch then
keeps that block until the producer exits).
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from asyncrpc.runtime.cuda.blocks import BLOCK_BYTES_PER_PEER, ExportBlocks
from asyncrpc.runtime.cuda.devices import CudaStream, Devices, Event

__all__ = ["FIELD", "STREAM_FIELD", "TAG", "IpcLinks", "block_of", "is_ipc_tag"]

_log = logging.getLogger(__name__)

# The header field of calls' requests and replies: {"o": offer, "a": answer, "r": ids
# released, "u": ids given back unread}; and the same field on stream frames (streams.py
# in items.py), a key of its own: a stream's end also carries its call's field.
FIELD = "ci"
STREAM_FIELD = "cs"
TAG = "ipc:"
PROBE_BYTES = 16

_UNKNOWN, _OFFERED, _ON, _OFF = "unknown", "offered", "on", "off"


def is_ipc_tag(tag: str) -> bool:
    return tag.startswith(TAG)


def block_of(tag: str) -> int | None:
    """The block id an IPC tag names (None: not an IPC tag, or malformed)."""
    if not tag.startswith(TAG):
        return None
    parts = tag.split(":", 4)  # ipc, cuda, index, block, rest
    return int(parts[3]) if len(parts) == 5 and parts[3].isdigit() else None


def _encode(value: list[Any]) -> str:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return base64.b64encode(packed).decode("ascii")


def _decode(text: str) -> list[Any]:
    value = msgpack.unpackb(base64.b64decode(text), raw=False)
    if not isinstance(value, list):
        raise ValueError("malformed CUDA IPC descriptor")
    return value


class IpcLinks:
    """One agent's CUDA IPC with each peer: probes, blocks out, mappings in.

    Safe from any thread (messages are pickled on callers' and pool threads): one lock
    guards the tables, and device calls run outside it.
    """

    def __init__(
        self,
        devices: Devices,
        same_host: Callable[[int], bool],
        probe: bool = True,
        stream_for: Callable[[int], CudaStream] | None = None,
        block_bytes: int = BLOCK_BYTES_PER_PEER,
    ) -> None:
        self.devices = devices
        self._same_host = same_host
        self._probe = probe  # False: cuda_transfer="ipc", every same-host peer, unprobed
        self._stream_for = stream_for or devices.current_stream
        self._lock = threading.Lock()
        self.blocks = ExportBlocks(devices, block_bytes)
        self._to: dict[int, str] = {}  # may we send this peer handles?
        self._answers: dict[int, int] = {}  # answers we owe peers (1: their probe opened)
        # Consumer side: the blocks of each producer mapped here (block id -> (its GPU
        # here, the mapping)), and the copies out of them not yet named back.
        self._mapped: dict[int, dict[int, tuple[int, Any]]] = {}
        self._in: dict[int, list[tuple[int, Event]]] = {}
        # Blocks of each producer given back unread (an item for a stream closed here):
        # named back in "u", so the producer does not count them as opened here.
        self._unread: dict[int, list[int]] = {}
        self.shared = 0  # messages' tensors sent, received, and named back (metrics)
        self.opened = 0
        self.released = 0
        self.named_back = 0  # blocks of peers named back here (what they count released)
        self.refused = 0  # tensors that could not go by handle (sent staged instead)

    # -- deciding --------------------------------------------------------------------------

    def usable(self, peer: int | None) -> bool:
        """Whether tensors for ``peer`` may go as handles now."""
        if peer is None or not self._same_host(peer):
            return False
        return not self._probe or self._to.get(peer) == _ON

    def state(self, peer: int) -> str:
        return self._to.get(peer, _UNKNOWN)

    def reaches(self, peer: int) -> bool:
        """Whether handles may ever go to or come from ``peer`` (it is on this host)."""
        return self._same_host(peer)

    # -- the header field --------------------------------------------------------------------

    def field_out(self, peer: int) -> dict[str, Any] | None:
        """What the next message to ``peer`` carries (None: nothing)."""
        field: dict[str, Any] = {}
        released = self._sweep(peer)
        with self._lock:
            answer = self._answers.pop(peer, None)
            unread = self._unread.pop(peer, None)
            offer = self._probe and self._same_host(peer) and peer not in self._to
            if offer:
                self._to[peer] = _OFFERED
        if answer is not None:
            field["a"] = answer
        if released:
            field["r"] = released
            with self._lock:
                self.named_back += len(released)
        if unread:
            field["u"] = unread
        if offer:
            made = self._offer(peer)
            if made is None:
                with self._lock:
                    self._to[peer] = _OFF
            else:
                field["o"] = made
        return field or None

    def field_in(self, peer: int, value: Any) -> None:
        """Take what a message from ``peer`` carried in the field (never raises)."""
        if not isinstance(value, dict):
            return
        offer, answer, released = value.get("o"), value.get("a"), value.get("r")
        unread = value.get("u")
        if offer is not None:
            opened = self._try_probe(peer, offer)
            with self._lock:
                self._answers[peer] = int(opened)
        if answer is not None:
            with self._lock:
                if self._to.get(peer) == _OFFERED:
                    self._to[peer] = _ON if answer == 1 else _OFF
        if isinstance(released, list) and released:
            self._released(peer, released)
        if isinstance(unread, list) and unread:
            self._released(peer, unread, opened=False)

    def _offer(self, peer: int) -> list[Any] | None:
        identity = self.devices.identity()
        if not identity.uuids or not identity.boot_id:
            return None
        try:
            host = _zeros(PROBE_BYTES)
            stream = self._stream_for(0)
            probe = self.devices.stage_in(host, 0, stream)
            # The probe's bytes are never read: its message need not wait for the fill
            # (and the block is not filled again before this fill is done: blocks.py).
            exported = self.export(peer, probe, PROBE_BYTES, "cuda:0", stream, count=False)
        except Exception:  # no device memory to share: the peer gets staged copies
            _log.debug("CUDA IPC probe for peer %s could not be made", peer, exc_info=True)
            return None
        if exported is None:
            return None
        return [identity.boot_id, exported[0]]

    def _try_probe(self, peer: int, offer: Any) -> bool:
        """Can we open what ``peer`` offered? Same boot, one of our GPUs, and it opens."""
        if not (isinstance(offer, list) and len(offer) == 2 and isinstance(offer[1], str)):
            return False
        boot_id, tag = offer
        if peer is None or not self._same_host(peer) or boot_id != self.devices.identity().boot_id:
            return False
        try:
            self.open(peer, tag)
        except Exception:  # OSError from the seam, or a malformed tag: staged it is
            _log.debug("CUDA IPC probe from peer %s did not open", peer, exc_info=True)
            return False
        return True

    # -- blocks out (producer) ----------------------------------------------------------------

    def export(
        self,
        peer: int,
        tensor: Any,
        nbytes: int,
        target: str,
        stream: CudaStream,
        count: bool = True,
    ) -> tuple[str, Event] | None:
        """Copy the first ``nbytes`` of ``tensor`` into a block exported to ``peer``, after
        the work queued on ``stream`` (the producer's); returns the segment's tag and the
        copy's event (the message must not leave before it completed), or None when no
        block is free within the bound (then the tensor goes staged).

        Raises:
            RuntimeError: the device would not export or fill a block.
        """
        device = self.devices.device_of(tensor)
        if device is None:
            raise ValueError("only device memory goes by handle")
        block = self.blocks.lend(peer, device, max(nbytes, 1))
        if block is None:
            return None
        try:
            filled = self.devices.fill_block(block.memory, tensor, nbytes, stream)
        except BaseException:
            self.blocks.returned(peer, [block.id])
            raise
        block.filled = filled
        if count:
            with self._lock:
                self.shared += 1
        if not block.named:
            block.named = _encode(list(block.desc))
        return f"{TAG}{target}:{block.id}:{nbytes}:{block.named}", filled

    def outstanding(self, peer: int) -> int:
        """Messages ``peer`` has not named back yet."""
        return self.blocks.lent(peer)

    def _released(self, peer: int, ids: list[Any], opened: bool = True) -> None:
        returned = self.blocks.returned(peer, ids, opened)
        with self._lock:
            self.released += returned

    def unsent(self, peer: int, tags: list[str]) -> None:
        """The frame carrying these tags to ``peer`` was never written: their blocks are
        free again (``lend`` still waits for their fills), none known to be opened there."""
        ids = [b for b in map(block_of, tags) if b is not None]
        if ids:
            self.blocks.returned(peer, ids, False)

    # -- blocks in (consumer) -------------------------------------------------------------------

    def open(self, peer: int, tag: str) -> tuple[int, Any]:
        """Copy out a tensor ``peer`` sent by handle; returns ``(device index, flat uint8
        tensor)``, this process's own; work queued afterwards on ``stream_for(device)``
        sees the producer's bytes.

        Raises:
            OSError: it cannot be opened here. ValueError: the tag is malformed.
        """
        body = tag[len(TAG) :]
        kind, index, block_id, nbytes, text = body.split(":", 4)
        if kind != "cuda" or not index.isdigit() or not block_id.isdigit():
            raise ValueError(f"malformed CUDA IPC tag {tag[:60]!r}")
        device, block, size = int(index), int(block_id), int(nbytes)
        with self._lock:
            mapped = self._mapped.get(peer, {}).get(block)
        if mapped is None:  # the first message in this block: map it (kept)
            mapped = self.devices.open_block(tuple(_decode(text)))
            with self._lock:
                self._mapped.setdefault(peer, {})[block] = mapped
        local, opened = mapped
        stream = self._stream_for(device)
        tensor, done = self.devices.copy_from_block(opened, local, size, device, stream)
        with self._lock:
            self._in.setdefault(peer, []).append((block, done))
            self.opened += 1
        return device, tensor

    def unread(self, peer: int, tags: list[str]) -> None:
        """A frame from ``peer`` carrying these tags will never be read here: their blocks
        are named back (in "u") with the next message, their bytes never copied out."""
        ids = [b for b in map(block_of, tags) if b is not None]
        if ids:
            with self._lock:
                self._unread.setdefault(peer, []).extend(ids)

    def owed(self, peer: int) -> list[Event]:
        """The copies out of ``peer``'s blocks not yet named back (their events)."""
        with self._lock:
            return [event for _, event in self._in.get(peer, ())]

    def _sweep(self, peer: int) -> list[int]:
        """Blocks of ``peer`` whose copies here are done (named back with the next message)."""
        done = self.devices.done
        with self._lock:
            copies = self._in.get(peer)
            if not copies:
                return []
            still = [(block, event) for block, event in copies if not done(event)]
            if len(still) == len(copies):
                return []
            self._in[peer] = still
            pending = {id(event) for _, event in still}
        return [block for block, event in copies if id(event) not in pending]

    # -- losing a peer -------------------------------------------------------------------------

    def on_peer_lost(self, peer: int) -> None:
        """``peer`` is gone for good: its blocks here are dropped, with the references it
        held on those it had opened, and collected; what we mapped of its blocks is
        unmapped (tensors copied out of them stay valid)."""
        with self._lock:
            mapped = self._mapped.pop(peer, {})
            self._in.pop(peer, None)
            self._unread.pop(peer, None)
            self._to.pop(peer, None)
            self._answers.pop(peer, None)
        blocks = self.blocks.drop_peer(peer)
        # Only those it named back are known to be opened there: dropping a reference
        # nobody took would count down another block's counter.
        for desc in [block.desc for block in blocks if block.confirmed]:
            try:
                self.devices.unshare(desc)
            except Exception:  # best effort: the driver may have reclaimed it already
                _log.debug("dropping a lost peer's CUDA IPC reference failed", exc_info=True)
        blocks.clear()  # the last references here: their memory goes back once collected
        self.devices.collect()
        if mapped:
            self.devices.close_blocks([opened for _, opened in mapped.values()])

    def stats(self) -> dict[str, int]:
        return {
            "cuda_ipc_shared": self.shared,
            "cuda_ipc_opened": self.opened,
            "cuda_ipc_released": self.released,
            "cuda_ipc_named_back": self.named_back,
            "cuda_ipc_refused": self.refused,
            **self.blocks.stats(),
        }


def _zeros(nbytes: int) -> Any:
    import torch

    return torch.zeros(nbytes, dtype=torch.uint8)
