"""Unit tests of the pickler's hooks: reducers, references, persistent hooks, failures."""

from __future__ import annotations

import gc
import pickle
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

with warnings.catch_warnings():
    # torch warns at import when numpy is missing; the library itself never imports numpy.
    warnings.simplefilter("ignore", UserWarning)
    import torch

    from asyncrpc.errors import RRefError, SerializationError
    from asyncrpc.protocol.serde import (
        MissingReferenceError,
        ReducerRegistry,
        Serializer,
        default_registry,
        register_reducer,
    )
    from asyncrpc.protocol.serde.reducers import resolve_script_function
    from asyncrpc.protocol.serde.tensors import SMALL_TENSOR_BYTES
    from tests.unit import _serde_helpers as helpers


BIG = SMALL_TENSOR_BYTES  # float32 elements: 4x the inline limit in bytes


@pytest.fixture
def serializer() -> Serializer:
    return Serializer()


@pytest.fixture
def scratch_module() -> Iterator[types.ModuleType]:
    """A module that exists while pickling and can be taken away before unpickling."""
    module = types.ModuleType("asyncrpc_scratch_module")
    sys.modules[module.__name__] = module
    try:
        yield module
    finally:
        sys.modules.pop(module.__name__, None)


def roundtrip(serializer: Serializer, obj: object, **kwargs: Any) -> Any:
    return helpers.wire_roundtrip(serializer, obj, **kwargs).value


# -- failures at the caller ----------------------------------------------------------------


def test_Serializer_lambda_raises_serialization_error(serializer: Serializer) -> None:
    with pytest.raises(SerializationError, match=r"'function' object .*<lambda>") as info:
        serializer.dumps((lambda x: x, (torch.ones(2),), {}))
    assert isinstance(info.value.__cause__, pickle.PicklingError | AttributeError | TypeError)
    assert "module level" in str(info.value)


def test_Serializer_failed_dumps_leaves_no_state(serializer: Serializer) -> None:
    calls: list[object] = []

    def record(obj: object, context: object, made: list[Any]) -> None:
        calls.append(obj)

    hooked = Serializer(persistent_dump=record)
    for candidate in (serializer, hooked):
        with pytest.raises(SerializationError):
            candidate.dumps([torch.ones(3), lambda: None])
        big = torch.zeros(BIG)  # over the inline limit: a segment
        payload, segments, keepalive, _ = candidate.dumps([big])
        assert len(segments) == 1
        assert len(keepalive) == 1
        assert torch.equal(candidate.loads(payload, [bytes(segments[0][0])])[0], big)
    assert any(isinstance(seen, types.FunctionType) for seen in calls)


def test_Serializer_local_function_raises_serialization_error(serializer: Serializer) -> None:
    def local(x: int) -> int:
        return x

    with pytest.raises(SerializationError, match="local"):
        serializer.dumps(local)


def test_Serializer_unpicklable_object_names_its_type(serializer: Serializer) -> None:
    with pytest.raises(SerializationError, match="lock") as info:
        serializer.dumps({"state": [1, threading.Lock()]})
    assert isinstance(info.value.__cause__, TypeError)


def test_Serializer_errors_of_its_own_tree_propagate_unchanged() -> None:
    def refuse(obj: object, context: object, made: list[Any]) -> tuple[Any, ...] | None:
        if isinstance(obj, helpers.Handle):
            raise RRefError("deleted RRef")
        return None

    with pytest.raises(RRefError):
        Serializer(persistent_dump=refuse).dumps([helpers.Handle(1)])


# -- references that are missing at the callee -----------------------------------------------


def test_Serializer_missing_module_raises_missing_reference(
    serializer: Serializer, scratch_module: types.ModuleType
) -> None:
    def remote_fn() -> None: ...

    remote_fn.__module__ = scratch_module.__name__
    remote_fn.__qualname__ = "remote_fn"
    scratch_module.remote_fn = remote_fn  # type: ignore[attr-defined]
    payload, segments, _, _ = serializer.dumps((remote_fn, (), {}))
    del sys.modules[scratch_module.__name__]
    with pytest.raises(MissingReferenceError) as info:
        serializer.loads(payload, segments)
    assert info.value.module == scratch_module.__name__
    assert info.value.qualname == "remote_fn"
    assert isinstance(info.value.__cause__, ImportError)
    assert isinstance(info.value, SerializationError)


def test_Serializer_missing_attribute_raises_missing_reference(
    serializer: Serializer, scratch_module: types.ModuleType
) -> None:
    class Gone:
        pass

    Gone.__module__ = scratch_module.__name__
    Gone.__qualname__ = "Gone"
    scratch_module.Gone = Gone  # type: ignore[attr-defined]
    payload, segments, _, _ = serializer.dumps(Gone())
    del scratch_module.Gone
    with pytest.raises(MissingReferenceError) as info:
        serializer.loads(payload, segments)
    assert (info.value.module, info.value.qualname) == (scratch_module.__name__, "Gone")
    assert "Gone" in info.value.reason


