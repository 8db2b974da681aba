"""Parsing ``remote_device`` strings (``"worker1/cpu"``, ``"rank:1/cuda:0"``, ``"worker1"``) (L4).

Pure parsing: no RPC. The accepted forms and error texts follow
``torch.distributed._remote_device``, so a string that works for torch works here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RemoteDevice", "parse_remote_device"]


@dataclass(frozen=True, slots=True)
class RemoteDevice:
    """Where a remote module lives: a worker (by name or rank) and a device there."""

    on: str | int
    device: str


def _parse_error(text: str) -> ValueError:
    return ValueError(
        f"Could not parse remote_device: {text}. The valid format is "
        "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
    )


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True


def parse_remote_device(text: str) -> RemoteDevice:
    """Split ``text`` into the owner worker and the device the module is placed on.

    Args:
        text: ``"<workername>/<device>"``, ``"rank:<rank>/<device>"`` or ``"<workername>"``
            (the device is then ``cpu``).

    Returns:
        The worker (a name, or an ``int`` rank) and the device as ``str(torch.device)``.

    Raises:
        ValueError: the string has more than one ``/``, an empty worker, a malformed
            ``rank:`` prefix, or names a device but no worker.
        RuntimeError: torch rejects the device part (``torch.device``'s own error).
    """
    if not isinstance(text, str):
        raise TypeError(f"Invalid type for remote_device: {type(text)}")
    fields = text.split("/")
    if len(fields) == 2:
        worker, device = fields
    elif len(fields) == 1 and not _is_device(text):
        worker, device = text, "cpu"
    elif len(fields) == 1:
        raise ValueError(f"remote_device {text!r} names a device but no worker to place it on")
    else:
        raise _parse_error(text)
    if not worker:
        raise _parse_error(text)
    placed = str(torch.device(device))  # torch's RuntimeError for a bad device string
    parts = worker.split(":")
    if len(parts) == 1:
        return RemoteDevice(worker, placed)
    if len(parts) == 2 and parts[0] == "rank" and parts[1].isdigit():
        return RemoteDevice(int(parts[1]), placed)
    raise _parse_error(text)
