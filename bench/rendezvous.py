"""The rendezvous store's load as a group of N workers joins and shuts down (issue 38).

    .venv/bin/python -m bench.rendezvous --workers 100 1000 4000 [--spread 60] [--json out]

Real store clients run asyncrpc's own rendezvous code against a real ``TCPStore``, with no
torch import or RPC agent per worker: a worker is a thread with its own store connection
(and the second one its barrier waits take), many threads per process. Each worker
arrives at a random moment in ``[0, spread)`` seconds, as torch's imports spread the
arrivals of a real job, joins (``rendezvous._join_store``: claims, publication, waiting
for the others), then, after every worker has joined, calls shutdown at a random moment in
``[0, shutdown_spread)`` and passes the store barriers of a graceful shutdown in the order
``shutdown.py`` passes them (its waits in slices and its reads of who is missing too).

A barrier opens as in ``shutdown.py``: the worker whose arrival completes it tells rank 0
and its children, each worker told tells its two children (``group/tree.py``) as the
message comes, and a worker no message reached within a slice checks the store. The
``BarrierOpened`` messages travel over multiprocessing queues between the simulation's
processes, not over worker connections (a light worker has none;
tests/integration/test_barrier_news.py runs the real path); what a real connection costs
the store is counted, for workers that never talked before (the worst case): each reads
its tree neighbours' addresses in one ``multi_get`` at the first barrier, as
``shutdown.py`` does, and a message from any other worker (to rank 0, from the worker that
completed a barrier) costs the sender a ``get`` of the receiver's address and the receiver
one of the sender's, as a dial and a Hello do.

It reports, per size:

- store requests per worker to join (mean and max; opening the connection is not one),
  and per worker per barrier;
- the store's busiest second (requests from all workers, counted in 100 ms buckets);
- join: from the last worker's arrival until the last worker's join returned, and the
  part of it that is torch's TCPStore client connecting;
- shutdown: from the last worker's arrival at its first barrier until the last one left.

Reverse name lookups: torch's TCPStore looks up the peer's name on every connection,
the server on its one loop thread for each worker it accepts, each client for the store's
address. This host's resolver answers about 50 a second and stalls the rest 5 s, which
once behind made the store accept 5-10 connections a second (docs/scale.md). By default the store
here listens on an IPv4 socket of ours, so its lookups of 127.0.0.1 are answered from
/etc/hosts, and the workers preload ``numeric_names`` (one host's resolver asked by a
thousand workers is this simulation's artefact, not a job's): the join is then what a
job whose resolver answers at once would see. ``--store-listener torch --worker-lookups
resolver`` runs it as before.

The code of the moment is what runs: an earlier tree is measured by running its own
copy of this file there (this one passes barriers as ``shutdown.py`` does now).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import random
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_BUCKET_S = 0.1
_TAGS = ("calls-done", "users-released", "closing")
_FIRST_SLICE_S, _MAX_SLICE_S = 0.5, 2.0  # shutdown.py's


class Mailbox:
    """A simulated worker's received ``BarrierOpened`` messages: (root, dead) by tag, and
    the senders whose address it has not read yet (a Hello it has not looked up)."""

    def __init__(self) -> None:
        self.messages: dict[str, tuple[int, bool]] = {}
        self.senders: list[int] = []
        self._changed = threading.Condition()
        self._passed_on: set[str] = set()
        # Passes a barrier's first message on as it comes, as shutdown.py's relay does.
        self.relay: Any = None

    def put(self, tag: str, root: int, dead: bool, sender: int) -> None:
        with self._changed:
            first = tag not in self.messages
            self.messages.setdefault(tag, (root, dead))
            self.senders.append(sender)
            self._changed.notify_all()
        if first and not dead and self.relay is not None:
            self.relay(tag, root, dead)

    def get(self, tag: str) -> tuple[int, bool] | None:
        with self._changed:
            return self.messages.get(tag)

    def claim(self, tag: str) -> bool:
        """Whether this worker is to pass on ``tag``'s news now (the first time only)."""
        with self._changed:
            if tag in self._passed_on:
                return False
            self._passed_on.add(tag)
            return True

    def wait(self, tag: str, seconds: float) -> tuple[int, bool] | None:
        with self._changed:
            self._changed.wait_for(lambda: tag in self.messages, seconds)
            return self.messages.get(tag)

    def take_senders(self) -> list[int]:
        with self._changed:
            senders, self.senders = self.senders, []
            return senders


