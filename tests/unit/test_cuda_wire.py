"""A tensor sent by CUDA IPC handle crosses the serializer and the frame codec as an empty
segment whose tag names the handle, and is rebuilt from what ``to_device`` opens with its
own shape, strides and dtype. No GPU: one marked tensor says it is not in CPU memory and
stands for a CUDA tensor."""

from __future__ import annotations

from typing import Any

import torch

from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.serde.policy import TensorPolicy
from asyncrpc.protocol.wire import FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import Reply

TAG = "ipc:cuda:0:7:96:aGFuZGxl"


class Share(TensorPolicy):
    def to_host(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        return TAG, tensor  # left on its device: by handle


class Open(TensorPolicy):
    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.tags: list[tuple[int, str]] = []

    def to_device(self, segment: torch.Tensor, device: str) -> Any:
        self.tags.append((segment.numel(), device))
        return self.memory  # what opening the handle gives: the span's bytes, flat


def test_a_tensor_by_handle_travels_as_an_empty_segment_and_is_rebuilt_whole(
    on_device: set[int],
) -> None:
    source = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # strided: 6 x 4
    sent = source.detach()
    on_device.add(id(sent))
    payload, segments, _, _ = Serializer().dumps({"x": sent}, policy=Share())
    assert [(len(view), tag) for view, tag in segments] == [(0, TAG)]
    (frame,) = FrameDecoder().feed(
        b"".join(bytes(p) for p in encode_frame(Reply(1).to_fields(), payload, segments))
    )
    opened = Open(source.as_strided((24,), (1,)).view(torch.uint8).clone())
    received = Serializer().loads(frame.payload, frame.segments, policy=opened)["x"]
    assert opened.tags == [(0, TAG)]
    assert received.shape == (6, 4)
    assert received.stride() == source.stride()
    assert torch.equal(received, source)
