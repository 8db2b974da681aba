"""Run the programs each way and check every way prints the same result.

``python -m examples.torch_migration`` runs ``torch_rpc``, ``asyncrpc_version`` and
``async_version``, then the distributed autograd pair ``torch_autograd`` and
``asyncrpc_autograd``, as subprocesses (the torch ones are skipped when torch's RPC cannot
start here: it needs numpy).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from examples._launch import ROOT

PROGRAMS = (
    ("torch_rpc", "asyncrpc_version", "async_version"),
    ("torch_autograd", "asyncrpc_autograd"),
)


def run_version(name: str) -> str:
    """Run one version; return its ``result:`` line (empty when it printed none)."""
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", f"examples.torch_migration.{name}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    return next((line for line in out.splitlines() if line.startswith("result:")), "")


def main() -> int:
    """Print each version's result; exit 0 when, per program, all that ran agree."""
    agree = True
    for versions in PROGRAMS:
        results = {}
        for name in versions:
            if name.startswith("torch_") and importlib.util.find_spec("numpy") is None:
                print(f"{name:17s} skipped (torch.distributed.rpc needs numpy to start)")
                continue
            results[name] = run_version(name)
            print(f"{name:17s} {results[name]}", flush=True)
        agree = agree and len(set(results.values())) == 1 and "" not in results.values()
    print(f"all versions agree: {agree}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
