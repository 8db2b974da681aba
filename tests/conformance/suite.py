"""torch's RPC test classes, rebuilt on asyncrpc: imported by the runner and every worker.

Importing this module rebinds torch's public RPC names (``torch.distributed.rpc.init_rpc``,
``rpc_sync``, ``RRef``...) to asyncrpc's, unless ``ASYNCRPC_CONFORMANCE_IMPL=torch``, then
imports torch's test modules from the installed wheel and builds one concrete class per
suite on torch's TensorPipe fixture, as torch's ``test_tensorpipe_agent.py`` does. torch's
private helpers, ``torch.futures`` and the profiler stay torch's own; distributed autograd's
public names (``context``, ``backward``, ``get_gradients``) and ``DistributedOptimizer``
become asyncrpc's too.

Worker processes come from a forkserver that has imported this module already: each test
starts its workers in milliseconds instead of re-importing torch in every spawned process.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

# torch reads its per-test timeout when common_distributed is imported (default 300 s).
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")

import torch.distributed.autograd as torch_dist_autograd
import torch.distributed.nn as torch_dist_nn
import torch.distributed.optim as torch_optim
import torch.distributed.rpc as torch_rpc
import torch.distributed.rpc.api as torch_rpc_api
import torch.distributed.rpc.functions as torch_rpc_functions

import asyncrpc
import asyncrpc.autograd
import asyncrpc.functions
import asyncrpc.optim

IMPL = os.environ.get("ASYNCRPC_CONFORMANCE_IMPL", "asyncrpc")

# The public names of torch.distributed.rpc a user's code calls, and asyncrpc's for each.
PUBLIC_NAMES: dict[str, Any] = {
    "init_rpc": asyncrpc.init_rpc,
    "shutdown": asyncrpc.shutdown,
    "rpc_sync": asyncrpc.rpc_sync,
    "rpc_async": asyncrpc.rpc_async,
    "remote": asyncrpc.remote,
    "RRef": asyncrpc.RRef,
    "WorkerInfo": asyncrpc.WorkerInfo,
    "get_worker_info": asyncrpc.get_worker_info,
    "get_rpc_timeout": asyncrpc.get_rpc_timeout,
}

# torch.distributed.autograd's public names; its private ones (_retrieve_context,
# _current_context, _get_debug_info...) stay torch's.
AUTOGRAD_NAMES = ("context", "backward", "get_gradients")


def _substitute() -> None:
    for name, value in PUBLIC_NAMES.items():
        setattr(torch_rpc, name, value)
        if hasattr(torch_rpc_api, name):
            setattr(torch_rpc_api, name, value)
    torch_rpc_functions.async_execution = asyncrpc.functions.async_execution
    for name in AUTOGRAD_NAMES:
        setattr(torch_dist_autograd, name, getattr(asyncrpc.autograd, name))
    torch_optim.DistributedOptimizer = asyncrpc.optim.DistributedOptimizer  # type: ignore[misc]
    # RemoteModule's suites import torch's name when they are imported.
    remote_module = _asyncrpc_remote_module()
    if remote_module is not None:
        torch_dist_nn.RemoteModule = remote_module  # type: ignore[misc]


def _asyncrpc_remote_module() -> Any:
    try:
        from asyncrpc.nn import RemoteModule
    except ImportError:  # not built yet: torch's own stays, and refuses asyncrpc's agent
        return None
    return RemoteModule


if IMPL == "asyncrpc":
    _substitute()  # before torch's test modules bind the names at their import
elif IMPL != "torch":
    raise SystemExit(f"ASYNCRPC_CONFORMANCE_IMPL must be 'asyncrpc' or 'torch', got {IMPL!r}")

# torch's test modules (rpc_utils is avoided: it imports the TorchScript suites, which
# cannot compile annotations such as RRef[Tensor] once RRef is asyncrpc's).
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed.ddp_under_dist_autograd_test import (  # noqa: E402
    DdpComparisonTest,
    DdpUnderDistAutogradTest,
)
from torch.testing._internal.distributed.nn.api.remote_module_test import (  # noqa: E402
    RemoteModuleTest,
    ThreeWorkersRemoteModuleTest,
)
from torch.testing._internal.distributed.rpc.dist_autograd_test import (  # noqa: E402
    DistAutogradTest,
)
from torch.testing._internal.distributed.rpc.dist_optimizer_test import (  # noqa: E402
    DistOptimizerTest,
)
from torch.testing._internal.distributed.rpc.examples.parameter_server_test import (  # noqa: E402
    ParameterServerTest,
)
from torch.testing._internal.distributed.rpc.examples.reinforcement_learning_rpc_test import (  # noqa: E402
    ReinforcementLearningRpcTest,
)
from torch.testing._internal.distributed.rpc.rpc_test import (  # noqa: E402
    RpcTest,
    TensorPipeAgentRpcTest,
)
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (  # noqa: E402
    TensorPipeRpcAgentTestFixture,
)

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload([__name__])


class _ForkserverHelper(MultiProcessTestCase):
    """torch's SpawnHelper, starting the workers from the preloaded forkserver."""

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(_CONTEXT.Process)


# Suites: the core ones (RpcTest and the examples built on it) and the extended ones.
CORE = (RpcTest, TensorPipeAgentRpcTest, ParameterServerTest, ReinforcementLearningRpcTest)
EXTENDED = (
    DistAutogradTest,
    DistOptimizerTest,
    DdpUnderDistAutogradTest,
    DdpComparisonTest,
    RemoteModuleTest,
    ThreeWorkersRemoteModuleTest,
)

SUITES: dict[str, type] = {}
for _suite in CORE + EXTENDED:
    _name = _suite.__name__
    _cls = type(_name, (_suite, TensorPipeRpcAgentTestFixture, _ForkserverHelper), {})
    _cls.__module__ = __name__  # the workers find the class here by name
    globals()[_name] = _cls
    SUITES[_name] = _cls
del _suite, _name, _cls

CORE_NAMES = tuple(cls.__name__ for cls in CORE)
EXTENDED_NAMES = tuple(cls.__name__ for cls in EXTENDED)
