"""Opening the rendezvous store: torch's own TCPStore / FileStore through its rendezvous
handlers, or, under torchrun, a fresh store of each attempt (layer L2).

The keys asyncrpc keeps in the store, and what they mean, are ``rendezvous.py``'s.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import socket
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from asyncrpc.errors import InitError, MissingRankError
from asyncrpc.runtime.group.quiet import quiet_cpp_logs

__all__ = [
    "check_rank",
    "first_line",
    "hosts_store",
    "is_dynamic",
    "open_store",
    "this_host_id",
]


def this_host_id() -> str:
    """Boot id and host name: equal for processes of one running kernel and host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = "?"
    return f"{boot_id}/{socket.gethostname()}"


def is_dynamic(init_method: str, world_size: int | None) -> bool:
    """Whether a worker joining with these arguments makes (or joins) a dynamic group.

    No ``world_size`` means dynamic, as in torch, except with ``env://`` where ``WORLD_SIZE``
    is set: that size is read, and the group is static (asyncrpc's choice: a torchrun job
    gets the static group's all-together shutdown without passing ``world_size``).
    """
    if world_size is not None:
        return False
    return not (init_method.startswith("env://") and "WORLD_SIZE" in os.environ)


def check_rank(init_method: str, rank: int) -> None:
    """Refuse a missing rank the way torch's rendezvous does (a ``ValueError``, its words).

    Raises:
        MissingRankError: ``rank`` is negative and the init method cannot supply one.
    """
    if rank >= 0:
        return
    scheme = init_method.partition("://")[0]
    if scheme == "env":
        if not os.environ.get("RANK"):
            raise MissingRankError(
                "env:// rendezvous: environment variable RANK expected, but not set"
            )
    elif scheme in ("file", "tcp"):
        raise MissingRankError(f"{scheme}:// rendezvous: rank parameter missing")


def open_store(
    init_method: str, rank: int, world_size: int | None, timeout: float, host: str = ""
) -> Any:
    # Connecting to a store nobody serves yet logs each attempt in C++, with its stack:
    # the InitError raised says the same in one line (see quiet.py).
    with quiet_cpp_logs():
        return _open_store_loudly(init_method, rank, world_size, timeout, host)


def _open_store_loudly(
    init_method: str, rank: int, world_size: int | None, timeout: float, host: str
) -> Any:
    # The module (``torch.distributed.rendezvous`` the attribute is its function).
    torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")
    seconds = datetime.timedelta(seconds=timeout)
    try:
        if world_size is None and is_dynamic(init_method, world_size):
            # The public rendezvous() cannot say "no world size" (-1 there means "read it
            # from the URL or the environment"); torch's init_rpc opens the store of a
            # dynamic group through this helper, and so do we.
            opened = torch_rendezvous._rendezvous_helper(init_method, rank, None, timeout=seconds)
        elif init_method.startswith(("tcp://", "env://")):
            # A TCPStore given a world size makes its host (rank 0) wait in its constructor
            # until that many clients have connected: a member started with a smaller
            # world_size leaves it stuck there, unable to say why, until the timeout. Opened
            # with none (-1), the sizes are compared in the store instead (claim_size).
            url, rank, size = _sizeless_url(init_method, rank, world_size)
            if init_method.startswith("env://") and _under_agent_store():
                return _elastic_store(rank, host, timeout), rank, size
            opened = torch_rendezvous._rendezvous_helper(url, -1, -1, timeout=seconds)
            store, rank_out, _ = next(opened)
            return store, int(rank_out), size
        else:
            opened = torch_rendezvous.rendezvous(
                init_method,
                rank=rank,
                world_size=-1 if world_size is None else world_size,
                timeout=seconds,
            )
        store, rank_out, world_out = next(opened)
    except (ValueError, RuntimeError, OSError) as exc:
        hint = ""
        if hosts_store(init_method) and rank != 0 and isinstance(exc, (RuntimeError, OSError)):
            hint = " (rank 0's process serves this store: has it started, at that address?)"
        raise InitError(
            f"rendezvous through {init_method!r} failed: {first_line(exc)}{hint}"
        ) from exc
    return store, int(rank_out), int(world_out)


def _under_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


_ELASTIC_KEY = "asyncrpc/elastic_store"


def _elastic_store(rank: int, host: str, timeout: float) -> Any:
    # Under torchrun the store at MASTER_ADDR:MASTER_PORT is the launcher's own, and it
    # outlives a restart of the group: keys from the attempt before (claimed ranks,
    # addresses of dead workers) would be read as this attempt's. So rank 0 hosts a fresh
    # store for each attempt and posts its address in the launcher's (the address rank 0
    # advertises for RPC, which the others must reach anyway; MASTER_ADDR if that is a
    # wildcard); the others dial what is posted until it answers (a post from the attempt
    # before names a store that died with its rank 0). Bounded by the rendezvous timeout.
    tcp_store = importlib.import_module("torch.distributed").TCPStore
    seconds = datetime.timedelta(seconds=timeout)
    agent = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      is_master=False, timeout=seconds)  # fmt: skip
    if rank == 0:
        where = os.environ["MASTER_ADDR"] if host in ("", "0.0.0.0", "::") else host
        own = tcp_store(where, 0, is_master=True, timeout=seconds, wait_for_workers=False,
                        multi_tenant=True)  # fmt: skip
        agent.set(_ELASTIC_KEY, f"{where} {own.port}")
        return own
    deadline = time.monotonic() + timeout
    while True:  # bounded by the deadline
        where, port = agent.get(_ELASTIC_KEY).decode().split()
        if _answers(where, int(port)):  # a plain probe first: a dead store fails quietly
            with contextlib.suppress(RuntimeError, OSError):  # it died since the probe
                return tcp_store(where, int(port), is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=5.0))  # fmt: skip
        if time.monotonic() > deadline:
            raise InitError(f"no store of this attempt answered at {where}:{port} in time")
        time.sleep(0.2)


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _sizeless_url(init_method: str, rank: int, world_size: int | None) -> tuple[str, int, int]:
    """``init_method`` with this rank and world size -1 in its query, for torch's handler;
    the rank and the world size it stands for (argument, URL query, or ``env://``'s
    ``RANK`` and ``WORLD_SIZE``, in torch's order)."""
    parts = urlparse(init_method)
    query = dict(parse_qsl(parts.query))
    if rank < 0:
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
    if world_size is None:
        world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
    if world_size < 1:
        raise InitError(f"{init_method}: no world size (pass world_size or set WORLD_SIZE)")
    query.update(rank=str(rank), world_size="-1")
    return urlunparse(parts._replace(query=urlencode(query))), rank, world_size


def first_line(exc: BaseException) -> str:
    # torch's store errors carry a C++ stack after their first line: the cause stays
    # chained, the message keeps the sentence.
    return str(exc).strip().partition("\n")[0]


def hosts_store(init_method: str) -> bool:
    """Whether rank 0's process hosts the store (a TCPStore: ``tcp://`` and ``env://``)."""
    return init_method.startswith(("tcp://", "env://"))