class Peers:
    """How a simulated worker sends ``BarrierOpened`` to another (same process: its
    mailbox; else the queue of the process that runs it), counting the address reads a
    new connection costs."""

    def __init__(self, rank: int, group: Any, post: Any) -> None:
        self.rank, self.group, self._post = rank, group, post
        self.known = {0, rank}  # rank 0's address comes with the start-up gate

    def meet(self, rank: int) -> None:
        if rank not in self.known:
            self.group.find(rank)  # one get: the dialler's look-up, or the Hello's
            self.known.add(rank)

    def meet_neighbours(self, size: int) -> None:
        """Read the tree neighbours' addresses in one request (shutdown.py does)."""
        from asyncrpc.runtime.group.tree import neighbours

        unknown = [r for r in neighbours(self.rank, 0, size) if r not in self.known]
        if unknown:
            self.group.find_all(unknown)
            self.known.update(unknown)

    def send(self, to: int, tag: str, root: int, dead: bool) -> None:
        self.meet(to)
        self._post(to, (tag, root, dead, self.rank))


class CountingStore:
    """A torch store whose every request is counted, per worker and per 100 ms bucket
    (the connection itself is counted by the worker)."""

    def __init__(self, inner: Any, counts: Counter[str], buckets: Counter[int], phase: list[str]):
        self._inner, self._counts, self._buckets, self._phase = inner, counts, buckets, phase

    def _count(self, name: str) -> None:
        self._counts[self._phase[0]] += 1
        self._counts[f"{self._phase[0]}:{name}"] += 1  # by kind of request too
        self._buckets[int(time.time() / _BUCKET_S)] += 1

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)

        def counted(*args: Any) -> Any:
            self._count(name)
            return method(*args)

        return counted


def _one_worker(
    rank: int, size: int, port: int, spread: float, start: float, out: dict[str, Any],
    buckets: Counter[int], joined: threading.Barrier, shutdown_spread: float,
    mailbox: Mailbox, post: Any,
) -> None:  # fmt: skip
    import datetime

    import torch.distributed as dist

    from asyncrpc.protocol.address import PeerAddress
    from asyncrpc.runtime.group import rendezvous
    from asyncrpc.runtime.group.rendezvous import StoreGroup

    rng = random.Random(rank)
    counts: Counter[str] = Counter()
    phase = ["join"]
    time.sleep(max(0.0, start + rng.uniform(0, spread) - time.time()))
    arrived = time.time()
    inner = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600), use_libuv=True)  # fmt: skip
    connected = time.time()
    store = CountingStore(inner, counts, buckets, phase)
    group = StoreGroup(store, rank, size)
    address = PeerAddress(f"w{rank}", rank, "127.0.0.1", 20000 + rank)
    rendezvous._join_store(group, address, None, 600.0)
    done = time.time()
    joined.wait()
    time.sleep(rng.uniform(0, shutdown_spread))
    phase[0] = "barriers"
    shut_arrived = time.time()
    peers = Peers(rank, group, post)
    mailbox.relay = functools.partial(_relay, peers, mailbox, size)
    ways = [_pass_barrier(group, tag, size, mailbox, peers) for tag in _TAGS]
    phase[0] = "left"
    group.arrive("left")
    if rank == 0:
        _wait_left(group, size)
    out[rank] = {
        "arrived": arrived, "connected": connected, "joined": done,
        "shutdown_arrived": shut_arrived, "left": time.time(), "counts": dict(counts),
        "ways": ways,
    }  # fmt: skip


