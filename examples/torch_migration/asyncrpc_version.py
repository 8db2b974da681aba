"""Two processes: calls, a remote object, an async_execution function (a classic RPC program).

``torch_rpc.py`` imports torch.distributed.rpc; ``asyncrpc_version.py`` is the same file
with ``import asyncrpc as rpc`` instead. ``async_version.py`` is the asyncio rewrite.
"""

# The two files differ by the import of `rpc` only, so that line stays as torch users write it.
# ruff: noqa: I001, PLR0402, RUF100
import multiprocessing
import os
import socket

import torch
import asyncrpc as rpc


class Counter:
    def __init__(self, start):
        self.value = start

    def add(self, n):
        self.value += n
        return self.value


def square(x):
    return x * x


@rpc.functions.async_execution
def square_then_add(to, x, y):
    return rpc.rpc_async(to, square, args=(x,)).then(lambda fut: fut.wait() + y)


def run(rank, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        a = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(3), 2))
        b = rpc.rpc_async("worker1", square, args=(torch.arange(3.0),)).wait()
        counter = rpc.remote("worker1", Counter, args=(10,))
        counter.rpc_sync().add(5)
        c = counter.rpc_sync().add(1)
        d = rpc.rpc_sync("worker1", square_then_add, args=("worker0", torch.tensor(3.0), 1))
        print("result:", a.tolist(), b.tolist(), c, d.item(), counter.to_here().value, flush=True)
        del counter
    rpc.shutdown()


def main():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run, args=(rank, port)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    return max(p.exitcode for p in procs)


if __name__ == "__main__":
    raise SystemExit(main())
