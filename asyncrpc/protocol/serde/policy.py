"""Tensor policies: what one message does with its tensors, asked by the serializer (L1).

The serializer knows how to lay a tensor out as a segment; a policy decides the rest for
one message: which tensors must travel as segments whatever their size (distributed
autograd lists them by segment order on both sides), which tensors to note, how a tensor
that is not in CPU memory reaches the wire (a device map, and a copy that may finish later
on the GPU) and how a received segment reaches its device. The call pipeline's hooks
configure one policy per call; without one the serializer keeps its defaults (``DEFAULT``):
small CPU tensors ride inside the pickle, a CUDA tensor is refused, a received segment
tagged with a device is moved there with a plain copy.
"""

from __future__ import annotations

import torch

from asyncrpc.errors import SerializationError

__all__ = ["DEFAULT", "NoGrads", "TensorPolicy", "TrackGrads"]


class TensorPolicy:
    """Override what one message needs; each default is the serializer's own behaviour.

    Sender side, while pickling (on the thread that pickles): ``met`` for every tensor,
    ``exported`` for each tensor sent (a segment, or a small one inside the pickle),
    ``to_host`` for each segment not in CPU memory. Receiver side, while unpickling:
    ``to_device`` for each segment tagged with a device, then ``imported`` for each tensor
    rebuilt (from a segment or from the pickle). Both sides see the tensors in the same
    order: the order of their first appearance in the pickle.
    """

    __slots__ = ()

    def met(self, tensor: torch.Tensor) -> bool:
        """``tensor`` is being pickled (each time it is met). True sends it as a segment
        even when it is small enough to ride inside the pickle."""
        return False

    def exported(self, tensor: torch.Tensor) -> None:
        """``tensor`` was sent, as a segment or inside the pickle: once per tensor, in the
        order of its first appearance in the pickle."""

    def to_host(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """The bytes of ``tensor``, a tensor not in CPU memory, for the wire.

        Returns:
            ``(receiver's device, a CPU tensor with the same layout)``. The CPU tensor may
            still be filled by the device after this returns; the policy then holds the
            frame back until it is (the call pipeline's ``ready`` stage).

        Raises:
            SerializationError: the tensor cannot be sent (no device map names its device).
        """
        device = tensor.device
        if device.type != "cuda":
            raise SerializationError(
                f"cannot send a tensor on device {str(device)!r}: only CPU and CUDA tensors travel"
            )
        raise SerializationError(
            f"cannot send a tensor on device {str(device)!r}: the device map has no entry "
            "for it; move the tensor to CPU or map this device to one of the callee's"
        )

    def to_device(self, segment: torch.Tensor, device: str) -> torch.Tensor:
        """A received segment (a uint8 CPU tensor) on ``device``, its tag."""
        return segment.to(device)

    def imported(self, tensor: torch.Tensor) -> None:
        """``tensor`` was rebuilt, from a segment or from the pickle: once per tensor, in
        the order of its first appearance in the pickle (the sender's ``exported`` order)."""


DEFAULT = TensorPolicy()
"""The policy of a message nobody configured."""


class NoGrads(TensorPolicy):
    """Refuses tensors that require grad, and otherwise does what ``inner`` does: the
    policy of frames distributed autograd does not follow (stream items sent inside a
    context), so that a gradient never goes missing without an error."""

    __slots__ = ("inner", "what")

    def __init__(self, inner: TensorPolicy, what: str) -> None:
        self.inner = inner
        self.what = what

    def met(self, tensor: torch.Tensor) -> bool:
        if tensor.requires_grad:
            raise SerializationError(
                f"{self.what} cannot carry a tensor that requires grad inside a distributed "
                "autograd context: distributed autograd does not follow it, so its gradient "
                "would be lost; detach() it, or send it as a call's argument or result"
            )
        return self.inner.met(tensor)

    def exported(self, tensor: torch.Tensor) -> None:
        self.inner.exported(tensor)

    def to_host(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        return self.inner.to_host(tensor)

    def to_device(self, segment: torch.Tensor, device: str) -> torch.Tensor:
        return self.inner.to_device(segment, device)

    def imported(self, tensor: torch.Tensor) -> None:
        self.inner.imported(tensor)


class TrackGrads(TensorPolicy):
    """Lists the tensors requiring grad of one message after another, and otherwise does
    what ``inner`` does: the policy of stream items that distributed autograd follows.

    One stream's items are pickled one at a time (on the loop, or on one pool thread per
    burst), and unpickled one at a time on the loop, so one object serves them all:
    ``take`` hands over the list of the message just done and starts the next.
    """

    __slots__ = ("grads", "inner")

    def __init__(self, inner: TensorPolicy) -> None:
        self.inner = inner
        self.grads: list[torch.Tensor] = []

    def take(self) -> list[torch.Tensor]:
        """The tensors requiring grad of the message just pickled or unpickled, in the
        order both sides share; the list starts again for the next one."""
        grads, self.grads = self.grads, []
        return grads

    def met(self, tensor: torch.Tensor) -> bool:
        return self.inner.met(tensor)

    def exported(self, tensor: torch.Tensor) -> None:
        if tensor.requires_grad:
            self.grads.append(tensor)
        self.inner.exported(tensor)

    def to_host(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        return self.inner.to_host(tensor)

    def to_device(self, segment: torch.Tensor, device: str) -> torch.Tensor:
        return self.inner.to_device(segment, device)

    def imported(self, tensor: torch.Tensor) -> None:
        if tensor.requires_grad:
            self.grads.append(tensor)
        self.inner.imported(tensor)