def _pass_barrier(group: Any, tag: str, size: int, mailbox: Mailbox, peers: Peers) -> str:
    """Arrive at ``tag`` and wait until it opens, as shutdown.py does (nobody dies); how
    it opened: "completed", "told" or "store"."""
    group.arrive(tag)
    if tag == _TAGS[0]:
        peers.meet_neighbours(size)
    waiting, slice_s, probe_every = list(range(size)), _FIRST_SLICE_S, 1.0
    probe_at = time.monotonic() + probe_every
    try:
        while True:  # bounded: all arrive
            if tag in group.opened_here:
                _tell(peers, mailbox, tag, 0, group.opened_here[tag], size, first=True)
                return "completed"
            message = mailbox.wait(tag, slice_s)
            if message is not None:
                return _told_by(group, peers, mailbox, tag, message, size)
            if group.await_arrivals(tag, waiting, 0.0):
                message = mailbox.get(tag)  # it may have come during the request
                if message is not None:
                    return _told_by(group, peers, mailbox, tag, message, size)
                return _found_open(group, peers, mailbox, tag, size)
            if time.monotonic() > probe_at:  # who is missing, read now and then
                waiting = group.missing(tag, waiting)
                if not waiting and tag not in group.opened_here:
                    return _found_open(group, peers, mailbox, tag, size)
                probe_every = min(probe_every * 2, 8.0)
                probe_at = time.monotonic() + probe_every
                slice_s = _FIRST_SLICE_S
                continue
            slice_s = min(slice_s * 2, _MAX_SLICE_S)
    finally:
        for sender in mailbox.take_senders():  # the Hellos of new connections
            peers.meet(sender)


def _told_by(
    group: Any, peers: Peers, mailbox: Mailbox, tag: str, message: tuple[int, bool], size: int
) -> str:
    """Told by a peer: pass it on (done as it came, unless a rank was counted dead)."""
    if message[1]:  # a rank was counted dead: shutdown.py reads which
        group.lost_ranks()
    _tell(peers, mailbox, tag, *message, size)
    return "told"


def _found_open(group: Any, peers: Peers, mailbox: Mailbox, tag: str, size: int) -> str:
    """Found open in the store: read whom others found dead and tell the children."""
    _tell(peers, mailbox, tag, 0, bool(group.lost_ranks()), size)
    return "store"


def _relay(peers: Peers, mailbox: Mailbox, size: int, tag: str, root: int, dead: bool) -> None:
    """``Mailbox.relay``: pass news on as it comes, on the thread that delivered it. Only
    to workers whose address is known (read by ``meet_neighbours``): a look-up here would
    share the worker's store connection with its own thread; the worker's wait tells the
    others (this race, news before the neighbours' addresses, is rare)."""
    from asyncrpc.runtime.group.tree import recipients

    if all(rank in peers.known for rank in recipients(peers.rank, root, size, ())):
        _tell(peers, mailbox, tag, root, dead, size)


def _tell(
    peers: Peers, mailbox: Mailbox, tag: str, root: int, dead: bool, size: int,
    first: bool = False,
) -> None:  # fmt: skip
    """Tell the children, once per barrier; the worker that completed it tells the root
    too (shutdown.py's ``_tell``)."""
    from asyncrpc.runtime.group.tree import recipients

    if not mailbox.claim(tag):
        return
    told = recipients(peers.rank, root, size, ())
    if first and peers.rank != root:
        told = [root, *told]
    for rank in told:
        peers.send(rank, tag, root, dead)


def _wait_left(group: Any, size: int) -> None:
    """Rank 0's wait for every worker to leave (shutdown.py's ``_release_store``)."""
    waiting = group.missing("left")
    while waiting:  # bounded: all leave
        if group.await_arrivals("left", waiting, 1.0):
            return
        waiting = group.missing("left", waiting)


