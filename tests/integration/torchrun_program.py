"""A program launched with ``torchrun --standalone --nproc-per-node 3`` (see docs/deployment.md).

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; ``init_rpc`` with its default
``env://`` rendezvous reads them, as ``torch.distributed.rpc`` does.
"""

from __future__ import annotations

import os

import asyncrpc


def whoami() -> str:
    return asyncrpc.get_worker_info().name


def main() -> None:
    rank = int(os.environ["RANK"])
    asyncrpc.init_rpc(f"worker{rank}")
    if rank == 0:
        names = [asyncrpc.rpc_sync(i.name, whoami) for i in asyncrpc.get_worker_infos()]
        total = sum(
            asyncrpc.rpc_sync(i.name, int, args=(i.id,)) for i in asyncrpc.get_worker_infos()
        )
        print(f"torchrun world: {names} sum {total + 3}", flush=True)
    asyncrpc.shutdown()


if __name__ == "__main__":
    main()