def test_MissingReferenceError_pickles() -> None:
    error = MissingReferenceError("pkg.mod", "fn", "no module named pkg")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is MissingReferenceError
    assert (back.module, back.qualname, back.reason) == ("pkg.mod", "fn", "no module named pkg")


def test_Serializer_corrupt_payload_raises_serialization_error(serializer: Serializer) -> None:
    with pytest.raises(SerializationError):
        serializer.loads(b"\x80\x05not a pickle", [])


# -- TorchScript functions ----------------------------------------------------------------


def test_Serializer_script_function_roundtrip(serializer: Serializer) -> None:
    fn, args = roundtrip(serializer, (helpers.scaled_add, (torch.ones(2), torch.ones(2), 2.0)))
    assert fn is helpers.scaled_add
    assert torch.equal(fn(*args), torch.full((2,), 3.0))


def test_Serializer_local_script_function_raises_at_caller(serializer: Serializer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)

        @torch.jit.script
        def local_scripted(x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(SerializationError, match="local_scripted"):
        serializer.dumps(local_scripted)


def test_resolve_script_function_missing_raises_missing_reference() -> None:
    with pytest.raises(MissingReferenceError) as info:
        resolve_script_function("__torch__.tests.unit._serde_helpers.no_such_fn")
    assert info.value.module == "tests.unit._serde_helpers"
    assert info.value.qualname == "no_such_fn"
    with pytest.raises(MissingReferenceError):
        resolve_script_function("__torch__.no_such_package_xyz.fn")


def test_resolve_script_function_rejects_unscripted_attribute() -> None:
    with pytest.raises(MissingReferenceError, match="not a scripted function"):
        resolve_script_function("__torch__.tests.unit._serde_helpers.not_scripted")


def test_Serializer_torch_value_types_roundtrip(serializer: Serializer) -> None:
    values = (torch.device("cuda:1"), torch.float8_e4m3fn, torch.Size([2, 3]), torch.sparse_coo)
    assert roundtrip(serializer, values) == values


# -- custom reducers ------------------------------------------------------------------------


def test_ReducerRegistry_reduces_registered_class() -> None:
    registry = ReducerRegistry()
    registry.register(helpers.Point, helpers.reduce_point)
    serializer = Serializer(reducers=registry)
    got = roundtrip(serializer, [helpers.Point(3, 4)])[0]
    assert type(got) is helpers.Point
    assert (got.x, got.y) == (3, 4)
    with pytest.raises(SerializationError, match="Point"):
        Serializer(reducers=ReducerRegistry()).dumps(helpers.Point(1, 2))


def test_ReducerRegistry_matches_exact_type_only() -> None:
    registry = ReducerRegistry()
    registry.register(helpers.Point, helpers.reduce_point)
    with pytest.raises(SerializationError, match="Point3"):
        Serializer(reducers=registry).dumps(helpers.Point3(1, 2))


def test_register_reducer_updates_default_registry() -> None:
    serializer = Serializer()  # reads the default registry live
    register_reducer(helpers.Point, helpers.reduce_point)
    try:
        got = roundtrip(serializer, helpers.Point(5, 6))
        assert (got.x, got.y) == (5, 6)
    finally:
        default_registry.unregister(helpers.Point)
    assert helpers.Point not in default_registry
    assert torch.jit.ScriptFunction in default_registry


def test_ReducerRegistry_copy_is_independent() -> None:
    copy = default_registry.copy()
    copy.register(helpers.Point, helpers.reduce_point)
    assert helpers.Point in copy
    assert helpers.Point not in default_registry


# -- persistent hooks -----------------------------------------------------------------------


def test_Serializer_persistent_hooks_receive_context() -> None:
    dumped: list[tuple[object, object]] = []
    loaded: list[tuple[tuple[Any, ...], object]] = []

    def dump(obj: object, context: object, made: list[Any]) -> tuple[Any, ...] | None:
        dumped.append((type(obj), context))
        return ("handle", obj.ident) if isinstance(obj, helpers.Handle) else None

    def load(pid: tuple[Any, ...], context: object) -> object:
        loaded.append((pid, context))
        return helpers.Handle(pid[1] * 10)

    serializer = Serializer(persistent_dump=dump, persistent_load=load)
    payload, segments, _, _ = serializer.dumps(
        {"h": helpers.Handle(7), "n": [1, "x"]}, context="to-worker"
    )
    got = serializer.loads(payload, segments, context="from-worker")
    assert got["h"].ident == 70
    assert got["n"] == [1, "x"]
    assert (helpers.Handle, "to-worker") in dumped
    assert loaded == [(("handle", 7), "from-worker")]
    assert all(kind not in {int, str, list, dict} for kind, _ in dumped)


def _minting(obj: object, context: object, made: list[Any]) -> tuple[Any, ...] | None:
    if not isinstance(obj, helpers.Handle):
        return None
    made.append((context, obj.ident))  # as the RRef layer records the fork it mints
    return ("handle", obj.ident)


def test_Serializer_dumps_returns_what_its_hook_minted() -> None:
    serializer = Serializer(persistent_dump=_minting)
    assert serializer.dumps([1, "x"], context=3).made is None  # nothing minted: no list
    made = serializer.dumps([helpers.Handle(7), helpers.Handle(8)], context=3).made
    assert made == [(3, 7), (3, 8)]
    # Nothing is left behind for the next message (no per-thread state to take it from).
    assert serializer.dumps(helpers.Handle(9), context=4).made == [(4, 9)]


def test_Serializer_failed_dumps_discards_what_its_hook_minted() -> None:
    discarded: list[tuple[object, list[Any]]] = []
    serializer = Serializer(
        persistent_dump=_minting, discard=lambda context, made: discarded.append((context, made))
    )
    with pytest.raises(SerializationError):
        serializer.dumps([helpers.Handle(7), threading.Lock()], context=3)
    assert discarded == [(3, [(3, 7)])]
    with pytest.raises(SerializationError):
        serializer.dumps([threading.Lock()], context=3)  # nothing minted: nothing to discard
    assert len(discarded) == 1


def test_Serializer_tensor_hook_runs_before_persistent_dump() -> None:
    seen: list[type] = []

    def dump(obj: object, context: object, made: list[Any]) -> tuple[Any, ...] | None:
        seen.append(type(obj))
        return None

    sent = helpers.wire_roundtrip(Serializer(persistent_dump=dump), [torch.ones(BIG)])
    assert torch.Tensor not in seen
    assert len(sent.segments) == 1


def test_Serializer_persistent_tuple_may_carry_tensors() -> None:
    def dump(obj: object, context: object, made: list[Any]) -> tuple[Any, ...] | None:
        return (
            ("h", torch.full((BIG,), float(obj.ident))) if isinstance(obj, helpers.Handle) else None
        )

    def load(pid: tuple[Any, ...], context: object) -> object:
        return pid[1]

    serializer = Serializer(persistent_dump=dump, persistent_load=load)
    sent = helpers.wire_roundtrip(serializer, helpers.Handle(2))
    assert len(sent.segments) == 1
    assert torch.equal(sent.value, torch.full((BIG,), 2.0))


def test_Serializer_loads_keeps_nothing_alive_after_it_returns() -> None:
    # Received objects live as long as the value does, not until the next garbage
    # collection: a received RRef must be released when the program drops it.
    loaded: list[weakref.ref[Any]] = []

    def dump(obj: object, context: object, made: list[Any]) -> tuple[Any, ...] | None:
        return ("h", obj.ident) if isinstance(obj, helpers.Handle) else None

    def load(pid: tuple[Any, ...], context: object) -> object:
        handle = helpers.Handle(pid[1])
        loaded.append(weakref.ref(handle))
        return handle

    serializer = Serializer(persistent_dump=dump, persistent_load=load)
    message = [helpers.Handle(1), torch.ones(BIG), torch.ones(2)]
    payload, segments, _, _ = serializer.dumps(message)
    owners = [bytearray(view) for view, _ in segments]
    collecting = gc.isenabled()
    gc.disable()
    try:
        value = serializer.loads(payload, owners)
        tensor = weakref.ref(value[1])
        del value
        assert loaded[0]() is None
        assert tensor() is None
    finally:
        if collecting:
            gc.enable()


def test_Serializer_same_handle_twice_is_dumped_once() -> None:
    made: list[Any] = []

    def dump(obj: object, context: object, minted: list[Any]) -> tuple[Any, ...] | None:
        if not isinstance(obj, helpers.Handle):
            return None
        made.append(obj.ident)
        return ("h", obj.ident)

    handle = helpers.Handle(3)
    serializer = Serializer(persistent_dump=dump, persistent_load=lambda pid, ctx: [pid[1]])
    payload, segments, _, _ = serializer.dumps((handle, {"again": handle}))
    first, nested = serializer.loads(payload, segments)
    assert made == [3]  # one reference minted for the message, as torch's pickler does
    assert first is nested["again"]


def test_Serializer_persistent_reference_without_load_hook_raises() -> None:
    def dump(obj: object, context: object, made: list[Any]) -> tuple[Any, ...] | None:
        return ("h",) if isinstance(obj, helpers.Handle) else None

    payload, segments, _, _ = Serializer(persistent_dump=dump).dumps(helpers.Handle(1))
    with pytest.raises(SerializationError):
        Serializer().loads(payload, segments)


# -- concurrency ----------------------------------------------------------------------------


def test_Serializer_is_safe_from_many_threads(serializer: Serializer) -> None:
    def work(index: int) -> bool:
        for _ in range(50):
            value: dict[str, Any] = {"i": index, "t": torch.full((index + 1,), float(index))}
            got = roundtrip(serializer, [value, value["t"]])
            if got[0]["i"] != index or got[1] is not got[0]["t"]:
                return False
            if not torch.equal(got[1], value["t"]):
                return False
        return True

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(work, range(16)))
