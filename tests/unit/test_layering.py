"""Layering checks over the whole import graph of ``asyncrpc/``.

Every import counts: top-level, inside functions, and under ``if TYPE_CHECKING``. The graph
must have no circle, no module may import from a higher floor, and the sans-I/O floor
(``asyncrpc/protocol/``) imports nothing that does I/O (and ``wire/`` and ``refcount.py`` not
even torch). Modules are found by path, not by importing asyncrpc, so the check does not
depend on the upper layers importing cleanly.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "asyncrpc"

# The floors, lowest first: a module may import from its own floor or any lower one. The
# runtime (L2) has sub-floors: its base modules (futures, the thread pool, metrics), then
# shm/, net/, group/, calls/, cuda/ (hooks on the call pipeline), and at the top the agent
# that wires them. A module sits on the floor of the longest prefix that names it.
FLOORS: list[tuple[float, tuple[str, ...]]] = [
    (0, ("asyncrpc.errors", "asyncrpc.errorstate", "asyncrpc.functions")),
    (1, ("asyncrpc.protocol",)),
    (2.0, ("asyncrpc.runtime",)),
    # Threads and the hand-offs between them, then the futures that cross them.
    (2.01, ("asyncrpc.runtime.threads",)),
    (2.02, ("asyncrpc.runtime.futures",)),
    # The narrow ports parts are built from (Loop, Frames, Calls, ForkLedger).
    (2.03, ("asyncrpc.runtime.ports",)),
    (2.1, ("asyncrpc.runtime.shm",)),
    (2.2, ("asyncrpc.runtime.net",)),
    (2.3, ("asyncrpc.runtime.group",)),
    (2.4, ("asyncrpc.runtime.calls",)),
    # The one shape of a feature (its hooks are the call pipeline's).
    (2.41, ("asyncrpc.runtime.feature",)),
    # Streaming calls, one room above the calls they are made of.
    (2.42, ("asyncrpc.runtime.calls.streams",)),
    # The CUDA path plugs into the call pipeline as hooks (device maps, the send gate).
    (2.45, ("asyncrpc.runtime.cuda",)),
    # Lanes: calling threads' own connections; their server hands requests to the dispatcher.
    (2.46, ("asyncrpc.runtime.lanes",)),
    (2.5, ("asyncrpc.runtime.agent", "asyncrpc.runtime.current")),
    (
        3,
        (
            "asyncrpc.rref",
            "asyncrpc.profiling",
            "asyncrpc.autograd",
            "asyncrpc.observe",
            "asyncrpc.duplex",
        ),
    ),
    (
        4,
        (
            "asyncrpc.api",
            "asyncrpc.metrics",
            "asyncrpc.top",
            "asyncrpc.streaming",
            "asyncrpc.optim",
            "asyncrpc.nn",
            "asyncrpc.testing",
            "asyncrpc.bench",
            "asyncrpc",
        ),
    ),
]
NO_IO = frozenset({"asyncio", "socket", "threading", "selectors", "concurrent"})
NO_IO_OR_TORCH = NO_IO | {"torch"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def imported_modules(source: str, module: str, is_package: bool) -> list[str]:
    """Return the absolute names of every module ``source`` imports (or may import)."""
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
            # `from asyncrpc.runtime import agent` imports the module asyncrpc.runtime.agent
            names += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    return names


def floor_of(module: str) -> float:
    best, floor_found = "", FLOORS[-1][0]  # the package itself and anything unplaced: the top
    for floor, prefixes in FLOORS:
        for p in prefixes:
            named = p != "asyncrpc" and (module == p or module.startswith(p + "."))
            if named and len(p) > len(best):
                best, floor_found = p, floor
    return floor_found


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Edges between the modules of ``sources`` (name -> (source, is_package))."""
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        targets = set(imported_modules(source, module, is_package)) & sources.keys()
        graph[module] = targets - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{m} (floor {floor_of(m)}) imports {t} (floor {floor_of(t)})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if floor_of(t) > floor_of(m)
    ]


def package_sources() -> dict[str, tuple[str, bool]]:
    return {
        name: (path.read_text(encoding="utf-8"), path.name == "__init__.py")
        for name, path in all_modules().items()
    }


# -- the real package ------------------------------------------------------------------------


def test_layering_import_graph_has_no_circle() -> None:
    assert circles(import_graph(package_sources())) == []


def test_layering_imports_point_down() -> None:
    assert upward_imports(import_graph(package_sources())) == []


