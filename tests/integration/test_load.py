"""Load on one worker: 512 concurrent callers, each with a payload of its own; every reply
is checked against what was sent, and the callee's memory does not grow with the rounds."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import asyncrpc
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(180)
CALLERS = 512


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS line")


async def _round(seed: int) -> tuple[int, int, int]:
    """512 concurrent calls; returns (ok, mismatched, failed)."""

    async def one(i: int) -> bool:
        payload = {"caller": i, "seed": seed, "t": torch.full((64 + i % 7,), float(i + seed))}
        back = await asyncrpc.call("w1", fns.echo, payload)
        return back["caller"] == i and back["seed"] == seed and torch.equal(back["t"], payload["t"])

    results = await asyncio.gather(*(one(i) for i in range(CALLERS)), return_exceptions=True)
    ok = sum(1 for r in results if r is True)
    mismatched = sum(1 for r in results if r is False)
    return ok, mismatched, len(results) - ok - mismatched


def test_load_512_concurrent_callers_nothing_lost_or_mixed(group: Group) -> None:
    pid = asyncrpc.rpc_sync("w1", fns.pid)
    assert pid == group.workers[0].pid
    asyncio.run(_round(0))  # warm-up: pools, buffers, connections
    before = _rss_kib(pid)
    tallies = [asyncio.run(_round(seed)) for seed in range(1, 6)]
    after = _rss_kib(pid)
    assert tallies == [(CALLERS, 0, 0)] * 5
    # Flat: five more rounds of 512 calls leave the callee's memory where it was (slack for
    # allocator noise; a leak of even one 300-byte payload per call would be 750 KiB).
    growth_kib = after - before
    print(f"w1 RSS {before} KiB -> {after} KiB ({growth_kib:+d} KiB) over 2560 calls")
    assert growth_kib < 16 * 1024, (before, after)
    assert os.path.exists(f"/proc/{pid}")
