"""The CUDA path's device seam and the stream scheduling above it (layer L2).

``Devices`` is the seam (``CudaDevices`` on a GPU, ``FakeDevices`` on the CPU for tests);
``gate`` decides when a frame carrying CUDA tensors may leave and orders a receiver's
streams after it; ``pool`` leases the streams a callee runs on. The agent's send pipeline
is to await ``SendGate.ready`` in its ready stage (not wired yet: see the GPU issue).
"""

from __future__ import annotations

from asyncrpc.runtime.cuda.devices import Devices, GpuIdentity, devices_of
from asyncrpc.runtime.cuda.fake import FakeDevices, FakeTensor
from asyncrpc.runtime.cuda.gate import FrameEvents, SendGate, order_after, record_for
from asyncrpc.runtime.cuda.pool import StreamLease, StreamPool, StreamPoolExhaustedError

__all__ = [
    "Devices",
    "FakeDevices",
    "FakeTensor",
    "FrameEvents",
    "GpuIdentity",
    "SendGate",
    "StreamLease",
    "StreamPool",
    "StreamPoolExhaustedError",
    "devices_of",
    "order_after",
    "record_for",
]