def test_layering_every_module_is_on_a_floor() -> None:
    top_level = {m for m in all_modules() if m.count(".") == 1}
    placed = {p for _, prefixes in FLOORS for p in prefixes}
    loose = {m for m in top_level if not any(m == p or m.startswith(p + ".") for p in placed)}
    assert loose == set(), f"place these modules in a floor folder: {loose}"


def test_layering_runtime_keeps_its_rooms() -> None:
    # The runtime's features have rooms (threads/, futures/, calls/streams/, ...): at most
    # ten modules sit loose beside the agent, so the folders stay the map of the floor.
    loose = sorted(
        p.name for p in (PACKAGE_DIR / "runtime").glob("*.py") if p.name != "__init__.py"
    )
    assert len(loose) <= 10, loose


def test_layering_features_never_reach_the_agent() -> None:
    # Features are built from the agent's ports and found through a FeatureSlot: none of
    # the floor above imports the composition root, and only the public API (api.py and
    # its monitoring half, metrics/snapshot.py) and the one accessor (runtime/current.py)
    # ask for the current agent.
    graph = import_graph(package_sources())
    upper = ("asyncrpc.rref", "asyncrpc.autograd", "asyncrpc.profiling")
    reaching = [
        m
        for m, targets in graph.items()
        if m.startswith(upper) and "asyncrpc.runtime.agent" in targets
    ]
    assert reaching == []
    callers = sorted(
        module_name(path)
        for path in PACKAGE_DIR.rglob("*.py")
        if "current_agent()" in path.read_text(encoding="utf-8")
    )
    assert callers == ["asyncrpc.api", "asyncrpc.metrics.snapshot", "asyncrpc.runtime.current"]


def host_protocols(source: str) -> list[str]:
    """Classes of ``source`` named ``*Host`` that are ``Protocol``s: mirrors of a part's
    owner, handed whole where a part should take named ports."""
    return [
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
        and node.name.endswith("Host")
        and any(ast.unparse(base).endswith("Protocol") for base in node.bases)
    ]


def future_private_reaches(source: str, private: set[str]) -> list[str]:
    """Attributes of ``private`` (``Future``'s private methods) that ``source`` reads, but
    not those it defines itself (another class's method of the same name)."""
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return sorted(
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & (private - own)
    )


