"""A user's exception keeps its class and fields on every call path, whatever its
``__init__`` takes; it falls back to ``RemoteError`` only when it cannot travel."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import asyncrpc
from asyncrpc.errors import RemoteError
from tests.integration import exception_fns as ef
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)


def _failing_later(kind: str) -> asyncrpc.Future[None]:
    return asyncrpc.rpc_async("w2", ef.fail_later, args=(kind,))


# Every way a caller meets a remote function's exception. w2 runs its agent on its own
# asyncio loop (init_rpc_async), w1 and w3 on a background loop thread.
PATHS: dict[str, Callable[[str], object]] = {
    "rpc_sync": lambda kind: asyncrpc.rpc_sync("w1", ef.raise_kind, args=(kind,)),
    "rpc_async": lambda kind: asyncrpc.rpc_async("w2", ef.raise_kind, args=(kind,)).wait(),
    "await_call": lambda kind: asyncio.run(asyncrpc.call("w3", ef.araise_kind, kind)),
    "remote": lambda kind: asyncrpc.remote("w1", ef.raise_kind, args=(kind,)).to_here(),
    "remote_to_self": lambda kind: asyncrpc.remote("driver", ef.raise_kind, args=(kind,)).to_here(),
    "rref_proxy": lambda kind: (
        asyncrpc.remote("w3", ef.Raiser).rpc_sync().raise_kind(kind)  # type: ignore[attr-defined]
    ),
    "stream": lambda kind: list(asyncrpc.stream("w2", ef.failing_stream, kind, 2)),
    "then_wait": lambda kind: (
        asyncrpc.rpc_async("w3", ef.raise_kind, args=(kind,)).then(lambda f: f.wait()).wait()
    ),
    "then_raises": lambda kind: (
        asyncrpc.rpc_async("w1", fns.add, args=(1, 2)).then(lambda f: ef.raise_kind(kind)).wait()
    ),
    "async_execution": lambda kind: _failing_later(kind).wait(),
    "two_hops": lambda kind: asyncrpc.rpc_sync("w1", ef.relay, args=("w3", kind)),
}


def _caught(call: Callable[[], object]) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("nothing raised")


@pytest.mark.parametrize("kind", sorted(ef.FIELDS))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_remote_exception_keeps_class_and_fields(group: Group, path: str, kind: str) -> None:
    caught = _caught(lambda: PATHS[path](kind))
    expected = ef.make(kind)
    assert isinstance(caught, type(expected)), repr(caught)
    assert isinstance(caught, RuntimeError)  # what torch-style handlers catch
    assert ef.fingerprint(caught, kind) == ef.fingerprint(expected, kind)


def test_remote_exception_keeps_the_remote_traceback_text(group: Group) -> None:
    caught = _caught(lambda: PATHS["two_hops"]("quota"))
    assert isinstance(caught, ef.QuotaExceeded)
    assert caught.remote_worker == "w1"  # type: ignore[attr-defined]
    notes = "".join(caught.__notes__)
    assert "Raised on remote worker 'w3'" in notes  # the hop that raised it
    assert "in raise_kind\n    raise make(kind)" in notes
    assert "QuotaExceeded: user bob exceeded 10" in notes


@pytest.mark.parametrize("path", ["rpc_sync", "remote", "stream"])
def test_remote_exception_whose_state_cannot_be_pickled_is_a_remote_error(
    group: Group, path: str
) -> None:
    caught = _caught(lambda: PATHS[path]("lock"))
    assert type(caught) is RemoteError
    assert caught.type_name == "tests.integration.exception_fns.HoldsALockError"
    assert caught.message == "locked"


def test_remote_exception_whose_class_is_missing_here_is_a_remote_error(group: Group) -> None:
    caught = _caught(lambda: asyncrpc.rpc_sync("w3", ef.raise_class_only_here))
    assert type(caught) is RemoteError
    assert caught.type_name == "asyncrpc_only_on_this_worker.LocalOnlyError"
    assert caught.message == "exists on this worker only"
    assert caught.remote_worker == "w3"
    assert "raise_class_only_here" in caught.remote_traceback
