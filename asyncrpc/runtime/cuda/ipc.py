"""Same-host CUDA tensors by handle, no bytes on the wire (layer L2.45, above the device seam).

A tensor for a peer that can open this process's CUDA IPC handles travels as a handle in
its segment's tag (``ipc:<device>:<id>:<nbytes>:<descriptor>``) and an empty segment. The
producer's work is ordered by the interprocess event ``Devices.share`` records on the
producer's stream, so the frame leaves at once; the consumer opens the handle on a copy-in
stream (which waits for that event) and its users are ordered after it as for staged
copies.

Which peers: decided per peer and direction by a probe that rides on the device-map
hook's header field (``ci``), so no new wire message is needed: the first message to a
same-host peer (``group.same_host``: same boot and host id, Linux, no TLS) carries an
*offer* (this process's boot id and a small shared probe tensor); the peer answers in its
next message to us whether its boot id matched and opening the probe worked (its GPUs
are found by UUID, never by index). Until a yes, tensors go staged; after a no, always.
With ``cuda_transfer="ipc"`` same-host peers get handles without a probe. A worker never
sends itself a handle (a process cannot open its own).

Lifetime: the producer's memory stays allocated until the consumer's opened tensor is
freed (torch's shared ref counter; the fake counts the same way). The consumer tells the
producer which handles it dropped (``r`` in the same header field, on its next message to
it), so the producer knows which are still out. When a peer is lost for good, the producer
drops the references that peer still held (``Devices.unshare``) and collects the freed
blocks (``Devices.collect``, torch's ``ipc_collect``). Bound: a dead consumer's memory is
freed when its loss is detected (heartbeat timeout); a handle the consumer freed but had
not announced before dying is dropped twice (torch's counter then never reaches zero and
that block stays until the producer exits: at most the tensors freed in its last moments).
"""

from __future__ import annotations

import base64
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from asyncrpc.runtime.cuda.devices import CudaStream, Devices, IpcDescriptor

__all__ = ["FIELD", "TAG", "IpcLinks", "is_ipc_tag"]

_log = logging.getLogger(__name__)

FIELD = "ci"  # the header field: {"o": offer, "a": answer, "r": released ids}
TAG = "ipc:"
PROBE_BYTES = 16

_UNKNOWN, _OFFERED, _ON, _OFF = "unknown", "offered", "on", "off"


def is_ipc_tag(tag: str) -> bool:
    return tag.startswith(TAG)


def _encode(desc: IpcDescriptor) -> str:
    packed: bytes = msgpack.packb(list(desc), use_bin_type=True)
    return base64.b64encode(packed).decode("ascii")


def _decode(text: str) -> IpcDescriptor:
    return tuple(msgpack.unpackb(base64.b64decode(text), raw=False))


