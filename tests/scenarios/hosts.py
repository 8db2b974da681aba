"""Scenarios about where workers live (test layer): three hosts (network namespaces),
mutual TLS, and a big world on one host."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import asyncrpc
from tests.integration import remote_fns as fns
from tests.scenarios.common import Observations, attempt, options, report
from tests.scenarios.registry import option, scenario

# -- scenario: three hosts (network namespaces) ---------------------------------------------


@scenario("multi_host", option("--listen-host", default="127.0.0.1"))
def multi_host(args: argparse.Namespace) -> int:
    """Rank 0 ("h0") of {h0, h1, h2}, each on a host of its own: calls, RRefs held across
    hosts, a call between the two other hosts, and a graceful shutdown."""
    import torch

    opts = options(args)
    opts.listen_host = args.listen_host
    asyncrpc.init_rpc("h0", rank=0, world_size=3, rpc_backend_options=opts)
    obs: Observations = {}
    obs["h1_add"] = attempt(lambda: asyncrpc.rpc_sync("h1", fns.add, args=(2, 3)))
    obs["h2_whoami"] = attempt(lambda: asyncrpc.rpc_sync("h2", fns.whoami))
    holder = [asyncrpc.remote("h2", torch.ones, args=(4,))]
    obs["rref_to_here"] = attempt(lambda: holder[0].to_here().sum().item())
    # h1 fetches the RRef owned by h2: a connection between the two other hosts.
    obs["h1_fetches_from_h2"] = attempt(
        lambda: asyncrpc.rpc_sync("h1", fns.rref_sum, args=(holder[0],))
    )
    infos = asyncrpc.get_worker_infos()
    obs["peers"] = {i.name: asyncrpc.rpc_sync(i.name, fns.whoami) for i in infos}
    holder.clear()  # released before the shutdown, which checks for leaks
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=30.0))
    report(obs)
    return 0


# -- scenario: mutual TLS -------------------------------------------------------------------


@scenario("tls", option("--tls-dir", required=True))
def tls(args: argparse.Namespace) -> int:
    """Rank 0 ("t0") of {t0, t1}, mutual TLS with the certificates in ``--tls-dir``."""
    import torch

    opts = options(args)
    tls_dir = Path(args.tls_dir)
    opts.tls_cert, opts.tls_key = str(tls_dir / "worker.pem"), str(tls_dir / "worker.key")
    opts.tls_ca = str(tls_dir / "ca.pem")
    asyncrpc.init_rpc("t0", rank=0, world_size=2, rpc_backend_options=opts)
    big = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    obs: Observations = {
        "add": attempt(lambda: asyncrpc.rpc_sync("t1", fns.add, args=(2, 3))),
        "echo_ok": attempt(
            lambda: bool(torch.equal(asyncrpc.rpc_sync("t1", fns.echo, args=(big,)), big))
        ),
        "t1_address": list(_address_of(1)),
    }
    print("READY " + json.dumps(obs["t1_address"]), flush=True)
    obs["stdin"] = sys.stdin.readline().strip()  # the test has poked t1 meanwhile
    obs["still_serves"] = attempt(lambda: asyncrpc.rpc_sync("t1", fns.add, args=(1, 1)))
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=10.0))
    report(obs)
    return 0


def _address_of(rank: int) -> tuple[str, int]:
    from tests.integration.rawpeer import published_address

    address = published_address(rank)
    return address.host, address.port


# -- scenario: a big world on one host -----------------------------------------------------


@scenario("big_world")
def big_world(args: argparse.Namespace) -> int:
    """Rank 0 of ``--world-size`` workers named b0..bN: every worker calls every other
    once (all pairs, both ways, concurrently), then a graceful shutdown."""
    size = args.world_size
    started = time.monotonic()
    asyncrpc.init_rpc("b0", rank=0, world_size=size, rpc_backend_options=options(args))
    obs: Observations = {"init_s": time.monotonic() - started}
    names = [f"b{r}" for r in range(size)]
    started = time.monotonic()
    answered = [asyncrpc.rpc_async(n, fns.call_everyone, args=(names,)) for n in names[1:]]
    answered.append(asyncrpc.rpc_async("b0", fns.call_everyone, args=(names,)))
    obs["answers"] = attempt(lambda: asyncrpc.wait_all(answered))
    obs["calls_s"] = time.monotonic() - started
    started = time.monotonic()
    obs["shutdown"] = attempt(lambda: asyncrpc.shutdown(timeout=120.0))
    obs["shutdown_s"] = time.monotonic() - started
    report(obs)
    return 0
