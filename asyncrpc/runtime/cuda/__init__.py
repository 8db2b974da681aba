"""The CUDA path's device seam and the stream scheduling above it (layer L2.45).

``Devices`` is the seam (``CudaDevices`` on a GPU, ``FakeDevices`` on the CPU for tests);
``gate`` decides when a frame carrying CUDA tensors may leave and orders a receiver's
streams after it; ``staging`` moves tensors through pinned memory on side streams (in
chunks, into ``pinned``'s bounded pool), its frames held in the call pipeline's ready
stages by the gate; ``parts`` cuts a staged frame into parts ready chunk by chunk;
``maps`` is the device-map hook that gives each call its transfer policy (and ``items``
each stream's items theirs, one message per item); ``pool`` leases
streams and ``callee`` runs each request's function on leased pool streams made to wait
for its data.
"""

from __future__ import annotations

from asyncrpc.runtime.cuda.callee import CalleeStreams, RequestStreams
from asyncrpc.runtime.cuda.devices import Devices, GpuIdentity, devices_of
from asyncrpc.runtime.cuda.fake import FakeDevices, FakeTensor
from asyncrpc.runtime.cuda.gate import FrameEvents, SendGate, order_after, record_for
from asyncrpc.runtime.cuda.pool import StreamLease, StreamPool, StreamPoolExhaustedError

__all__ = [
    "CalleeStreams",
    "Devices",
    "FakeDevices",
    "FakeTensor",
    "FrameEvents",
    "GpuIdentity",
    "RequestStreams",
    "SendGate",
    "StreamLease",
    "StreamPool",
    "StreamPoolExhaustedError",
    "devices_of",
    "order_after",
    "record_for",
]
