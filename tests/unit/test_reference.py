"""docs/reference.md, the API reference, stays complete and current.

The generator is docs/apidoc.py (``make docs``). These tests fail when a public name has
no docstring or is missing from the reference, when an option of ``RpcBackendOptions`` is
not described, when ``__version__`` differs from pyproject.toml, and when the checked-in
file differs from what the generator writes today (then run ``make docs``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

import asyncrpc
from asyncrpc.errors import AsyncRpcError
from asyncrpc.protocol.options import RpcBackendOptions

ROOT = Path(__file__).resolve().parents[2]
# Errors that never reach a user: the runtime turns them into a public one first.
INTERNAL_ERRORS = {
    # becomes a FunctionNotFoundError naming the worker
    "asyncrpc.protocol.serde.reducers.MissingReferenceError",
}


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("apidoc", ROOT / "docs" / "apidoc.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


apidoc = _load_generator()


@pytest.fixture(scope="module")
def reference() -> str:
    return apidoc.REFERENCE.read_text()


def test_reference_is_current(reference: str) -> None:
    # The checked-in file is what the code gives today: else run `make docs`.
    assert apidoc.render() == reference, "docs/reference.md is stale: run `make docs`"


def test_reference_names_every_public_name(reference: str) -> None:
    missing = [
        f"{module}.{name}"
        for module in apidoc.MODULES
        for name in apidoc.public_names(module)
        if f"[`{name}`](#" not in reference
    ]
    assert not missing, f"public names missing from docs/reference.md: {missing}"
    headings = {line.lstrip("#").strip() for line in reference.splitlines() if line[:1] == "#"}
    undocumented = [e.qualname for e in _entries() if apidoc.heading(e) not in headings]
    assert not undocumented, f"public objects without an entry: {undocumented}"


def test_reference_every_public_name_has_a_docstring() -> None:
    missing = [module for module in apidoc.MODULES if not _module_doc(module)]
    for entry in _entries():
        if not (apidoc.docstring(entry.obj) or apidoc.data_doc(entry.home, entry.name)):
            missing.append(entry.qualname)
        if inspect.isclass(entry.obj) and not (
            apidoc._is_hook(entry.obj) or apidoc._is_error(entry.obj)
        ):  # the reference shows neither's members
            missing += [
                f"{entry.qualname}.{name}"
                for name, member in apidoc._members(entry.obj)
                if not apidoc.docstring(member)
            ]
    assert not missing, f"public names without a docstring: {missing}"


def test_reference_every_option_is_described(reference: str) -> None:
    described = {name for group in apidoc.option_meanings(RpcBackendOptions) for name in group}
    fields = set(apidoc.public_fields(RpcBackendOptions))
    assert fields - described == set(), "options missing from RpcBackendOptions' Attributes"
    assert described - fields == set(), "Attributes that name no option"
    table = reference.split("#### `RpcBackendOptions` fields", 1)[1].split("\n\n#", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert {name for name in fields if f"`{name}`" not in "\n".join(rows)} == set()


def test_reference_errors_a_user_can_meet_are_documented(reference: str) -> None:
    documented = {id(e.obj) for e in _entries()}
    missing = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in _defined_errors()
        if id(cls) not in documented
        and f"{cls.__module__}.{cls.__qualname__}" not in INTERNAL_ERRORS
    ]
    assert not missing, f"add them to a module's __all__ or to EXTRA_ERRORS: {missing}"


def test_reference_version_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert asyncrpc.__version__ == project["version"]


def test_reference_generator_parses_google_sections() -> None:
    doc = inspect.cleandoc(
        """Do it.

        Args:
            a: the first,
                continued.
            *args, **kwargs: the rest.

        Returns:
            What it
            made.

        Raises:
            KeyError: no such key.
            Whatever the callee raised, wrapped
            over two lines.
        """
    )
    assert apidoc.render_doc(doc) == [
        "Do it.",
        "",
        "**Args**",
        "",
        "- `a`: the first, continued.",
        "- `*args`, `**kwargs`: the rest.",
        "",
        "**Returns:** What it made.",
        "",
        "**Raises**",
        "",
        "- `KeyError`: no such key.",
        "- Whatever the callee raised, wrapped over two lines.",
    ]


def _entries() -> list[object]:
    return list(apidoc.entries().values())


def _module_doc(module: str) -> str:
    return inspect.getdoc(importlib.import_module(module)) or ""


def _defined_errors() -> list[type]:
    """Every AsyncRpcError subclass a module of the package defines (bench left out: its
    errors are the benchmark tool's own)."""
    found: list[type] = []
    for info in pkgutil.walk_packages(asyncrpc.__path__, "asyncrpc."):
        if info.name.startswith("asyncrpc.bench") or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, AsyncRpcError)
                and value.__module__ == info.name
                and getattr(module, value.__name__, None) is value
            ):
                found.append(value)
    return found
