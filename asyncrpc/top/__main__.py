"""``python -m asyncrpc.top``: a live view of a running group's workers (layer L4).

It reads the workers' ``/metrics`` endpoints (``asyncrpc.metrics.serve``), every one
named on the command line, and shows each worker's calls/s, latency, in-flight calls,
bytes/s, thread pool, loop lag and lost peers. ``--once`` prints one frame and exits (2
when a worker is not up); ``--plain`` prints a frame every interval without curses.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from asyncrpc.top.board import UP, Board
from asyncrpc.top.render import Line, frame, text
from asyncrpc.top.scrape import Scraper, normalize_url

__all__ = ["main"]


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrpc.top",
        description="A live view of asyncrpc workers, read from their /metrics endpoints.",
    )
    parser.add_argument(
        "endpoints", nargs="+", metavar="ENDPOINT",
        help="a worker's metrics endpoint: PORT (on 127.0.0.1), HOST:PORT or a URL; "
        "commas separate several in one argument",
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
    if args.interval <= 0 or args.timeout <= 0:
        parser.error("--interval and --timeout must be positive")
    args.urls = [normalize_url(t) for arg in args.endpoints for t in arg.split(",") if t]
    return args


class _View:
    def __init__(self, args: argparse.Namespace) -> None:
        self.board = Board(args.urls, window=args.window)
        self.scraper = Scraper(args.urls, timeout=args.timeout)
        self.interval = args.interval
        self.all_up = False

    def next_frame(self) -> list[Line]:
        self.board.record(self.scraper.scrape_all())
        rows = self.board.rows(time.monotonic())
        self.all_up = all(row.state == UP and not row.lost_by for row in rows)
        return frame(rows, interval=self.interval)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the view.

    Args:
        argv: the command line, without the program's name (``sys.argv[1:]`` when None).

    Returns:
        The exit status: 0, or 2 when ``--once`` found a worker not up or lost by others.
    """
    args = _arguments(argv)
    view = _View(args)
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
