"""Imported by the workers of ``test_barrier_news.py`` (``--import``): the graceful
shutdown says how each barrier opened (a debug line per barrier), and a worker whose
``BARRIER_DIES`` is set kills itself with SIGKILL where it would call ``shutdown()``:
it joined, then dies before reaching any barrier."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import asyncrpc

logging.getLogger("asyncrpc.runtime.group.shutdown").setLevel(logging.DEBUG)


def _die(*args: Any, **kwargs: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("BARRIER_DIES") == "1":
    asyncrpc.shutdown = _die  # type: ignore[assignment]