def _process(ranks: list[int], size: int, port: int, spread: float, shutdown_spread: float,
             ready: Any, when: Any, queue: Any, inboxes: list[Any], index: int,
             finished: Any) -> None:  # fmt: skip
    import torch.distributed  # noqa: F401  (imports done before the clock starts)

    from asyncrpc.runtime.group import rendezvous  # noqa: F401

    _more_descriptors()
    mailboxes = {r: Mailbox() for r in ranks}
    for inbox in inboxes:
        inbox.cancel_join_thread()  # exit without waiting for another process to read

    def post(to: int, message: tuple[str, int, bool, int]) -> None:
        if to in mailboxes:
            mailboxes[to].put(*message)
        else:
            inboxes[to % len(inboxes)].put((to, message))

    def route() -> None:  # messages from the other processes
        while True:  # bounded: the process ends (a daemon thread)
            to, message = inboxes[index].get()
            mailboxes[to].put(*message)

    threading.Thread(target=route, daemon=True).start()
    ready.wait()  # every process has imported: the driver has set the start
    start = when.value
    out: dict[int, Any] = {}
    buckets: Counter[int] = Counter()
    joined = threading.Barrier(len(ranks))
    work = (size, port, spread, start, out, buckets, joined, shutdown_spread)
    threads = [
        threading.Thread(target=_one_worker, args=(r, *work, mailboxes[r], post), daemon=True)
        for r in ranks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    queue.put((out, dict(buckets)))
    finished.wait(600)  # late messages for this process's workers are still read meanwhile


def _more_descriptors() -> None:
    """Raise the soft open-files limit (a worker does it at init: join.py): thousands of
    store connections end in the driver, which serves the store."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(
    size: int, spread: float, processes: int, shutdown_spread: float = 1.0,
    store_listener: str = "ipv4", worker_lookups: str = "numeric",
) -> dict[str, Any]:  # fmt: skip
    """One simulated group of ``size`` workers, arriving over ``spread`` seconds and
    calling shutdown over ``shutdown_spread``; the figures of its join and shutdown.

    ``store_listener`` "ipv4": the store accepts on an IPv4 socket of ours, so torch's
    reverse lookup of each worker's address (127.0.0.1) is answered from /etc/hosts;
    "torch": torch's own dual-stack socket, where a worker is ``::ffff:127.0.0.1`` and
    each accept waits on this host's resolver. ``worker_lookups`` "numeric": the worker
    processes preload ``numeric_names`` (their own lookup of the store's address costs
    nothing, as on a node of their own); "resolver": they ask this host's resolver.
    """
    _more_descriptors()
    server = _store_server(store_listener)
    preload = _numeric_names() if worker_lookups == "numeric" else None
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    ready = context.Barrier(processes + 1)
    when = context.Value("d", 0.0)
    parts = [list(range(size))[i::processes] for i in range(processes)]  # rank % processes
    inboxes = [context.Queue() for _ in parts]
    finished = context.Event()
    shared = (ready, when, queue, inboxes)
    procs = [
        context.Process(
            target=_process,
            args=(part, size, server.port, spread, shutdown_spread, *shared, index, finished),
        )
        for index, part in enumerate(parts)
    ]
    with _preloaded(preload):  # the spawned interpreters load it; this one does not
        for proc in procs:
            proc.start()
    when.value = time.time() + 0.5  # arrivals start once every process has imported
    ready.wait(timeout=600)
    if preload is not None:  # every worker process has loaded it by now
        shutil.rmtree(Path(preload).parent, ignore_errors=True)
    results: dict[int, Any] = {}
    buckets: Counter[int] = Counter()
    for _ in procs:  # bounded: one result per process
        out, counted = queue.get(timeout=3600)
        results.update(out)
        buckets.update(counted)
    finished.set()
    for proc in procs:
        proc.join(timeout=60)
    del server
    lookups = {
        "store_listener": store_listener,
        "worker_lookups": "numeric" if preload else "resolver",
    }
    return (
        _figures(size, spread, results, buckets) | {"shutdown_spread_s": shutdown_spread} | lookups
    )


def _store_server(listener: str) -> Any:
    """The store's server, on torch's own listening socket or on an IPv4 one of ours."""
    import datetime
    import socket

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=600)
    if listener == "torch":
        return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                             timeout=timeout, use_libuv=True)  # fmt: skip
    own = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    own.bind(("127.0.0.1", 0))
    own.listen(socket.SOMAXCONN)
    port = own.getsockname()[1]
    # The store owns the descriptor from here (its loop closes it with the server).
    fd = own.detach()
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timeout, use_libuv=True, master_listen_fd=fd)  # fmt: skip


def _numeric_names() -> str | None:
    from bench.numeric_names import build

    library = build()
    if library is None:
        print("no C compiler: the workers look names up through this host's resolver",
              file=sys.stderr)  # fmt: skip
        return None
    return str(library)


@contextlib.contextmanager
def _preloaded(library: str | None) -> Iterator[None]:
    """``LD_PRELOAD`` names ``library`` for the processes started meanwhile."""
    before = os.environ.get("LD_PRELOAD")
    if library is not None:
        os.environ["LD_PRELOAD"] = f"{library} {before}" if before else library
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def _figures(
    size: int, spread: float, results: dict[int, Any], buckets: Counter[int]
) -> dict[str, Any]:
    joins = [r["counts"].get("join", 0) for r in results.values()]
    barriers = [r["counts"].get("barriers", 0) / len(_TAGS) for r in results.values()]
    ways = Counter(way for r in results.values() for way in r["ways"])
    kinds: Counter[str] = Counter()
    for r in results.values():
        kinds.update({k[9:]: n for k, n in r["counts"].items() if k.startswith("barriers:")})
    per_second: Counter[int] = Counter()
    for bucket, n in buckets.items():
        per_second[int(bucket * _BUCKET_S)] += n
    return {
        "workers": size,
        "spread_s": spread,
        "join_requests_mean": sum(joins) / len(joins),
        "join_requests_max": max(joins),
        "barrier_requests_mean": sum(barriers) / len(barriers),
        "barrier_requests_max": max(barriers),
        "barriers_opened": dict(ways),  # per worker per barrier: how it learned
        # Per worker per barrier, by kind of request.
        "barrier_requests_by_kind": {
            k: round(n / len(results) / len(_TAGS), 3) for k, n in sorted(kinds.items())
        },
        "store_peak_per_s": max(per_second.values()),
        "store_requests_total": sum(buckets.values()),
        "join_after_last_arrival_s": max(r["joined"] for r in results.values())
        - max(r["arrived"] for r in results.values()),
        "connect_max_s": max(r["connected"] - r["arrived"] for r in results.values()),
        "join_after_last_connect_s": max(r["joined"] for r in results.values())
        - max(r["connected"] for r in results.values()),
        "shutdown_after_last_arrival_s": max(r["left"] for r in results.values())
        - max(r["shutdown_arrived"] for r in results.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--spread", type=float, default=60.0, help="arrivals over this (s)")
    parser.add_argument(
        "--shutdown-spread", type=float, default=1.0, help="shutdown() calls over this (s)"
    )
    parser.add_argument("--processes", type=int, default=4, help="processes of threads")
    parser.add_argument(
        "--store-listener", choices=("ipv4", "torch"), default="ipv4",
        help="ipv4: the store's reverse lookups of workers hit /etc/hosts; torch: its "
        "dual-stack socket, each accept waiting on this host's resolver",
    )  # fmt: skip
    parser.add_argument(
        "--worker-lookups", choices=("numeric", "resolver"), default="numeric",
        help="numeric: workers preload bench/numeric_names (no reverse DNS); resolver: "
        "they ask this host's resolver, all 1,000 of them",
    )  # fmt: skip
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    rows = []
    header = ("workers", "join req/worker (max)", "barrier req/worker (max)",
              "store peak req/s", "join after last arrival (s)", "of which connect (max s)",
              "join after last connect (s)", "shutdown (s)", "barriers opened",
              "barrier requests by kind")  # fmt: skip
    print(" | ".join(header))
    for size in args.workers:
        row = run(size, args.spread, min(args.processes, size), args.shutdown_spread,
                  args.store_listener, args.worker_lookups)  # fmt: skip
        rows.append(row)
        print(
            f"{size} | {row['join_requests_mean']:.1f} ({row['join_requests_max']}) | "
            f"{row['barrier_requests_mean']:.1f} ({row['barrier_requests_max']:.1f}) | "
            f"{row['store_peak_per_s']:,} | {row['join_after_last_arrival_s']:.2f} | "
            f"{row['connect_max_s']:.2f} | {row['join_after_last_connect_s']:.2f} | "
            f"{row['shutdown_after_last_arrival_s']:.2f} | {row['barriers_opened']} | "
            f"{row['barrier_requests_by_kind']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
