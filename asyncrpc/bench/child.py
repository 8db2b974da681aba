"""``python -m asyncrpc.bench.child``: one process of one system under test.

Part of ``asyncrpc.bench``. Roles: ``server`` (serves calls, or echoes for the floor),
``client`` and ``trainer`` (run measurements on command; like every RPC process they serve
calls too, so the trainer also owns dist-autograd's second layer). Commands arrive as JSON
lines on stdin; answers go out as JSON lines on the original stdout, prefixed with
``MARK``. Anything else the process prints (torch warnings included) goes to stderr, which
the orchestrator sends to a log file.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import io
import json
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TextIO

from asyncrpc.bench import cpu
from asyncrpc.bench.config import Item

if TYPE_CHECKING:
    import torch

__all__ = ["MARK", "main"]

MARK = "@@bench "
SERVER = "server"
_ROLE_NAMES = {"server": SERVER, "client": "client", "trainer": "trainer"}


class Channel:
    """The control channel to the orchestrator: JSON lines in on stdin, out on stdout."""

    def __init__(self) -> None:
        # Keep the real stdout for answers; point fd 1 (and print) at stderr instead.
        self._out: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def send(self, message: dict[str, Any]) -> None:
        self._out.write(MARK + json.dumps(message) + "\n")
        self._out.flush()

    @staticmethod
    def receive() -> dict[str, Any]:
        """The next command; end of input counts as ``quit``."""
        line = sys.stdin.readline()
        return json.loads(line) if line.strip() else {"op": "quit"}


def _tensors_for(items: list[Item], tensors: dict[int, torch.Tensor]) -> None:
    # Echo sources are allocated once, before timing starts, and reused.
    import torch

    for item in items:
        if item.kind == "echo" and item.size not in tensors:
            tensors[item.size] = torch.empty(item.size // 4, dtype=torch.float32)


# Every item is warmed up right before it is timed (``warmup`` seconds of the same loop,
# its figures dropped), in the same command: a user's loop has run many calls before the
# ones anybody would time, and no other system runs in between.


def _outcome(run: Callable[[float], Any], command: dict[str, Any]) -> dict[str, Any]:
    pids = command.get("pids", {})
    try:
        if command.get("warmup", 0.0) > 0:
            run(command["warmup"])
        before = cpu.snapshot(pids)
        stats = run(command["duration"])
    except Exception as exc:
        return _failure(exc)
    return _measured(stats, before, pids)


async def _outcome_async(
    run: Callable[[float], Awaitable[Any]], command: dict[str, Any]
) -> dict[str, Any]:
    pids = command.get("pids", {})
    try:
        if command.get("warmup", 0.0) > 0:
            await run(command["warmup"])
        before = cpu.snapshot(pids)
        stats = await run(command["duration"])
    except Exception as exc:
        return _failure(exc)
    return _measured(stats, before, pids)


def _failure(exc: Exception) -> dict[str, Any]:
    from asyncrpc.bench.measure import Unavailable

    if isinstance(exc, Unavailable):
        return {"unavailable": str(exc)}
    traceback.print_exception(exc)
    return {"error": f"{type(exc).__name__}: {exc}"}


def _measured(stats: Any, before: dict[str, int] | None, pids: dict[str, int]) -> dict[str, Any]:
    outcome = {"stats": stats}
    cpu.add_per_call(outcome, before, cpu.snapshot(pids))
    return outcome


# -- torch.distributed.rpc ------------------------------------------------------------------


def _patch_gather_without_numpy() -> None:
    # torch's init_rpc exchanges device maps with all_gather_object, whose
    # _tensor_to_object calls tensor.numpy(). Without numpy installed (asyncrpc does not
    # need it), decode the bytes without numpy instead; behaviour is otherwise unchanged.
    if importlib.util.find_spec("numpy") is not None:
        return
    import torch.distributed.distributed_c10d as c10d

    def tensor_to_object(tensor: torch.Tensor, tensor_size: int, group: Any) -> Any:
        data = bytes(tensor.cpu()[:tensor_size].tolist())
        return c10d._unpickler(io.BytesIO(data)).load()

    c10d._tensor_to_object = tensor_to_object


def _torch_options(args: argparse.Namespace) -> Any:
    from torch.distributed import rpc

    extra: dict[str, Any] = {}
    if args.system == "torch_tcp":
        extra = {"_transports": ["uv"], "_channels": ["basic"]}
    return rpc.TensorPipeRpcBackendOptions(
        init_method=args.init_method, rpc_timeout=args.rpc_timeout, **extra
    )


def _torch_main(args: argparse.Namespace, channel: Channel) -> int:
    _patch_gather_without_numpy()
    from torch.distributed import rpc

    from asyncrpc.bench.measure import run_item_blocking

    init: Any = rpc.init_rpc  # untyped in torch
    init(
        _ROLE_NAMES[args.role],
        rank=args.rank,
        world_size=args.world_size,
        rpc_backend_options=_torch_options(args),
    )
    channel.send({"ready": True, "pid": os.getpid()})
    tensors: dict[int, torch.Tensor] = {}
    while (command := channel.receive())["op"] != "quit":
        items = [Item.from_json(i) for i in command["items"]]
        _tensors_for(items, tensors)
        results = {}
        for item in items:
            run = functools.partial(
                run_item_blocking, rpc, args.system, item, SERVER, tensors=tensors
            )
            results[item.key] = _outcome(run, command)
        channel.send({"results": results})
    rpc.shutdown()
    channel.send({"bye": True})
    return 0


# -- asyncrpc -------------------------------------------------------------------------------


async def _asyncrpc_main(args: argparse.Namespace, channel: Channel) -> int:
    import asyncrpc
    from asyncrpc.bench.measure import run_item_await

    options = asyncrpc.RpcBackendOptions(
        init_method=args.init_method, rpc_timeout=args.rpc_timeout, shutdown_timeout=60.0
    )
    await asyncrpc.init_rpc_async(
        _ROLE_NAMES[args.role],
        rank=args.rank,
        world_size=args.world_size,
        rpc_backend_options=options,
    )
    channel.send({"ready": True, "pid": os.getpid()})
    loop = asyncio.get_running_loop()
    tensors: dict[int, torch.Tensor] = {}
    while (command := await loop.run_in_executor(None, channel.receive))["op"] != "quit":
        items = [Item.from_json(i) for i in command["items"]]
        _tensors_for(items, tensors)
        results = {}
        for item in items:
            run = functools.partial(run_item_await, item, SERVER, tensors=tensors)
            # The hand-offs of the timed part only: counted after the warm-up.
            counted = _Counted(run)
            outcome = await _outcome_async(counted, command)
            cpu.add_per_call(outcome, counted.before, await _handoffs(), "handoffs", 1.0)
            results[item.key] = outcome
        channel.send({"results": results})
    await asyncrpc.shutdown_async()
    channel.send({"bye": True})
    return 0


class _Counted:
    """An item's run that reads the hand-off counters just before the timed run (the one
    that is not the warm-up, which comes first when there is one)."""

    def __init__(self, run: Callable[..., Awaitable[Any]]) -> None:
        self._run = run
        self.before: dict[str, int] | None = None

    async def __call__(self, duration: float) -> Any:
        self.before = await _handoffs()
        return await self._run(duration=duration)


async def _handoffs() -> dict[str, int]:
    """Thread hand-offs so far in this client and in the server (asyncrpc's counters; the
    one call that reads the server's adds a few, spread over the item's calls)."""
    import asyncrpc
    from asyncrpc.runtime.threads import handoffs

    return {
        "client": handoffs.total(),
        "server": await asyncrpc.call(_ROLE_NAMES["server"], handoffs.total),
    }


# -- raw floor ------------------------------------------------------------------------------


async def _floor_main(args: argparse.Namespace, channel: Channel) -> int:
    from asyncrpc.bench import floor

    loop = asyncio.get_running_loop()
    if args.role == "server":
        server, port = await floor.serve(args.capacity, args.port)
        channel.send({"ready": True, "pid": os.getpid(), "port": port})
        await loop.run_in_executor(None, channel.receive)  # only quit comes
        server.close()
        channel.send({"bye": True})
        return 0
    client = await floor.connect(args.port, args.capacity)
    channel.send({"ready": True, "pid": os.getpid()})
    payloads: dict[int, memoryview] = {}
    while (command := await loop.run_in_executor(None, channel.receive))["op"] != "quit":
        results = {}
        for raw in command["items"]:
            item = Item.from_json(raw)
            run = functools.partial(floor.run_floor_item, client, item, payloads=payloads)
            results[item.key] = await _outcome_async(run, command)
        channel.send({"results": results})
    assert client.transport is not None
    client.transport.close()
    channel.send({"bye": True})
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--system", required=True, choices=("asyncrpc", "torch", "torch_tcp", "floor")
    )
    parser.add_argument("--role", required=True, choices=tuple(_ROLE_NAMES))
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--init-method", default="")
    parser.add_argument("--rpc-timeout", type=float, default=300.0)
    parser.add_argument("--port", type=int, default=0, help="floor client: the server's port")
    parser.add_argument("--capacity", type=int, default=1 << 20, help="floor: largest frame")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark process until the orchestrator says ``quit``."""
    args = _parse(argv)
    channel = Channel()
    if args.system in ("torch", "torch_tcp"):
        return _torch_main(args, channel)
    from asyncrpc.runtime.threads.loopthread import new_event_loop

    loop = new_event_loop()
    try:
        runner = _floor_main if args.system == "floor" else _asyncrpc_main
        return loop.run_until_complete(runner(args, channel))
    finally:
        loop.close()


if __name__ == "__main__":
    code = main()
    # Tearing down an interpreter that imported torch takes over a second; every result
    # has been sent and every connection closed, so skip it.
    sys.stderr.flush()
    os._exit(code)
