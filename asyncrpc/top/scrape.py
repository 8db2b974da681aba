"""Scrape every endpoint at once, each within a timeout (layer L4, standard library only).

Each scrape runs on a thread of a small pool, so a worker that does not answer costs the
frame at most the timeout and never delays the others' figures. A stopped process still
completes the TCP handshake (its kernel does), then never replies: that is a read timeout,
HUNG. A refused connection means nothing listens there any more: DOWN.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from asyncrpc.top.board import DOWN, ERROR, HUNG, IDLE, Attempt
from asyncrpc.top.exposition import ExpositionError, parse
from asyncrpc.top.figures import extract

__all__ = ["Scraper", "normalize_url", "scrape"]


def normalize_url(target: str) -> str:
    """``PORT``, ``HOST:PORT`` or a URL, as the URL of a ``/metrics`` endpoint."""
    if target.isdigit():
        target = f"127.0.0.1:{target}"
    if "://" not in target:
        target = f"http://{target}"
    scheme, _, rest = target.partition("://")
    if "/" not in rest:
        target = f"{scheme}://{rest}/metrics"
    return target


def _timed_out(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", None)
    return isinstance(exc, TimeoutError | socket.timeout) or isinstance(reason, TimeoutError)


def scrape(url: str, timeout: float) -> Attempt:
    """Read and parse one endpoint.

    Args:
        url: the ``/metrics`` URL.
        timeout: seconds for the connection and for each read.

    Returns:
        The figures, or the state the failure shows (HUNG, DOWN or ERROR) and why.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            body = reply.read().decode("utf-8", "replace")
        figures = extract(parse(body))
        if not figures.worker:  # served before init_rpc or after shutdown: no figures
            return Attempt(time.monotonic(), state=IDLE, reason="no worker runs there")
        return Attempt(time.monotonic(), figures=figures)
    except ExpositionError as exc:
        return Attempt(time.monotonic(), state=ERROR, reason=f"not Prometheus text: {exc}")
    except urllib.error.HTTPError as exc:
        return Attempt(time.monotonic(), state=ERROR, reason=f"HTTP {exc.code}")
    except (OSError, urllib.error.URLError) as exc:
        if _timed_out(exc):
            return Attempt(time.monotonic(), state=HUNG, reason=f"no answer in {timeout:g}s")
        reason = getattr(exc, "reason", exc)
        return Attempt(time.monotonic(), state=DOWN, reason=str(reason) or type(exc).__name__)


class Scraper:
    """Scrapes endpoints in parallel, up to ``threads`` at once; ``close()`` ends its
    threads."""

    def __init__(self, threads: int, timeout: float) -> None:
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max(1, min(32, threads)), "asyncrpc-top")

    def scrape_all(self, urls: Sequence[str]) -> list[Attempt]:
        """One attempt per endpoint, in order; returns within about the timeout (more
        endpoints than threads: a multiple of it)."""
        futures = [self._pool.submit(scrape, url, self.timeout) for url in urls]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
