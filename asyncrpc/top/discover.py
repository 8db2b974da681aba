"""Find a group's metrics endpoints through its rendezvous store (layer L4).

``--rendezvous tcp://HOST:PORT`` (or ``env://``: ``MASTER_ADDR``/``MASTER_PORT``) is the
``init_method`` the workers joined by. The view opens a client of that TCPStore, with a
bounded timeout, and reads the endpoints the workers published there
(``asyncrpc/runtime/group/endpoints.py``): the counter each refresh, new entries only
when it moved, so workers that join later appear on the next frame. torch is imported
here only: attached by endpoints, the view needs nothing beyond the standard library.
"""

from __future__ import annotations

import datetime
import importlib
import os
from typing import Any
from urllib.parse import urlparse

__all__ = ["Discovery", "StoreUnreachableError", "store_address"]

# Under torchrun's agent store, rank 0 hosts a fresh store per attempt and posts its
# address here (``runtime/group/stores.py``): the group's keys are in that one.
_ELASTIC_KEY = "asyncrpc/elastic_store"


class StoreUnreachableError(ConnectionError):
    """The rendezvous store did not answer: nothing listens at that address, or rank 0,
    whose process serves it, has not started or has gone.

    Attributes:
        address: the ``init_method`` given.
        reason: torch's first line of why.
    """

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(address, reason)
        self.address, self.reason = address, reason

    def __str__(self) -> str:
        return (
            f"no rendezvous store answered at {self.address} ({self.reason}); rank 0's "
            "process serves it: is the group running, and is that its init_method?"
        )


def store_address(init_method: str) -> tuple[str, int]:
    """The host and port of a ``tcp://`` or ``env://`` init method's TCPStore.

    Raises:
        ValueError: another scheme, no port, or ``env://`` without ``MASTER_ADDR`` and
            ``MASTER_PORT``.
    """
    if init_method.startswith("env://"):
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError("env:// needs MASTER_ADDR and MASTER_PORT set")
        return host, int(port)
    parts = urlparse(init_method)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"{init_method!r}: give tcp://HOST:PORT or env:// (a TCPStore)")
    return parts.hostname, parts.port


class Discovery:
    """The group's endpoints, read from its store at each ``urls()``.

    Args:
        init_method: ``tcp://HOST:PORT`` or ``env://``.
        timeout: seconds to connect and for each request.

    Raises:
        ValueError: see ``store_address``.
        StoreUnreachableError: no store answered within ``timeout``.
    """

    def __init__(self, init_method: str, timeout: float) -> None:
        from asyncrpc.runtime.group.endpoints import EndpointReader
        from asyncrpc.runtime.group.quiet import QuietStore

        self.init_method = init_method
        self.timeout = timeout
        store = QuietStore(self._connect(*store_address(init_method)))
        try:
            if store.check([_ELASTIC_KEY]):
                host, port = store.get(_ELASTIC_KEY).decode().split()
                store = QuietStore(self._connect(host, int(port)))
        except (RuntimeError, OSError) as exc:
            raise StoreUnreachableError(init_method, _first_line(exc)) from exc
        self._reader = EndpointReader(store)
        self.error = ""  # why the last read failed; "" when it did not

    def _connect(self, host: str, port: int) -> Any:
        from asyncrpc.runtime.group.quiet import quiet_cpp_logs

        tcp_store = importlib.import_module("torch.distributed").TCPStore

        try:
            with quiet_cpp_logs():  # each failed connect would log a C++ stack
                return tcp_store(
                    host, port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=self.timeout),
                )  # fmt: skip
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError, DistStoreError
            raise StoreUnreachableError(self.init_method, _first_line(exc)) from exc

    def urls(self, known: list[str]) -> list[str]:
        """The endpoints' URLs by rank; ``known`` again if the store stopped answering
        (rank 0 gone: the workers it knew are still worth watching; see ``error``)."""
        try:
            found = self._reader.read()
        except (RuntimeError, OSError) as exc:
            self.error = _first_line(exc)
            return known
        self.error = ""
        return [endpoint.url for endpoint in found]


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().partition("\n")[0] or type(exc).__name__
