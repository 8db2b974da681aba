"""Unit tests of asyncrpc.errorstate: exceptions rebuilt from their state, whatever their
``__init__`` takes."""

from __future__ import annotations

import copyreg
import errno
import io
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; the library itself never imports numpy.
    warnings.simplefilter("ignore", UserWarning)
    from asyncrpc.errors import RemoteCallError, as_callback_error, as_remote_call_error
    from asyncrpc.errorstate import copy_exception, reduce_exception
    from asyncrpc.protocol.serde import Serializer
    from tests.unit import _error_classes as ec


class _StatePickler(pickle.Pickler):
    """How the wire pickles exceptions: ``reduce_exception`` as pickle's override."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, BaseException):
            return reduce_exception(obj) or NotImplemented
        return NotImplemented


def through_pickle(value: Any) -> Any:
    out = io.BytesIO()
    _StatePickler(out, protocol=5).dump(value)
    return pickle.loads(out.getvalue())


def same(a: BaseException, b: BaseException) -> None:
    """``b`` is ``a`` rebuilt: same class, args, text and attributes, no traceback."""
    assert type(b) is type(a)
    assert repr(b.args) == repr(a.args)  # by repr: exceptions among them compare by identity
    assert str(b) == str(a)
    assert vars(b) == vars(a)
    assert b.__traceback__ is None


def test_rebuild_exception_whose_init_takes_other_arguments() -> None:
    original = ec.QuotaExceeded("bob", 10)
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(original))  # pickle calls QuotaExceeded(message)
    before = ec.INITS["QuotaExceeded"]
    got = through_pickle(original)
    same(original, got)
    assert (got.user, got.limit) == ("bob", 10)
    assert ec.INITS["QuotaExceeded"] == before  # rebuilt without running __init__


def test_rebuild_exception_keyword_only_init() -> None:
    original = ec.KeywordOnly(code=7, reason="no")
    got = through_pickle(original)
    same(original, got)
    assert got.code == 7


def test_rebuild_exception_optional_args_keeps_args_as_they_were() -> None:
    original = ec.OptionalArgs("fetch", retries=5)
    plain = pickle.loads(pickle.dumps(original))  # OptionalArgs(message): wrong args
    assert plain.args != original.args
    same(original, through_pickle(original))


def test_rebuild_exception_restores_slots_at_every_level() -> None:
    original = ec.MoreSlots(3, "why")
    original.extra = "in dict"  # type: ignore[attr-defined]
    got = through_pickle(original)
    same(original, got)
    assert (got.code, got.detail, got.extra) == (3, "why", "in dict")


def test_rebuild_exception_oserror_subclass_keeps_errno_and_file_name() -> None:
    original = ec.MissingShard("/data/shard-3")
    got = through_pickle(original)
    same(original, got)
    assert (got.errno, got.strerror, got.filename) == (
        errno.ENOENT,
        "shard not found",
        original.filename,
    )
    assert got.shard == "/data/shard-3"


def test_rebuild_exception_with_its_own_strict_new() -> None:
    original = ec.StrictNew("bob", 10)
    got = through_pickle(original)
    same(original, got)
    assert got.user == "bob"


def test_rebuild_exception_whose_layout_is_another_builtins() -> None:
    original = ec.LateTimeout("w3", 0.5)
    got = through_pickle(original)
    same(original, got)
    assert isinstance(got, TimeoutError)
    assert got.errno is None


def _builtins() -> Iterator[BaseException]:
    yield KeyError("k")
    yield OSError(errno.EEXIST, "exists", "a", None, "b")
    yield ImportError("no module", name="pkg", path="/p")
    yield AttributeError("no attr", name="field")
    yield NameError("no name", name="x")
    yield StopIteration(42)
    yield SystemExit(3)
    yield UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    yield SyntaxError("bad", ("f.py", 1, 2, "x y", 1, 3))
    yield ExceptionGroup("many", [ValueError(1), ec.QuotaExceeded("ann", 2)])


_FIELDS = ("errno", "strerror", "filename", "filename2", "name", "path", "value", "code")


@pytest.mark.parametrize("original", list(_builtins()), ids=lambda e: type(e).__name__)
def test_rebuild_exception_builtin_keeps_its_fields(original: BaseException) -> None:
    got = through_pickle(original)
    same(original, got)
    for field in (*_FIELDS, "reason", "object", "start", "end", "lineno", "offset", "text"):
        assert getattr(got, field, None) == getattr(original, field, None), field
    if isinstance(original, ExceptionGroup):
        quota = got.exceptions[1]
        assert type(quota) is ec.QuotaExceeded
        assert quota.user == "ann"


def test_rebuild_exception_held_in_an_attribute() -> None:
    got = through_pickle(ec.Wrapper(ec.QuotaExceeded("bob", 1)))
    assert type(got.inner) is ec.QuotaExceeded
    assert got.inner.limit == 1


def test_reduce_exception_leaves_a_class_that_pickles_itself() -> None:
    assert reduce_exception(ec.OwnReduce(1, 2)) is None
    got = through_pickle(ec.OwnReduce(1, 2))
    assert (got.a, got.b, got.args) == (1, 2, (3,))
    copyreg.pickle(ec.Slotted, lambda e: (ec.Slotted, (e.code,)))
    try:
        assert reduce_exception(ec.Slotted(1)) is None
    finally:
        del copyreg.dispatch_table[ec.Slotted]
    assert reduce_exception(ec.Slotted(1)) is not None


def test_rebuild_exception_honours_its_own_setstate() -> None:
    got = through_pickle(ec.OwnSetState(5))
    assert (got.value, got.restored) == (5, True)


def test_copy_exception_drops_traceback_and_keeps_fields() -> None:
    try:
        raise ec.QuotaExceeded("bob", 10)
    except ec.QuotaExceeded as caught:
        original = caught
    copied = copy_exception(original)
    assert copied is not original
    same(ec.QuotaExceeded("bob", 10), copied)
    assert copy_exception(ec.OwnReduce(1, 2)).args == (3,)  # through copy.copy


@pytest.mark.parametrize(
    "original",
    [
        ec.QuotaExceeded("bob", 10),
        ec.MoreSlots(1, "d"),
        ec.MissingShard("s"),
        ec.KeywordOnly(code=1, reason="r"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_paired_copy_keeps_fields_and_relays(original: BaseException) -> None:
    paired = as_remote_call_error(original)
    assert type(paired).__bases__ == (type(original), RemoteCallError)
    relayed = pickle.loads(pickle.dumps(paired))  # a paired type pickles itself
    for got in (paired, relayed):
        assert got.args == original.args
        assert str(got) == str(original)
        assert vars(got) == vars(original)
        for field in ("code", "detail", "errno", "filename"):
            assert getattr(got, field, None) == getattr(original, field, None)
    assert type(relayed) is type(paired)


def test_callback_error_copy_keeps_fields() -> None:
    got = as_callback_error(ec.MoreSlots(4, "cb"))
    assert isinstance(got, ec.MoreSlots)
    assert isinstance(got, RuntimeError)
    assert (got.code, got.detail) == (4, "cb")


def test_serializer_rebuilds_an_exception_returned_as_a_value() -> None:
    serializer = Serializer()
    payload, segments, _, _ = serializer.dumps({"error": ec.QuotaExceeded("bob", 10)})
    assert segments == []
    got = serializer.loads(payload, [])["error"]
    same(ec.QuotaExceeded("bob", 10), got)


def _raise_through_a_frame(exc: BaseException, holder: object) -> None:
    del holder  # the frame is what the traceback keeps, with its locals
    raise exc


def test_own_copy_raised_leaves_the_kept_error_without_the_raisers_frames() -> None:
    import gc
    import weakref

    from asyncrpc.errors import PeerLostError
    from asyncrpc.errorstate import own_copy

    kept = PeerLostError("w1", "gone", "silence")
    kept.__cause__ = OSError("reset")

    class Local:
        pass

    local = Local()
    ref = weakref.ref(local)
    with pytest.raises(PeerLostError) as info:
        _raise_through_a_frame(own_copy(kept), local)
    raised = info.value
    assert raised is not kept
    assert (type(raised), raised.worker, raised.reason, raised.evidence) == (
        PeerLostError, "w1", "gone", "silence",
    )  # fmt: skip
    assert raised.__cause__ is kept.__cause__
    del info, raised
    del local
    gc.collect()
    assert ref() is None  # the copy's traceback went with it
    assert kept.__traceback__ is None


def test_own_copy_of_an_uncopyable_error_is_the_error() -> None:
    from asyncrpc.errorstate import own_copy

    class Stubborn(Exception):
        def __reduce__(self) -> object:
            raise TypeError("no copies")

    error = Stubborn()
    assert own_copy(error) is error
