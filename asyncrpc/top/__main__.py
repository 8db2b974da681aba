"""``python -m asyncrpc.top``: a live view of a running group's workers (layer L4).

It reads the workers' ``/metrics`` endpoints (``asyncrpc.metrics.serve``): those named on
the command line, or every one the workers published in their rendezvous store
(``--rendezvous``, the ``init_method`` they joined by; read again each frame), and shows
each worker's calls/s, latency, in-flight calls, bytes/s, thread pool, loop lag, lost
peers and open streams. ``--once`` prints one frame and exits (2 when a worker is not
up); ``--plain`` prints a frame every interval without curses.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from asyncrpc.top.board import UP, Board
from asyncrpc.top.discover import Discovery, StoreUnreachableError
from asyncrpc.top.render import Line, frame, text
from asyncrpc.top.scrape import Scraper, normalize_url

__all__ = ["main"]


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrpc.top",
        description="A live view of asyncrpc workers, read from their /metrics endpoints.",
    )
    parser.add_argument(
        "endpoints", nargs="*", metavar="ENDPOINT",
        help="a worker's metrics endpoint: PORT (on 127.0.0.1), HOST:PORT or a URL; "
        "commas separate several in one argument",
    )  # fmt: skip
    parser.add_argument(
        "--rendezvous", metavar="INIT_METHOD",
        help="find every worker's endpoint in the group's rendezvous store: the "
        "init_method the workers joined by (tcp://HOST:PORT, or env:// with MASTER_ADDR "
        "and MASTER_PORT)",
    )  # fmt: skip
    parser.add_argument(
        "--store-timeout", type=float, default=5.0,
        help="seconds the rendezvous store has to answer (to connect, and each read)",
    )  # fmt: skip
    parser.add_argument("-n", "--interval", type=float, default=1.0, help="seconds per frame")
    parser.add_argument(
        "--timeout", type=float, default=1.0,
        help="seconds a worker has to answer before it shows as HUNG",
    )  # fmt: skip
    parser.add_argument(
        "--window", type=float, default=5.0, help="seconds of scrapes the rates and p50/p99 cover"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--once", action="store_true",
        help="print one frame (two scrapes an interval apart) and exit; 2 if a worker is not up",
    )  # fmt: skip
    mode.add_argument("--plain", action="store_true", help="print a frame every interval")
    args = parser.parse_args(argv)
    if args.interval <= 0 or args.timeout <= 0 or args.store_timeout <= 0:
        parser.error("--interval, --timeout and --store-timeout must be positive")
    if not args.endpoints and not args.rendezvous:
        parser.error("name the workers' endpoints, or the group's --rendezvous address")
    args.urls = [normalize_url(t) for arg in args.endpoints for t in arg.split(",") if t]
    return args


class _View:
    def __init__(self, args: argparse.Namespace, discovery: Discovery | None) -> None:
        self.named = list(args.urls)
        self.board = Board(self.named, window=args.window)
        self.discovery = discovery
        self.scraper = Scraper(32 if discovery else len(args.urls), timeout=args.timeout)
        self.interval = args.interval
        self.all_up = False

    def next_frame(self) -> list[Line]:
        notes: list[str] = []
        if self.discovery is not None:
            # Named endpoints first, then the store's: workers that joined since appear.
            found = self.discovery.urls(self.board.urls)
            self.board.watch(list(dict.fromkeys([*self.named, *found])))
            if self.discovery.error:
                notes.append(f"rendezvous store: {self.discovery.error} (showing the "
                             "workers found before)")  # fmt: skip
            elif not self.board.endpoints:
                notes.append("no worker has published a metrics endpoint there yet")
        self.board.record(self.scraper.scrape_all(self.board.urls))
        rows = self.board.rows(time.monotonic())
        self.all_up = bool(rows) and all(row.state == UP and not row.lost_by for row in rows)
        return frame(rows, interval=self.interval, notes=notes)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the view.

    Args:
        argv: the command line, without the program's name (``sys.argv[1:]`` when None).

    Returns:
        The exit status: 0; 2 when ``--once`` found a worker not up or lost by others (or
        none); 1 when the rendezvous store cannot be reached or its address is not one.
    """
    args = _arguments(argv)
    discovery = None
    if args.rendezvous:
        try:
            discovery = Discovery(args.rendezvous, args.store_timeout)
        except (ValueError, StoreUnreachableError) as exc:
            sys.stderr.write(f"asyncrpc.top: {exc}\n")
            return 1
    view = _View(args, discovery)
    try:
        if args.once:
            view.next_frame()  # the first scrape: the base of the rates
            time.sleep(args.interval)
            sys.stdout.write(text(view.next_frame()))
            return 0 if view.all_up else 2
        if args.plain or not sys.stdout.isatty():
            while True:
                started = time.monotonic()
                sys.stdout.write(text(view.next_frame()) + "\n")
                sys.stdout.flush()
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
        from asyncrpc.top.screen import run

        run(view.next_frame, args.interval)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        view.scraper.close()


if __name__ == "__main__":
    sys.exit(main())
