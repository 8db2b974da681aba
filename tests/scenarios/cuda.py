"""CUDA tensors in stream items between two processes in a fake CUDA world (test layer):
rank 0 of {driver, w1}, both in the fake world of ``tests.integration.cuda_world``; w1 is
started by the test (with ``IPC_DIR`` set for ``cuda_ipc_items``: CUDA IPC on)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import asyncrpc
from tests.integration import cuda_world as cw
from tests.scenarios.common import Observations, report
from tests.scenarios.registry import scenario

N = 6


def _join(args: argparse.Namespace) -> None:
    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method, rpc_timeout=20.0, shutdown_timeout=10.0,
        device_maps={"w1": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}}, shared_memory=False,
        cuda_transfer="staged",
    )  # fmt: skip
    asyncrpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options)


def _reading(stream: Any) -> tuple[list[Any], list[int]]:
    """Read ``stream`` on streams of this thread's own: the items, and the waits each got."""
    mine = [cw.GPU.new_stream(0), cw.GPU.new_stream(1)]
    with cw.GPU.use_streams(mine):
        got = [cw._describe(tensor) for tensor in stream]
    return got, [len(s.items) for s in mine]


@scenario("cuda_items")
def cuda_items(args: argparse.Namespace) -> int:
    """A server stream, a client stream and a bidirectional stream of fake CUDA tensors."""
    cw.install()  # this process only: the other scenarios keep the real world
    _join(args)
    obs: Observations = {}
    obs["server"], obs["server_waits"] = _reading(asyncrpc.stream("w1", cw.items, N))
    obs["server_arrived"] = list(cw.GPU.arrived)
    obs["w1_after_server"] = asyncrpc.rpc_sync("w1", cw.observed)
    landed = len(cw.GPU.landed)
    obs["client"] = asyncrpc.rpc_sync("w1", cw.read, args=(asyncrpc.stream_arg(cw.items(N)),))
    obs["client_landed"] = cw.GPU.landed[landed:]
    obs["w1_after_client"] = asyncrpc.rpc_sync("w1", cw.observed)
    arrived, landed = len(cw.GPU.arrived), len(cw.GPU.landed)
    with asyncrpc.bidi("w1", cw.echo) as b:
        for i in range(N):
            b.send(cw.on(i % 2, torch.full((cw.NBYTES,), i, dtype=torch.uint8))).wait(10)
        b.done_sending()
        obs["bidi"], obs["bidi_waits"] = _reading(b)
    obs["bidi_landed"] = cw.GPU.landed[landed:]
    obs["bidi_arrived"] = cw.GPU.arrived[arrived:]
    asyncrpc.shutdown()
    report(obs)
    return 0


M = 12  # items of the IPC server stream


def _ipc_here() -> dict[str, int]:
    """This process's CUDA IPC counters, and the copies out of w1's blocks not named back."""
    ipc = cw.TRANSFERS[-1].ipc
    assert ipc is not None, "IPC_DIR is not set: CUDA IPC is off"
    return {**ipc.stats(), "owed": len(ipc.owed(asyncrpc.get_worker_info("w1").id))}


@scenario("cuda_ipc_items")
def cuda_ipc_items(args: argparse.Namespace) -> int:
    """Stream items by CUDA IPC handle between two processes of one (fake) host: a server
    stream whose blocks come back with credit and close frames only, and a stalled
    consumer's byte window."""
    cw.install()
    _join(args)
    obs: Observations = {}
    for _ in range(2):  # each side's probe offered, opened and answered, as calls do it
        asyncrpc.rpc_sync("w1", cw.observed)
    before = _ipc_here()
    stream = asyncrpc.rpc_stream("w1", cw.items, args=(M,), window=4)
    obs["server"], _ = _reading(stream)
    # No call to w1 from here: only the stream's frames may name its blocks back (the
    # last ones with a close frame once their copies out are done).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = _ipc_here()
        opened = now["cuda_ipc_opened"] - before["cuda_ipc_opened"]
        named = now["cuda_ipc_named_back"] - before["cuda_ipc_named_back"]
        if opened >= M and named >= opened and not now["owed"]:
            break  # (the probe's block may be named back after ``before`` too)
        time.sleep(0.05)
    obs["opened"], obs["named_back"], obs["owed"] = opened, named, now["owed"]
    obs["w1"] = asyncrpc.rpc_sync("w1", cw.ipc_stats, args=("driver",))
    # A stalled consumer: four items' bytes in the byte window, none read for a while.
    stalled = asyncrpc.rpc_stream("w1", cw.endless, window=128, window_bytes=4 * cw.NBYTES)
    time.sleep(1.0)
    obs["stalled"] = asyncrpc.rpc_sync("w1", cw.ipc_stats, args=("driver",))
    stalled.close()
    asyncrpc.shutdown()
    report(obs)
    return 0
