"""A worker group shared by the integration tests: this pytest process is rank 0
("driver"), w1 and w3 are synchronous workers and w2 runs with init_rpc_async."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch import nn

import asyncrpc
from asyncrpc.testing import WorkerProcess, free_port, spawn_worker, stop_workers

WORLD = 4


@dataclass
class Group:
    init_method: str
    workers: list[WorkerProcess]
    log_dir: Path


@pytest.fixture(scope="session")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    log_dir = tmp_path_factory.mktemp("workers")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    # The workers serve the whole session: their shutdown, started at once, waits for the
    # driver's, so its bound must outlast the slowest whole run (a loaded 2-core machine
    # took 13 minutes; at 10 the workers gave up and later tests found them gone).
    workers = [
        spawn_worker(f"w{r}", r, WORLD, init_method, log_dir=log_dir,
                     mode="async" if r == 2 else "sync", rpc_timeout=30.0,
                     shutdown_timeout=3600.0)
        for r in range(1, WORLD)
    ]  # fmt: skip
    try:
        asyncrpc.init_rpc(
            "driver",
            rank=0,
            world_size=WORLD,
            rpc_backend_options=asyncrpc.RpcBackendOptions(
                init_method=init_method, rpc_timeout=30.0, shutdown_timeout=60.0
            ),
        )
    except BaseException:
        stop_workers(workers, timeout=0)
        raise
    try:
        yield Group(init_method, workers, log_dir)
    finally:
        try:
            asyncrpc.shutdown(timeout=60.0)
        finally:
            codes = stop_workers(workers, timeout=30.0)
        logs = "\n".join(w.log() for w in workers)
        assert codes == [0] * len(workers), f"worker exit codes {codes}\n{logs}"


@pytest.fixture
def layers(group: Group) -> Iterator[Callable[[str, int, int, int], asyncrpc.RRef[nn.Module]]]:
    """Makes ``Linear(n_in, n_out)`` layers (seeded) on workers; afterwards, no worker
    holds an autograd context any more."""
    from tests.integration import autograd_fns as fns
    from tests.integration.autograd_support import contexts_settle_at

    made: list[asyncrpc.RRef[nn.Module]] = []

    def make(worker: str, seed: int, n_in: int, n_out: int) -> asyncrpc.RRef[nn.Module]:
        rref = asyncrpc.remote(worker, fns.make_linear, args=(seed, n_in, n_out))
        # Made before use: an async def on the owner (async_forward) cannot wait in
        # local_value() for a value still being made (it raises BlockingCallError).
        rref._get_future().wait()
        made.append(rref)
        return rref

    yield make
    del made[:]
    assert contexts_settle_at([0] * WORLD) == [0] * WORLD
