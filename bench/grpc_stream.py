"""gRPC's server streaming beside its unary calls, for ``bench/stream_cost.py``.

    /path/to/python-with-grpcio bench/grpc_stream.py [--items N] [--calls N] [--messages N]

Runs under a Python that has ``grpcio`` (not a dependency of asyncrpc; torch is not
needed). A server process (``grpc.aio``, generic handlers, bytes messages: no protobuf
code generation) on 127.0.0.1 and this client, both on asyncio: unary no-op calls one
after another (calls/s), a server stream of ``--items`` 8-byte messages (items/s) and one
of ``--messages`` 1 MiB messages (MB/s, one way). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

_SERVICE = "bench.Stream"
_MIB = 1 << 20


def _identity(data: bytes) -> bytes:
    return data


async def _unary(request: bytes, context: Any) -> bytes:
    return b""


async def _items(request: bytes, context: Any) -> AsyncIterator[bytes]:
    count, size = json.loads(request)
    message = b"x" * size
    for _ in range(count):
        yield message


async def _serve(port: int) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", 8 * _MIB),
            ("grpc.max_receive_message_length", 8 * _MIB),
        ]
    )
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _identity, _identity),
        "Items": grpc.unary_stream_rpc_method_handler(_items, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _server_main(port: int) -> None:
    asyncio.run(_serve(port))


async def _client(port: int, args: argparse.Namespace) -> dict[str, float]:
    options = [("grpc.max_receive_message_length", 8 * _MIB)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        await channel.channel_ready()
        unary = channel.unary_unary(f"/{_SERVICE}/Unary", _identity, _identity)
        items = channel.unary_stream(f"/{_SERVICE}/Items", _identity, _identity)
        for _ in range(200):
            await unary(b"")
        started = time.perf_counter()
        for _ in range(args.calls):
            await unary(b"")
        unary_per_s = args.calls / (time.perf_counter() - started)
        started, count = time.perf_counter(), 0
        async for _ in items(json.dumps([args.items, 8]).encode()):
            count += 1
        items_per_s = count / (time.perf_counter() - started)
        started, received = time.perf_counter(), 0
        async for message in items(json.dumps([args.messages, _MIB]).encode()):
            received += len(message)
        mb_per_s = received / (time.perf_counter() - started) / 1e6
    return {
        "unary_per_s": unary_per_s,
        "stream_items_per_s": items_per_s,
        "stream_mb_per_s": mb_per_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=3_000)
    parser.add_argument("--messages", type=int, default=200)
    args = parser.parse_args(argv)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=_server_main, args=(port,))
    server.start()
    try:
        figures = asyncio.run(_client(port, args))
    finally:
        server.kill()
        server.join(10)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