class IpcLinks:
    """One agent's CUDA IPC with each peer: probes, handles out, handles in.

    Safe from any thread (messages are pickled on callers' and pool threads): one lock
    guards the tables, and device calls (``share``, ``open``, ``collect``) run outside it.
    """

    def __init__(
        self,
        devices: Devices,
        same_host: Callable[[int], bool],
        probe: bool = True,
        stream_for: Callable[[int], CudaStream] | None = None,
    ) -> None:
        self.devices = devices
        self._same_host = same_host
        self._probe = probe  # False: cuda_transfer="ipc", every same-host peer, unprobed
        self._stream_for = stream_for or devices.current_stream
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._to: dict[int, str] = {}  # may we send this peer handles?
        self._probes: dict[int, Any] = {}  # the probe tensor offered to a peer, until answered
        self._answers: dict[int, int] = {}  # answers we owe peers (1: their probe opened)
        self._out: dict[int, dict[int, IpcDescriptor]] = {}  # peer -> id -> handle it holds
        self._in: dict[int, list[tuple[int, Callable[[], bool]]]] = {}  # producer -> opened
        self.shared = 0  # handles sent, opened, and given back by consumers (metrics)
        self.opened = 0
        self.released = 0
        self.refused = 0  # tensors that could not be shared (sent staged instead)

    # -- deciding --------------------------------------------------------------------------

    def usable(self, peer: int | None) -> bool:
        """Whether tensors for ``peer`` may go as handles now."""
        if peer is None or not self._same_host(peer):
            return False
        return not self._probe or self._to.get(peer) == _ON

    def state(self, peer: int) -> str:
        return self._to.get(peer, _UNKNOWN)

    # -- the header field --------------------------------------------------------------------

    def field_out(self, peer: int) -> dict[str, Any] | None:
        """What the next message to ``peer`` carries (None: nothing)."""
        field: dict[str, Any] = {}
        released = self._sweep(peer)
        with self._lock:
            answer = self._answers.pop(peer, None)
            offer = self._probe and self._same_host(peer) and peer not in self._to
            if offer:
                self._to[peer] = _OFFERED
        if answer is not None:
            field["a"] = answer
        if released:
            field["r"] = released
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
        if offer is not None:
            opened = self._try_probe(peer, offer)
            with self._lock:
                self._answers[peer] = int(opened)
        if answer is not None:
            with self._lock:
                if self._to.get(peer) == _OFFERED:
                    self._to[peer] = _ON if answer == 1 else _OFF
                probe = self._probes.pop(peer, None)
            del probe  # its handle was opened and dropped, or never will be
        if isinstance(released, list) and released:
            self._released(peer, released)

    def _offer(self, peer: int) -> list[Any] | None:
        identity = self.devices.identity()
        if not identity.uuids or not identity.boot_id:
            return None
        try:
            host = _zeros(PROBE_BYTES)
            stream = self._stream_for(0)
            probe = self.devices.stage_in(host, 0, stream)
            tag = self.export(peer, probe, PROBE_BYTES, "cuda:0", stream, count=False)
        except Exception:  # no device memory to share: the peer gets staged copies
            _log.debug("CUDA IPC probe for peer %s could not be made", peer, exc_info=True)
            return None
        with self._lock:
            self._probes[peer] = probe
        return [identity.boot_id, tag]

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

    # -- handles out (producer) ---------------------------------------------------------------

    def export(
        self,
        peer: int,
        tensor: Any,
        nbytes: int,
        target: str,
        stream: CudaStream,
        count: bool = True,
    ) -> str:
        """Share ``tensor`` (its first ``nbytes``) with ``peer``; returns the segment's tag.
        ``stream`` is the producer's: the consumer waits for the work queued on it."""
        desc = self.devices.share(tensor, stream)
        handle = next(self._ids)
        with self._lock:
            self._out.setdefault(peer, {})[handle] = desc
            if count:
                self.shared += 1
        return f"{TAG}{target}:{handle}:{nbytes}:{_encode(desc)}"

    def outstanding(self, peer: int) -> int:
        """Handles ``peer`` holds, as far as we know."""
        return len(self._out.get(peer, {}))

    def _released(self, peer: int, handles: list[Any]) -> None:
        with self._lock:
            out = self._out.get(peer, {})
            dropped = [out.pop(h, None) for h in handles if isinstance(h, int)]
            self.released += sum(1 for d in dropped if d is not None)
        self.devices.collect()  # their blocks may be free now (torch: ipc_collect)

    # -- handles in (consumer) ----------------------------------------------------------------

    def open(self, peer: int, tag: str) -> tuple[int, Any]:
        """Open a handle ``peer`` sent; returns ``(device index, flat uint8 tensor)``; work
        queued afterwards on ``stream_for(device)`` sees the producer's writes.

        Raises:
            OSError: it cannot be opened here. ValueError: the tag is malformed.
        """
        body = tag[len(TAG) :]
        kind, index, handle, nbytes, text = body.split(":", 4)
        if kind != "cuda" or not index.isdigit():
            raise ValueError(f"malformed CUDA IPC tag {tag[:60]!r}")
        device = int(index)
        tensor = self.devices.open(_decode(text), int(nbytes), device, self._stream_for(device))
        in_use = self.devices.in_use(tensor)
        with self._lock:
            self._in.setdefault(peer, []).append((int(handle), in_use))
            self.opened += 1
        return device, tensor

    def _sweep(self, peer: int) -> list[int]:
        """Handles from ``peer`` no longer in use here (told to it with the next message)."""
        with self._lock:
            held = self._in.get(peer)
            if not held:
                return []
            done = [handle for handle, in_use in held if not in_use()]
            if done:
                self._in[peer] = [(h, u) for h, u in held if u()]
        return done

    # -- losing a peer -------------------------------------------------------------------------

    def on_peer_lost(self, peer: int) -> None:
        """``peer`` is gone for good: the handles it held are dropped on its behalf and
        their memory collected; what we opened of its memory stays valid while we hold it."""
        with self._lock:
            out = self._out.pop(peer, {})
            self._in.pop(peer, None)
            self._to.pop(peer, None)
            self._answers.pop(peer, None)
            self._probes.pop(peer, None)
        for desc in out.values():
            try:
                self.devices.unshare(desc)
            except Exception:  # best effort: the driver may have reclaimed it already
                _log.debug("dropping a lost peer's CUDA IPC reference failed", exc_info=True)
        self.devices.collect()

    def stats(self) -> dict[str, int]:
        return {
            "cuda_ipc_shared": self.shared,
            "cuda_ipc_opened": self.opened,
            "cuda_ipc_released": self.released,
            "cuda_ipc_refused": self.refused,
        }


def _zeros(nbytes: int) -> Any:
    import torch

    return torch.zeros(nbytes, dtype=torch.uint8)
