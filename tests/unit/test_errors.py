"""Unit tests of asyncrpc.errors and the argument checks: torch's base types, torch's words."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrpc import errors
from asyncrpc.errorstate import copy_exception
from asyncrpc.protocol.options import RpcBackendOptions, WorkerInfo, coerce_options

# One instance of every error, with the arguments its constructor takes.
SAMPLES: dict[str, tuple[Any, ...]] = {
    "UnknownWorkerError": ("w9", ("w0", "w1")),
    "BadDestinationError": (0.5, ("w0",)),
    "FunctionNotFoundError": ("m.f", "w1", "no attribute f"),
    "RemoteError": ("m.Custom", "boom", "Traceback ...", "w1"),
    "RpcTimeoutError": ("w1", "m.f", 0.5),
    "PeerLostError": ("w1",),
    "PeerUnavailableError": ("w1", "refused"),
    "FrameTooLargeError": (10, 5),
    "ThreadPoolExhaustedError": ("w1", 4),
    "RRefOwnerLostError": ("w1",),
    "RRefTimeoutError": ("w1", "m.f", 0.5),
    "WorldSizeMismatchError": (1, 3, 0, 2),
    "DuplicateNameError": ("w1", 1, 0),
    "DuplicateRankError": (1, "w1b", "w1"),
    "StoreHostLostError": ("tcp://127.0.0.1:1", "Connection reset by peer"),
    "ShutdownTimeoutError": (30.0, "'w1'", "calls-done"),
    "WorkersLostError": (("w1", "w2"),),
    "RendezvousTimeoutError": (0, 3, 5.0, [2], "joining the group"),
}

# Where torch raises RuntimeError, ours are RuntimeErrors too.
RUNTIME_ERRORS = [
    "InitError",
    "InitArgumentError",
    "WorkerNameError",
    "MissingRankError",
    "MixedGroupError",
    "WorldSizeMismatchError",
    "DuplicateNameError",
    "DuplicateRankError",
    "StoreHostLostError",
    "RendezvousTimeoutError",
    "NotInitializedError",
    "ShutdownError",
    "BlockingCallError",
    "UnknownWorkerError",
    "BadDestinationError",
    "SerializationError",
    "AsyncExecutionError",
    "FunctionNotFoundError",
    "RemoteError",
    "RpcTimeoutError",
    "ClosedError",
    "ConnectionLostError",
    "PeerLostError",
    "RRefError",
    "RRefTimeoutError",
    "CallbackError",
    "BackwardError",
]


def _make(name: str) -> BaseException:
    cls = getattr(errors, name)
    return cls(*SAMPLES.get(name, ("detail",)))  # type: ignore[no-any-return]


ERROR_NAMES = [name for name in errors.__all__ if name[0].isupper()]


@pytest.mark.parametrize("name", ERROR_NAMES)
def test_error_pickles_with_its_type_and_text(name: str) -> None:
    exc = _make(name)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)


@pytest.mark.parametrize("name", ERROR_NAMES)
def test_error_rebuilds_from_its_state(name: str) -> None:
    # How errors travel between workers (asyncrpc.errorstate): without calling __init__.
    exc = _make(name)
    back = copy_exception(exc)
    assert type(back) is type(exc)
    assert back.args == exc.args
    assert str(back) == str(exc)
    assert vars(back) == vars(exc)


@pytest.mark.parametrize("name", RUNTIME_ERRORS)
def test_error_is_a_RuntimeError_like_torch(name: str) -> None:
    assert isinstance(_make(name), RuntimeError)


def test_typed_errors_keep_their_builtin_bases() -> None:
    assert isinstance(_make("RpcTimeoutError"), TimeoutError)
    assert isinstance(_make("PeerLostError"), ConnectionError)
    assert isinstance(_make("SerializationError"), TypeError)
    assert isinstance(_make("InitArgumentError"), TypeError)
    assert isinstance(_make("MissingRankError"), ValueError)  # torch's rendezvous: ValueError
    assert isinstance(_make("BadDestinationError"), ValueError)
    assert isinstance(_make("BadDestinationError"), errors.UnknownWorkerError)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("RpcTimeoutError", "RPC ran for more than"),
        ("UnknownWorkerError", "could not find destination"),
        ("RemoteError", "Original exception on remote side was"),
        ("FunctionNotFoundError", "RPC pickler does not serialize"),
    ],
)
def test_error_text_carries_torchs_words(name: str, words: str) -> None:
    assert words in str(_make(name))


@pytest.mark.parametrize(
    ("name", "words"),
    [("abc*", "must match"), (" ", "must match"), ("", "non-empty"), ("a" * 500, "shorter")],
)
def test_WorkerInfo_refuses_names_torch_refuses(name: str, words: str) -> None:
    with pytest.raises(errors.WorkerNameError, match=words):
        WorkerInfo(name, 0)


def test_WorkerInfo_accepts_names_torch_accepts() -> None:
    assert WorkerInfo("trainer-0:a_b", 3).name == "trainer-0:a_b"


def test_coerce_options_refuses_a_dict() -> None:
    with pytest.raises(errors.InitArgumentError, match="must be an instance of RpcBackendOptions"):
        coerce_options({"init_method": "env://"})


def test_coerce_options_refuses_unknown_options_class() -> None:
    foreign = SimpleNamespace(init_method="env://", rpc_timeout=5.0)
    with pytest.raises(errors.InitArgumentError, match="Could not infer backend"):
        coerce_options(foreign)
    with pytest.raises(errors.InitArgumentError, match="TensorPipeRpcBackendOptions"):
        coerce_options(foreign, backend="TENSORPIPE")


def test_coerce_options_takes_ours_and_torchs() -> None:
    import torch.distributed.rpc as torch_rpc

    ours = RpcBackendOptions(init_method="tcp://127.0.0.1:1")
    assert coerce_options(ours) is ours
    theirs = torch_rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:2")
    assert coerce_options(theirs).init_method == "tcp://127.0.0.1:2"


def test_RpcBackendOptions_checks_the_stream_windows() -> None:
    assert RpcBackendOptions().stream_window_bytes == 64 << 20
    assert RpcBackendOptions(stream_window_bytes=0).stream_window_bytes == 0  # items only
    for bad in (-1, 1.5, True):
        with pytest.raises(errors.InitError):
            RpcBackendOptions(stream_window_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(errors.InitError):
        RpcBackendOptions(stream_window=0)


def test_RpcBackendOptions_checks_busy_poll() -> None:
    assert RpcBackendOptions().busy_poll_us == 0  # off unless asked for
    assert RpcBackendOptions(busy_poll_us=500).busy_poll_us == 500
    for bad in (-1, 1.5, True, 10_001):
        with pytest.raises(errors.InitError):
            RpcBackendOptions(busy_poll_us=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "exc",
    [
        TypeError("bad arg"),
        KeyError("k"),
        OSError(2, "gone"),
        UnicodeDecodeError("utf-8", b"x", 0, 1, "no"),
    ],
)
def test_as_callback_error_is_both_types_and_pickles(exc: Exception) -> None:
    dual = errors.as_callback_error(exc)
    assert isinstance(dual, type(exc))
    assert isinstance(dual, RuntimeError)
    assert isinstance(dual, errors.CallbackError)
    assert str(dual) == str(exc)
    assert dual.__cause__ is exc
    back = pickle.loads(pickle.dumps(dual))
    assert type(back) is type(dual)
    assert str(back) == str(exc)


def test_as_callback_error_leaves_runtime_errors_and_base_exceptions() -> None:
    runtime = ValueError("v")
    assert errors.as_callback_error(runtime) is not runtime
    same = RuntimeError("r")
    assert errors.as_callback_error(same) is same
    interrupt = KeyboardInterrupt()
    assert errors.as_callback_error(interrupt) is interrupt


@pytest.mark.parametrize("exc", [KeyError("k"), TypeError("bad"), OSError(2, "gone")])
def test_as_backward_error_is_both_types_names_the_node_and_pickles(exc: Exception) -> None:
    dual = errors.as_backward_error(exc, 3)
    assert isinstance(dual, type(exc))
    assert isinstance(dual, errors.BackwardError)
    assert isinstance(dual, RuntimeError)
    assert str(dual) == f"Error on Node 3: {exc}"
    assert dual.__cause__ is exc
    back = pickle.loads(pickle.dumps(dual))
    assert type(back) is type(dual)
    assert str(back) == str(dual)


def test_as_backward_error_runtime_errors_plain_and_relayed_ones_unchanged() -> None:
    for exc in (RuntimeError("r"), Exception("e")):
        wrapped = errors.as_backward_error(exc, 2)
        assert type(wrapped) is errors.BackwardError  # the pair has no consistent MRO
        assert str(wrapped) == f"Error on Node 2: {exc}"
        assert wrapped.__cause__ is exc
        assert str(pickle.loads(pickle.dumps(wrapped))) == str(wrapped)
        assert errors.as_backward_error(wrapped, 0) is wrapped  # a deeper node's error
    interrupt = KeyboardInterrupt()
    assert errors.as_backward_error(interrupt, 1) is interrupt
