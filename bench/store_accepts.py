"""How fast one torch TCPStore accepts a burst of clients (a bench script, issue 38).

    .venv/bin/python -m bench.store_accepts --clients 50 [--processes] [--listener ipv4]
        [--legacy]

N store clients connect at once (threads of this process, or forked processes) to one
TCPStore served here; it prints the median and longest connect and (threads) the
longest accept queue ``ss -ltn`` showed. ``--listener torch`` is torch's own
dual-stack socket (a local worker appears as ``::ffff:127.0.0.1``);
``ipv4`` an IPv4 socket of ours handed over as ``master_listen_fd`` (a worker is
``127.0.0.1``, which /etc/hosts names). ``--legacy`` is torch's older server
(``use_libuv=False``). docs/scale.md ("Why the store accepted slowly") has its figures.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import socket
import subprocess
import threading
import time
from typing import Any

_TIMEOUT = datetime.timedelta(seconds=120)


def _server(listener: str, libuv: bool) -> Any:
    import torch.distributed as dist

    if listener == "torch":
        return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                             timeout=_TIMEOUT, use_libuv=libuv)  # fmt: skip
    own = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    own.bind(("127.0.0.1", 0))
    own.listen(socket.SOMAXCONN)
    port = own.getsockname()[1]
    fd = own.detach()  # the store's from here
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=_TIMEOUT, use_libuv=libuv, master_listen_fd=fd)  # fmt: skip


def _connect(port: int, libuv: bool, start: float) -> tuple[float, Any]:
    """Wait for ``start``, connect; the seconds it took and the client (kept open)."""
    import torch.distributed as dist

    time.sleep(max(0.0, start - time.time()))
    began = time.perf_counter()
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                           timeout=_TIMEOUT, use_libuv=libuv)  # fmt: skip
    return time.perf_counter() - began, client


def _accept_queue(port: int) -> int:
    """The listening socket's accept queue now (``ss``'s Recv-Q), 0 if unreadable."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True,
                         text=True, timeout=10, check=False).stdout  # fmt: skip
    return max((int(line.split()[1]) for line in out.splitlines()), default=0)


def _threads(count: int, port: int, libuv: bool, start: float) -> tuple[list[float], int]:
    times: list[float] = []
    kept: list[Any] = []

    def one() -> None:
        took, client = _connect(port, libuv, start)
        times.append(took)
        kept.append(client)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    longest = 0
    while any(thread.is_alive() for thread in threads):  # bounded: clients time out
        longest = max(longest, _accept_queue(port))
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    return times, longest


def _processes(count: int, port: int, libuv: bool, start: float) -> list[float]:
    context = multiprocessing.get_context("fork")  # torch is imported already
    results = context.Queue()
    done = context.Event()

    def one() -> None:
        took, _client = _connect(port, libuv, start)
        results.put(took)
        done.wait(120)  # keep the connection until all have connected

    procs = [context.Process(target=one) for _ in range(count)]
    for proc in procs:
        proc.start()
    try:
        return [results.get(timeout=300) for _ in procs]
    finally:
        done.set()
        for proc in procs:
            proc.join(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--processes", action="store_true", help="forked, not threads")
    parser.add_argument("--listener", choices=("torch", "ipv4"), default="torch")
    parser.add_argument("--legacy", action="store_true", help="use_libuv=False")
    args = parser.parse_args(argv)
    libuv = not args.legacy
    server = _server(args.listener, libuv)
    start = time.time() + 0.3
    if args.processes:
        times, longest = _processes(args.clients, server.port, libuv, start), -1
    else:
        times, longest = _threads(args.clients, server.port, libuv, start)
    times.sort()
    queue = "-" if longest < 0 else str(longest)
    print(f"{args.clients} clients ({'processes' if args.processes else 'threads'}, "
          f"listener {args.listener}, libuv {libuv}) starting together: connect median "
          f"{times[len(times) // 2] * 1e3:.1f} ms, longest {times[-1] * 1e3:.1f} ms; "
          f"longest accept queue {queue}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
