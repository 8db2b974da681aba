"""Unit tests of asyncrpc.runtime.group.quiet: torch's C++ log level is raised for the
length of each store call asyncrpc makes, and put back after, nested or not."""

from __future__ import annotations

import pytest

from asyncrpc.runtime.group import quiet


def _level() -> int:
    flag = quiet._find_level()
    if flag is None:
        pytest.skip("this torch build does not export its C++ log level")
    return flag.value


class _Store:
    """A store whose calls record the C++ log level they ran under."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def check(self, keys: list[str]) -> bool:
        self.seen.append(_level())
        return True

    def set(self, key: str, value: str | bytes) -> None:
        self.seen.append(_level())
        raise RuntimeError("Broken pipe")  # as a store whose host has gone


def test_QuietStore_raises_the_cpp_log_level_only_during_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    monkeypatch.setattr(quiet, "_LEVEL", quiet._Level())
    before = _level()
    store = _Store()
    assert quiet.QuietStore(store).check(["k"]) is True
    with pytest.raises(RuntimeError, match="Broken pipe"):  # failures are raised as before
        quiet.QuietStore(store).set("k", b"v")
    assert store.seen == [max(before, 3)] * 2
    assert _level() == before


def test_quiet_cpp_logs_nested_restores_when_the_outermost_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    monkeypatch.setattr(quiet, "_LEVEL", quiet._Level())
    before = _level()
    with quiet.quiet_cpp_logs():
        with quiet.quiet_cpp_logs():
            assert _level() == max(before, 3)
        assert _level() == max(before, 3)  # the outer block still runs
    assert _level() == before


def test_quiet_cpp_logs_leaves_a_level_the_user_set_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")  # asked for C++ logs: keep them
    monkeypatch.setattr(quiet, "_LEVEL", quiet._Level())
    before = _level()
    with quiet.quiet_cpp_logs():
        assert _level() == before
