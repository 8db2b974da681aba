"""``python -m asyncrpc.testing.worker``: a worker that serves until the group shuts down.

Used by the integration tests and the benchmark. ``--mode sync`` starts it with
``init_rpc`` (background loop thread); ``--mode async`` with ``init_rpc_async`` on an
asyncio loop, so both ways of running are exercised as callees.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import asyncrpc
from asyncrpc.errors import ShutdownError
from asyncrpc.runtime.threads.loopthread import new_event_loop


def _device_maps(specs: list[str]) -> dict[str, dict[str, str]] | None:
    maps: dict[str, dict[str, str]] = {}
    for spec in specs:
        callee, _, pairs = spec.partition("=")
        for pair in pairs.split(","):
            src, _, dst = pair.partition(":")
            maps.setdefault(callee, {})[f"cuda:{int(src)}"] = f"cuda:{int(dst)}"
    return maps or None


def _options(args: argparse.Namespace) -> asyncrpc.RpcBackendOptions:
    return asyncrpc.RpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=args.rpc_timeout,
        shutdown_timeout=args.shutdown_timeout,
        num_worker_threads=args.threads,
        max_worker_threads=args.max_threads,
        handshake_timeout=args.handshake_timeout,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        silent_link_timeout=args.silent_link_timeout,
        listen_host=args.listen_host,
        advertise_host=args.advertise_host,
        listen_port=args.listen_port,
        advertise_port=args.advertise_port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        shared_memory=bool(args.shared_memory),
        shm_arena_bytes=args.shm_arena_bytes,
        device_maps=_device_maps(args.device_map),
        cuda_transfer=args.cuda_transfer,
        sync_lanes=args.sync_lanes,
        busy_poll_us=args.busy_poll_us,
        **({} if args.max_frame_size is None else {"max_frame_size": args.max_frame_size}),
    )


def _run_sync(args: argparse.Namespace) -> int:
    asyncrpc.init_rpc(
        args.name, rank=args.rank, world_size=args.world_size, rpc_backend_options=_options(args)
    )
    try:
        asyncrpc.shutdown()
    except ShutdownError as exc:
        print(f"shutdown failed: {exc}", flush=True)
        return 3
    return 0


async def _run_async(args: argparse.Namespace) -> int:
    await asyncrpc.init_rpc_async(
        args.name, rank=args.rank, world_size=args.world_size, rpc_backend_options=_options(args)
    )
    try:
        await asyncrpc.shutdown_async()
    except ShutdownError as exc:
        print(f"shutdown failed: {exc}", flush=True)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--rpc-timeout", type=float, default=60.0)
    parser.add_argument("--shutdown-timeout", type=float, default=600.0)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--max-threads", type=int, default=512)
    parser.add_argument("--max-frame-size", type=int, default=None)
    parser.add_argument("--handshake-timeout", type=float, default=5.0)
    # The library's defaults, so that tests run workers as users do.
    defaults = asyncrpc.RpcBackendOptions()
    parser.add_argument("--heartbeat-interval", type=float, default=defaults.heartbeat_interval)
    parser.add_argument("--heartbeat-timeout", type=float, default=defaults.heartbeat_timeout)
    parser.add_argument("--silent-link-timeout", type=float, default=defaults.silent_link_timeout)
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--advertise-host", default=None)
    parser.add_argument("--listen-port", type=int, default=0)
    parser.add_argument("--advertise-port", type=int, default=None)
    parser.add_argument("--tls-cert", default=None)
    parser.add_argument("--tls-key", default=None)
    parser.add_argument("--tls-ca", default=None)
    parser.add_argument("--shared-memory", type=int, choices=(0, 1), default=1)
    parser.add_argument("--shm-arena-bytes", type=int, default=1 << 30)
    parser.add_argument("--sync-lanes", type=int, default=64, help="0 turns lanes off")
    parser.add_argument(
        "--busy-poll-us", type=int, default=0, help="lane polling before sleeping (µs)"
    )
    parser.add_argument(
        "--device-map",
        action="append",
        default=[],
        help="CALLEE=SRC:DST[,SRC:DST...] (CUDA indices), as device_maps[CALLEE]",
    )
    parser.add_argument(
        "--cuda-transfer", choices=("auto", "ipc", "staged", "host"), default="staged"
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        help="modules to import first (functions the group will call)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"[{args.name}] %(levelname)s %(message)s")
    for module in args.imports:
        importlib.import_module(module)
    print(f"worker {args.name} (rank {args.rank}) starting, mode={args.mode}", flush=True)
    if args.mode == "sync":
        code = _run_sync(args)
    else:
        loop = new_event_loop()
        try:
            code = loop.run_until_complete(_run_async(args))
        finally:
            loop.close()
    print(f"worker {args.name} exiting with {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
