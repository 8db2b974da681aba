"""A worker raises its soft open-files limit to the hard one at init (issue 38: a full
mesh of a thousand workers needs about 1,000 descriptors per worker, over the usual soft
limit of 1,024). A real worker process, started with a low soft limit."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrpc.testing import free_port

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

_WORKER = """
import json, resource, sys
import asyncrpc
before = resource.getrlimit(resource.RLIMIT_NOFILE)
options = asyncrpc.RpcBackendOptions(init_method=sys.argv[1])
asyncrpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=options)
during = resource.getrlimit(resource.RLIMIT_NOFILE)
asyncrpc.shutdown()
print(json.dumps({"before": before, "during": during}))
"""


def test_init_rpc_raises_the_soft_open_files_limit_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")

    def lower_soft() -> None:  # in the child, before it runs Python
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=100, env=env, preexec_fn=lower_soft, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    limits = json.loads(done.stdout.strip().splitlines()[-1])
    assert limits["before"] == [256, hard]
    expected = hard if hard != resource.RLIM_INFINITY else max(256, 1 << 20)
    assert limits["during"] == [expected, hard]