def future_private_methods() -> set[str]:
    tree = ast.parse((PACKAGE_DIR / "runtime" / "futures" / "core.py").read_text("utf-8"))
    (future,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Future"]
    return {
        n.name
        for n in future.body
        if isinstance(n, ast.FunctionDef) and n.name.startswith("_") and not n.name.endswith("__")
    }


def test_layering_no_host_mirrors_the_agent() -> None:
    # Parts take the few ports they use; the one host left is what a pool thread's owner
    # hears of its blocking waits.
    hosts = sorted(
        f"{module}.{name}"
        for module, (source, _) in package_sources().items()
        for name in host_protocols(source)
    )
    assert hosts == ["asyncrpc.runtime.threads.blocking.BlockingHost"]


def test_layering_only_the_futures_room_reaches_into_a_future() -> None:
    # Outside runtime/futures/, the runtime completes and chains futures through the
    # package-private helpers of futures/future.py (CPython's _get_loop, ...).
    private = future_private_methods()
    assert {"_try_set_result", "_add_hook", "_then"} <= private
    reaching = {
        module: found
        for module, (source, _) in package_sources().items()
        if not module.startswith("asyncrpc.runtime.futures")
        and (found := future_private_reaches(source, private))
    }
    assert reaching == {}


def _stray_imports(path: Path, forbidden: Iterable[str]) -> list[str]:
    name = module_name(path)
    names = imported_modules(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
    return [n for n in names if n.partition(".")[0] in set(forbidden)]


@pytest.mark.parametrize("path", sorted((PACKAGE_DIR / "protocol").rglob("*.py")), ids=module_name)
def test_layering_protocol_is_sans_io(path: Path) -> None:
    pure = "serde" not in path.parts  # serde builds tensors; wire and refcount not even that
    assert _stray_imports(path, NO_IO_OR_TORCH if pure else NO_IO) == []


@pytest.mark.parametrize("module", ["errors", "errorstate"])
def test_layering_errors_imports_only_the_stdlib(module: str) -> None:
    source = (PACKAGE_DIR / f"{module}.py").read_text(encoding="utf-8")
    names = imported_modules(source, f"asyncrpc.{module}", False)
    # errors builds on errorstate, which is held to the same rule
    roots = {n.partition(".")[0] for n in names if not n.startswith("asyncrpc.errorstate")}
    outside = roots - set(sys.stdlib_module_names) - {"__future__"}
    assert outside == set()


def test_layering_protocol_floor_is_checked() -> None:
    names = set(all_modules())
    assert {
        "asyncrpc.protocol.wire.frame",
        "asyncrpc.protocol.refcount",
        "asyncrpc.protocol.refmessages",
    } <= names


# -- the checker itself ----------------------------------------------------------------------


def test_layering_checker_finds_a_type_checking_circle() -> None:
    graph = import_graph(
        {
            "asyncrpc.runtime.agent": ("from asyncrpc.runtime.calls import dispatch", False),
            "asyncrpc.runtime.calls.dispatch": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from asyncrpc.runtime.agent import Agent",
                False,
            ),
            "asyncrpc.runtime.net.peers": ("import asyncrpc.runtime.agent", False),
        }
    )
    assert circles(graph) == [["asyncrpc.runtime.agent", "asyncrpc.runtime.calls.dispatch"]]


def test_layering_checker_finds_a_long_circle_made_in_a_function() -> None:
    graph = import_graph(
        {
            "asyncrpc.rref.a": ("from asyncrpc.rref import b", False),
            "asyncrpc.rref.b": ("from asyncrpc.rref.c import x", False),
            "asyncrpc.rref.c": ("def f():\n    from . import a", False),
        }
    )
    assert circles(graph) == [["asyncrpc.rref.a", "asyncrpc.rref.b", "asyncrpc.rref.c"]]


def test_layering_checker_passes_a_tree() -> None:
    graph = import_graph(
        {
            "asyncrpc.api": ("from asyncrpc.runtime import agent", False),
            "asyncrpc.runtime.agent": ("from asyncrpc.protocol import wire", False),
            "asyncrpc.protocol.wire": ("from asyncrpc.errors import X", True),
            "asyncrpc.errors": ("import pickle", False),
        }
    )
    assert circles(graph) == []
    assert upward_imports(graph) == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("asyncrpc.protocol.wire.frame", "from asyncrpc.runtime.net import transport"),
        ("asyncrpc.protocol.serde.pickler", "from asyncrpc.rref.handle import RRef"),
        ("asyncrpc.runtime.calls.dispatch", "from asyncrpc.rref import context"),
        ("asyncrpc.runtime.agent", "def f():\n    import asyncrpc.api"),
        ("asyncrpc.errors", "from .protocol import wire"),
        ("asyncrpc.runtime.net.links", "from asyncrpc.runtime.calls import pending"),
        ("asyncrpc.runtime.net.peers", "from asyncrpc.runtime.group.shutdown import x"),
        ("asyncrpc.runtime.calls.dispatch", "from asyncrpc.runtime.agent import Agent"),
        ("asyncrpc.runtime.futures", "from asyncrpc.runtime.shm import shm"),
    ],
)
def test_layering_checker_catches_an_upward_import(module: str, source: str) -> None:
    graph = import_graph(
        {
            **dict.fromkeys(
                (
                    "asyncrpc.runtime.net.transport",
                    "asyncrpc.rref.handle",
                    "asyncrpc.rref.context",
                    "asyncrpc.api",
                    "asyncrpc.protocol.wire",
                    "asyncrpc.runtime.calls.pending",
                    "asyncrpc.runtime.group.shutdown",
                    "asyncrpc.runtime.agent",
                    "asyncrpc.runtime.shm.shm",
                ),
                ("", False),
            ),
            module: (source, False),
        }
    )
    assert upward_imports(graph) != []


@pytest.mark.parametrize(
    "source",
    ["import asyncio", "import torch.cuda", "from socket import socket", "import threading as t"],
)
def test_layering_checker_catches_io_in_the_protocol(source: str) -> None:
    path = PACKAGE_DIR / "protocol" / "wire" / "_probe.py"
    names = imported_modules(source, module_name(path), False)
    assert any(n.partition(".")[0] in NO_IO_OR_TORCH for n in names)


def test_layering_checker_finds_a_host_protocol() -> None:
    source = "class StreamHost(Protocol): ...\nclass PlainHost: ...\n"
    source += "class LinkHost(typing.Protocol): ..."
    assert host_protocols(source) == ["StreamHost", "LinkHost"]


def test_layering_checker_finds_a_reach_into_a_future() -> None:
    private = {"_try_set_result", "_invoke"}
    reach = "def f(fut):\n    fut._try_set_result(1)\n    proxy._invoke()"
    assert future_private_reaches(reach, private) == ["_invoke", "_try_set_result"]
    # a module's own method of that name is not a reach into the future
    own = "class P:\n    def _invoke(self): ...\ndef g(p):\n    p._invoke()"
    assert future_private_reaches(own, private) == []
