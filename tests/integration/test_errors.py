"""Typed errors across real processes: remote exceptions, timeouts, bad input."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Callable

import pytest
import torch

import asyncrpc
from asyncrpc.errors import (
    FunctionNotFoundError,
    RemoteCallError,
    RpcTimeoutError,
    SerializationError,
    UnknownWorkerError,
)
from asyncrpc.runtime.current import current_agent
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)


def test_remote_key_error_keeps_its_type_and_args(group: Group) -> None:
    with pytest.raises(KeyError) as info:
        asyncrpc.rpc_sync("w1", fns.raise_key_error, args=("missing-key",))
    exc = info.value
    assert type(exc).__bases__ == (KeyError, RemoteCallError)
    assert exc.args == ("missing-key",)
    assert exc.remote_worker == "w1"  # type: ignore[attr-defined]
    assert "raise_key_error" in exc.remote_traceback  # type: ignore[attr-defined]
    assert any("w1" in note for note in exc.__notes__)


def test_remote_os_error_keeps_errno(group: Group) -> None:
    with pytest.raises(OSError, match="input/output") as info:
        asyncrpc.rpc_sync("w3", fns.raise_os_error)
    assert isinstance(info.value, RuntimeError)
    assert type(info.value).__bases__ == (OSError, RemoteCallError)
    assert info.value.errno == 5


def _torch_style(call: Callable[[], object]) -> RuntimeError:
    """What a handler written for torch.distributed.rpc catches."""
    try:
        call()
    except RuntimeError as caught:
        return caught
    raise AssertionError("no RuntimeError raised")


@pytest.mark.parametrize(
    "how",
    ["rpc_sync", "rpc_async", "await", "remote", "remote_to_self", "then"],
)
def test_remote_errors_are_runtime_errors_of_their_own_type(group: Group, how: str) -> None:
    """torch-style ``except RuntimeError`` and asyncio-style ``except KeyError`` both catch
    a remote KeyError, however the call was made; the remote traceback is kept."""
    args = ("missing",)
    calls: dict[str, Callable[[], object]] = {
        "rpc_sync": lambda: asyncrpc.rpc_sync("w1", fns.raise_key_error, args=args),
        "rpc_async": lambda: asyncrpc.rpc_async("w2", fns.raise_key_error, args=args).wait(),
        "await": lambda: asyncio.run(asyncrpc.call("w3", fns.raise_key_error, *args)),
        "remote": lambda: asyncrpc.remote("w1", fns.raise_key_error, args=args).to_here(),
        "remote_to_self": lambda: asyncrpc.remote(
            "driver", fns.raise_key_error, args=args
        ).to_here(),
        "then": lambda: (
            asyncrpc.rpc_async("w1", fns.raise_key_error, args=args)
            .then(lambda done: done.wait())
            .wait()
        ),
    }
    caught = _torch_style(calls[how])
    assert isinstance(caught, KeyError)
    assert caught.args == args
    # Where it failed: the remote traceback (rpc) or a note (the value of an RRef).
    where = getattr(caught, "remote_traceback", "") + "".join(getattr(caught, "__notes__", []))
    assert "in raise_key_error\n    raise KeyError(key)" in where


def test_a_users_exception_class_is_a_runtime_error_too(group: Group) -> None:
    caught = _torch_style(lambda: asyncrpc.rpc_sync("w2", fns.raise_custom, args=("boom",)))
    assert isinstance(caught, fns.CustomError)
    assert caught.args == ("boom",)
    assert "boom" in str(caught)


def test_users_own_exception_class_comes_back(group: Group) -> None:
    with pytest.raises(fns.CustomError) as info:
        asyncrpc.rpc_sync("w2", fns.raise_custom, args=("boom",))
    assert info.value.args == ("boom",)
    assert info.value.remote_worker == "w2"  # type: ignore[attr-defined]


def test_callee_prints_what_a_function_raised_on_its_stderr(group: Group) -> None:
    with pytest.raises(fns.CustomError):
        asyncrpc.rpc_sync("w1", fns.raise_custom, args=("printed-on-w1",))
    log = group.workers[0].log()  # w1's stderr, flushed before its error reply left
    assert "On worker 'w1', tests.integration.remote_fns.raise_custom called by 'driver'" in log
    assert "CustomError: printed-on-w1" in log
    assert "Traceback (most recent call last)" in log


def test_print_errors_writes_to_the_stderr_of_the_moment_and_can_be_off(
    group: Group, capsys: pytest.CaptureFixture[str]
) -> None:
    # The driver calling itself: its dispatcher prints to sys.stderr as replaced by pytest.
    with pytest.raises(fns.CustomError):
        asyncrpc.rpc_sync("driver", fns.raise_custom, args=("printed-here",))
    assert "CustomError: printed-here" in capsys.readouterr().err
    dispatcher = current_agent().dispatcher
    dispatcher._print_errors = False  # what print_errors=False in the options sets
    try:
        with pytest.raises(fns.CustomError):
            asyncrpc.rpc_sync("driver", fns.raise_custom, args=("not-printed",))
    finally:
        dispatcher._print_errors = True
    assert "not-printed" not in capsys.readouterr().err


def test_builtin_op_with_bad_arguments_is_a_type_error_and_torchs_runtime_error(
    group: Group,
) -> None:
    with pytest.raises(asyncrpc.OperatorArgumentsError) as info:
        asyncrpc.rpc_sync("w3", torch.add, args=())
    assert isinstance(info.value, TypeError)  # as the same call raises locally
    assert isinstance(info.value, RuntimeError)  # as torch's RPC raises it
    assert "failed to match any schema" in str(info.value)
    assert "add() received an invalid combination of arguments" in str(info.value)
    # Ops that take their arguments, and errors that are not about them, are untouched.
    assert asyncrpc.rpc_sync("w3", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
    with pytest.raises(RuntimeError) as shapes:
        asyncrpc.rpc_sync("w3", torch.add, args=(torch.ones(2), torch.ones(3)))
    assert not isinstance(shapes.value, asyncrpc.OperatorArgumentsError)


def test_async_function_error_comes_back_through_future(group: Group) -> None:
    fut = asyncrpc.rpc_async("w2", fns.async_raise_value_error)
    with pytest.raises(ValueError, match="async failure"):
        fut.wait()


def test_timeout_names_worker_function_and_limit(group: Group) -> None:
    with pytest.raises(RpcTimeoutError) as info:
        asyncrpc.rpc_sync("w3", fns.sleep, args=(2.0,), timeout=0.2)
    exc = info.value
    assert isinstance(exc, TimeoutError)
    assert exc.worker == "w3"
    assert exc.function.endswith("remote_fns.sleep")
    assert exc.timeout == 0.2
    # The worker keeps serving afterwards.
    assert asyncrpc.rpc_sync("w3", fns.add, args=(1, 1)) == 2


def test_zero_timeout_means_none(group: Group) -> None:
    assert asyncrpc.rpc_sync("w3", fns.sleep, args=(0.3,), timeout=0) == "slept"


def test_infinite_timeout_means_none_and_nan_is_refused(group: Group) -> None:
    assert asyncrpc.rpc_sync("w3", fns.sleep, args=(0.05,), timeout=float("inf")) == "slept"
    assert asyncrpc.remote("w3", fns.add, args=(1, 2), timeout=float("inf")).to_here() == 3
    with pytest.raises(ValueError, match="NaN"):
        asyncrpc.rpc_sync("w3", fns.add, args=(1, 2), timeout=float("nan"))


def test_unknown_worker(group: Group) -> None:
    with pytest.raises(UnknownWorkerError):
        asyncrpc.rpc_sync("nobody", fns.add, args=(1, 2))
    with pytest.raises(UnknownWorkerError):
        asyncrpc.rpc_async(17, fns.add, args=(1, 2))


def test_unpicklable_argument_fails_before_sending(group: Group) -> None:
    before = asyncrpc.get_metrics()["calls_sent"]
    with pytest.raises(SerializationError):
        asyncrpc.rpc_sync("w1", fns.echo, args=(lambda: 1,))
    assert asyncrpc.get_metrics()["calls_sent"] == before


def test_function_missing_on_the_callee(group: Group) -> None:
    module = types.ModuleType("only_on_the_driver")

    def helper() -> int:
        return 1

    helper.__module__ = module.__name__
    helper.__qualname__ = "helper"
    module.helper = helper  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(FunctionNotFoundError) as info:
            asyncrpc.rpc_sync("w1", helper)
    finally:
        del sys.modules[module.__name__]
    assert info.value.worker == "w1"
    assert "only_on_the_driver.helper" in str(info.value)


def test_result_that_cannot_be_pickled(group: Group) -> None:
    with pytest.raises(SerializationError):
        asyncrpc.rpc_sync("w1", fns.return_lambda)


def test_blocking_wait_on_the_agent_loop_raises(group: Group) -> None:
    with pytest.raises(asyncrpc.BlockingCallError):
        asyncrpc.rpc_sync("driver", fns.blocking_rpc_on_loop)


def test_tensor_device_without_map_is_rejected(group: Group) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(SerializationError):
        asyncrpc.rpc_sync("w1", fns.echo, args=(torch.zeros(2, device="cuda"),))
