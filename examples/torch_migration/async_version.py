"""The program of ``asyncrpc_version.py`` rewritten for asyncio: same output, no blocking.

``async with asyncrpc.worker(...)`` replaces init_rpc/shutdown; ``await asyncrpc.call``
replaces rpc_sync; futures and RRef proxies are awaited instead of waited on.
"""

import asyncio
import multiprocessing
import os
import socket

import torch

import asyncrpc


class Counter:
    def __init__(self, start):
        self.value = start

    def add(self, n):
        self.value += n
        return self.value


def square(x):
    return x * x


async def square_then_add(to, x, y):
    # An async def callee may await other calls without holding a thread.
    return await asyncrpc.call(to, square, x) + y


async def run(rank, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    async with asyncrpc.worker(f"worker{rank}", rank=rank, world_size=2):
        if rank == 0:
            a, b = await asyncio.gather(
                asyncrpc.call("worker1", torch.add, torch.ones(3), 2),
                asyncrpc.rpc_async("worker1", square, args=(torch.arange(3.0),)),
            )
            counter = asyncrpc.remote("worker1", Counter, args=(10,))
            await counter.rpc_async().add(5)
            c = await counter.rpc_async().add(1)
            d = await asyncrpc.call("worker1", square_then_add, "worker0", torch.tensor(3.0), 1)
            value = (await counter.to_here_future()).value
            print("result:", a.tolist(), b.tolist(), c, d.item(), value, flush=True)
            del counter


def start(rank, port):
    asyncio.run(run(rank, port))


def main():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=start, args=(rank, port)) for rank in range(2)]
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
