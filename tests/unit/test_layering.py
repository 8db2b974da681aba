"""Layering checks: the sans-I/O bottom of asyncrpc imports nothing that does I/O or torch.

Walks the AST (imports inside functions included) of every module of ``asyncrpc/wire/``,
of ``asyncrpc/refcount.py`` when it exists, and of ``asyncrpc/errors.py``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

# Found by path, not by importing asyncrpc: the check must not depend on the upper layers
# importing cleanly.
PACKAGE_DIR = Path(__file__).resolve().parents[2] / "asyncrpc"
FORBIDDEN_ROOTS = frozenset({"asyncio", "socket", "threading", "selectors", "torch"})
ALLOWED_OWN = ("asyncrpc.errors", "asyncrpc.wire")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[str]:
    """Return the absolute names of every module ``source`` imports."""
    package = module if is_package else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.append(base)
            # `from asyncrpc import transport` imports the module asyncrpc.transport
            names += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    return names


def layer_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Return the imports of an L1 module that break the layering."""
    bad = []
    for name in imported_modules(source, module, is_package):
        root = name.partition(".")[0]
        if root in FORBIDDEN_ROOTS or (
            root == "asyncrpc"
            and name != "asyncrpc"
            and not any(name == ok or name.startswith(ok + ".") for ok in ALLOWED_OWN)
        ):
            bad.append(name)
    return bad


def l1_files() -> list[Path]:
    files = sorted((PACKAGE_DIR / "wire").rglob("*.py"))
    refcount = PACKAGE_DIR / "refcount.py"
    if refcount.exists():
        files.append(refcount)
    return files


@pytest.mark.parametrize("path", l1_files(), ids=module_name)
def test_layering_l1_modules_stay_sans_io(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    bad = layer_violations(source, module_name(path), path.name == "__init__.py")
    assert bad == [], f"{module_name(path)} imports {bad}"


def test_layering_errors_imports_only_the_stdlib() -> None:
    source = (PACKAGE_DIR / "errors.py").read_text(encoding="utf-8")
    roots = {name.partition(".")[0] for name in imported_modules(source, "asyncrpc.errors", False)}
    outside = roots - set(sys.stdlib_module_names) - {"__future__"}
    assert outside == set()


def test_layering_wire_package_is_checked() -> None:
    names = {module_name(p) for p in l1_files()}
    assert {"asyncrpc.wire", "asyncrpc.wire.frame"} <= names


@pytest.mark.parametrize(
    "source",
    [
        "import asyncio",
        "import torch.cuda",
        "from socket import socket",
        "import threading as t",
        "def f():\n    import selectors",
        "from asyncrpc import transport",
        "from asyncrpc.agent import Agent",
        "from .. import future",
        "from ..serde import pickler",
    ],
)
def test_layering_checker_catches_violations(source: str) -> None:
    assert layer_violations(source, "asyncrpc.wire.frame") != []


@pytest.mark.parametrize(
    "source",
    [
        "import struct\nimport msgpack",
        "from asyncrpc.errors import RemoteProtocolError",
        "from asyncrpc import errors",
        "from asyncrpc.wire.frame import Frame",
        "from . import frame",
        "from .messages import Hello",
        "from ..errors import ProtocolError",
    ],
)
def test_layering_checker_allows_clean_imports(source: str) -> None:
    assert layer_violations(source, "asyncrpc.wire.frame") == []
