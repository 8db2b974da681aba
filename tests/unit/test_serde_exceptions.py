"""Unit tests of remote exceptions (asyncrpc.protocol.serde.exceptions): original types."""

from __future__ import annotations

import errno
import pickle
import sys
import threading
import types
import warnings
from collections.abc import Iterator

import pytest

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; the library itself never imports numpy.
    warnings.simplefilter("ignore", UserWarning)
    from asyncrpc.errors import (
        AsyncRpcError,
        FunctionNotFoundError,
        PeerLostError,
        RemoteCallError,
        RemoteError,
        RpcTimeoutError,
        SerializationError,
        UnknownWorkerError,
    )
    from asyncrpc.protocol.serde import pack_exception, unpack_exception
    from tests.unit import _serde_helpers as helpers


def raised(exc: BaseException) -> BaseException:
    """Raise and catch ``exc`` so it carries a traceback through this function."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def roundtrip(exc: BaseException, worker: str = "worker1") -> BaseException:
    return unpack_exception(pack_exception(raised(exc), worker))


@pytest.fixture
def scratch_module() -> Iterator[types.ModuleType]:
    module = types.ModuleType("asyncrpc_scratch_errors")
    sys.modules[module.__name__] = module
    try:
        yield module
    finally:
        sys.modules.pop(module.__name__, None)


def _remote(got: BaseException, original: type) -> bool:
    """``got`` is a rebuilt remote exception of type ``original`` that is also a
    ``RuntimeError`` (a ``RemoteCallError``), and nothing else."""
    return type(got).__bases__ == (original, RemoteCallError)


def test_unpack_exception_rebuilds_builtin_type() -> None:
    got = roundtrip(ValueError("bad value", 3))
    assert _remote(got, ValueError)
    assert got.args == ("bad value", 3)
    assert str(got) == str(ValueError("bad value", 3))


def test_unpack_exception_attaches_worker_and_traceback() -> None:
    got = roundtrip(ValueError("boom"), worker="trainer3")
    assert got.remote_worker == "trainer3"  # type: ignore[attr-defined]
    assert "raised" in got.remote_traceback  # type: ignore[attr-defined]
    assert "ValueError: boom" in got.remote_traceback  # type: ignore[attr-defined]
    (note,) = got.__notes__
    assert "'trainer3'" in note
    assert got.remote_traceback in note  # type: ignore[attr-defined]


def test_unpack_exception_keeps_keyerror_args() -> None:
    got = roundtrip(KeyError("missing-key"))
    assert _remote(got, KeyError)
    with pytest.raises(KeyError) as info:
        raise got
    assert info.value.args[0] == "missing-key"
    assert str(got) == "'missing-key'"


def test_unpack_exception_keeps_oserror_fields() -> None:
    got = roundtrip(OSError(errno.ENOENT, "No such file or directory", "/tmp/nowhere"))
    assert _remote(got, FileNotFoundError)  # errno picks OSError's subclass
    assert isinstance(got, OSError)
    assert got.errno == errno.ENOENT
    assert got.strerror == "No such file or directory"
    assert got.filename == "/tmp/nowhere"
    assert got.args == (errno.ENOENT, "No such file or directory")
    again = pickle.loads(pickle.dumps(got))  # a relayed copy keeps them too
    assert again.filename == "/tmp/nowhere"
    assert _remote(again, FileNotFoundError)


def test_unpack_exception_rebuilds_user_exception() -> None:
    got = roundtrip(helpers.UserError(17, "disk full"))
    assert _remote(got, helpers.UserError)
    assert (got.code, got.detail) == (17, "disk full")


def test_unpack_exception_init_with_other_arguments_keeps_class_and_fields() -> None:
    # BadInitError(a, b) calls super().__init__(f"bad {a} {b}"): pickle's cls(*args) fails.
    got = roundtrip(helpers.BadInitError(1, 2), worker="w2")
    assert _remote(got, helpers.BadInitError)
    assert (got.a, got.b) == (1, 2)  # type: ignore[attr-defined]
    assert got.args == ("bad 1 2",)
    assert str(got) == "bad 1 2"
    assert got.remote_worker == "w2"  # type: ignore[attr-defined]
    assert "BadInitError" in got.remote_traceback  # type: ignore[attr-defined]


def test_unpack_exception_unpicklable_attribute_becomes_remote_error() -> None:
    error = RuntimeError("holds a lock")
    error.lock = threading.Lock()  # type: ignore[attr-defined]
    got = roundtrip(error)
    assert type(got) is RemoteError
    assert got.type_name == "RuntimeError"
    assert got.message == "holds a lock"


def test_unpack_exception_class_missing_here_becomes_remote_error(
    scratch_module: types.ModuleType,
) -> None:
    gone_error = type("GoneError", (Exception,), {"__module__": scratch_module.__name__})
    scratch_module.GoneError = gone_error  # type: ignore[attr-defined]
    data = pack_exception(raised(gone_error("vanished")), "w1")
    del sys.modules[scratch_module.__name__]
    got = unpack_exception(data)
    assert type(got) is RemoteError
    assert got.type_name == f"{scratch_module.__name__}.GoneError"
    assert got.message == "vanished"


@pytest.mark.parametrize(
    "error",
    [
        RpcTimeoutError("w3", "pkg.fn", 2.5),
        UnknownWorkerError("ghost", ("a", "b")),
        FunctionNotFoundError("pkg.fn", "w3", "no module named pkg"),
        PeerLostError("w4"),
        SerializationError("cannot pickle"),
        RemoteError("pkg.Err", "inner", "tb text", "w5"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_unpack_exception_rebuilds_asyncrpc_errors(error: AsyncRpcError) -> None:
    got = roundtrip(error)
    assert type(got) is type(error)
    assert got.args == error.args
    assert str(got) == str(error)


def test_unpack_exception_nested_hops_add_notes() -> None:
    first = unpack_exception(pack_exception(raised(ValueError("deep")), "inner"))
    second = unpack_exception(pack_exception(first, "outer"))
    assert _remote(second, ValueError)
    assert second.remote_worker == "outer"  # type: ignore[attr-defined]
    assert len(second.__notes__) == 2
    assert "'inner'" in second.__notes__[0]


def test_unpack_exception_traceback_includes_cause() -> None:
    try:
        try:
            raise KeyError("root")
        except KeyError as root:
            raise ValueError("wrapper") from root
    except ValueError as caught:
        got = unpack_exception(pack_exception(caught, "w"))
    assert _remote(got, ValueError)
    assert "KeyError: 'root'" in got.remote_traceback  # type: ignore[attr-defined]


class _NoStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("no pickling either")


def test_pack_exception_never_raises() -> None:
    data = pack_exception(raised(_NoStr()), "w9")
    got = unpack_exception(data)
    assert type(got) is RemoteError
    assert got.type_name.endswith("_NoStr")
    assert got.remote_worker == "w9"


def test_unpack_exception_garbage_becomes_remote_error() -> None:
    assert type(unpack_exception(b"not a record")) is RemoteError


def test_pack_exception_relayed_through_hops_grows_linearly() -> None:
    error = raised(ValueError("deep"))
    sizes = []
    for hop in range(8):
        data = pack_exception(error, f"w{hop}")
        sizes.append(len(data))
        error = raised(unpack_exception(data))
    assert len(error.__notes__) == 8
    # Each hop adds about one traceback; doubling would make the last record ~64x the 2nd.
    assert sizes[-1] < sizes[1] * 8
    assert "'w0'" in error.__notes__[0]
    assert "Raised on remote worker 'w0'" not in error.remote_traceback  # type: ignore[attr-defined]


def test_unpack_exception_is_caught_by_a_torch_style_handler() -> None:
    # torch's code catches remote failures as RuntimeError; asyncio code by their own type.
    got = unpack_exception(pack_exception(raised(helpers.UserError(7, "mine")), "w4"))
    with pytest.raises(RuntimeError) as as_torch:
        raise got
    with pytest.raises(helpers.UserError) as as_ours:
        raise got
    assert as_torch.value is as_ours.value
    assert got.args == (7, "mine")
    assert got.remote_worker == "w4"  # type: ignore[attr-defined]
    assert "raised" in got.remote_traceback  # type: ignore[attr-defined]
    assert got.__cause__ is None  # the original was raised elsewhere: no local cause


def test_unpack_exception_keeps_a_remote_runtime_error_as_it_is() -> None:
    got = unpack_exception(pack_exception(raised(RpcTimeoutError("w", "f", 1.0)), "w"))
    assert type(got) is RpcTimeoutError
    assert type(unpack_exception(pack_exception(raised(RuntimeError("x")), "w"))) is RuntimeError


def test_unpack_exception_relayed_twice_stays_one_pair() -> None:
    first = unpack_exception(pack_exception(raised(KeyError("k")), "w2"))
    second = unpack_exception(pack_exception(raised(first), "w1"))
    assert _remote(second, KeyError)
    assert second.args == ("k",)
