"""The CUDA path's device seam and the stream scheduling above it (layer L2).

``Devices`` is the seam (``CudaDevices`` on a GPU, ``FakeDevices`` on the CPU for tests);
``gate`` decides when a frame carrying CUDA tensors may leave and orders a receiver's
streams after it; ``staging`` moves tensors through pinned memory on side streams, its
frames held in the call pipeline's ready stages by the gate; ``maps`` is the device-map
hook that gives each call its transfer policy; ``pool`` leases streams (not used by the
staged transfer yet: a callee runs on its thread's current streams, made to wait).
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
