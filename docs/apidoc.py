"""Writes docs/reference.md, the API reference, from the docstrings (a repository tool).

``python docs/apidoc.py`` (``make docs``) rewrites the file; ``--check`` exits 1 when the
file on disk differs from what the code gives. Only the standard library's ``inspect`` and
``ast`` read the code: no documentation package is needed, so the check runs in the CI
venv (``tests/unit/test_reference.py``). Docstrings are Google style: the ``Args``,
``Returns``, ``Yields``, ``Raises`` and ``Attributes`` sections become lists, and the
``Attributes`` of ``RpcBackendOptions`` become the table of every option.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"

# The public modules, in the order the reference shows them.
MODULES = [
    "asyncrpc",
    "asyncrpc.functions",
    "asyncrpc.autograd",
    "asyncrpc.optim",
    "asyncrpc.nn",
    "asyncrpc.streaming",
    "asyncrpc.profiling",
    "asyncrpc.metrics",
    "asyncrpc.testing",
    "asyncrpc.errors",
]
# Where a name exported by several modules is described in full: the first of these that
# exports it (the others link there). Exceptions live with the error tree.
HOME_ORDER = ["asyncrpc.errors", *(name for name in MODULES if name != "asyncrpc.errors")]
# Public names outside __all__ (dunders are not star-exported).
EXTRA_NAMES = {"asyncrpc": ["__version__"]}
# Exceptions a user can meet that are defined beside the code raising them, not in
# asyncrpc.errors (which must stay free of the layers above it), by import path.
EXTRA_ERRORS = {
    "FutureNotDoneError": "asyncrpc.runtime.futures",
    "FutureAlreadyDoneError": "asyncrpc.runtime.futures",
    "DeviceMapError": "asyncrpc.runtime.cuda.maps",
    "StreamPoolExhaustedError": "asyncrpc.runtime.cuda.pool",
}
# Classes users get from a function and never build themselves: no constructor shown.
MADE_FOR_YOU = {"asyncrpc.runtime.calls.streams.stream.Stream"}

SECTIONS = ("Args", "Returns", "Yields", "Raises", "Attributes")
_ITEM = re.compile(r"^(?P<name>\*{0,2}[A-Za-z_][\w.]*(?:, \*{0,2}[A-Za-z_][\w.]*)*)"
                   r"(?: \((?P<type>[^)]*)\))?: (?P<text>.*)$")  # fmt: skip
_LAYER = re.compile(r"\s*\((?:layer )?L\d[^)]*\)")
_SIGNATURE_WIDTH = 88


@dataclasses.dataclass(frozen=True)
class Entry:
    """One public object and the names it is known by."""

    home: str  # module whose section describes it
    name: str  # its name there
    obj: Any

    @property
    def qualname(self) -> str:
        return f"{self.home}.{self.name}"


# -- finding the public objects ----------------------------------------------------------


def public_names(module: str) -> list[str]:
    """The names a module makes public: its ``__all__`` and the extra dunders."""
    mod = importlib.import_module(module)
    return [*EXTRA_NAMES.get(module, []), *sorted(mod.__all__, key=_sort_key)]


def _sort_key(name: str) -> tuple[bool, str]:
    return (name[:1].islower(), name.lower())  # classes and constants first, then functions


@functools.cache
def entries() -> dict[int, Entry]:
    """Every public object, once, by ``id``, with the module that describes it."""
    found: dict[int, Entry] = {}
    for module in HOME_ORDER:
        mod = importlib.import_module(module)
        for name in public_names(module):
            obj = getattr(mod, name)
            if inspect.ismodule(obj):
                continue  # a public submodule has a section of its own
            seen = found.get(id(obj))
            # An alias (PyRRef = RRef) is described under the object's own name.
            if seen is None or (seen.home == module and name == getattr(obj, "__name__", "")):
                found[id(obj)] = Entry(module, name, obj)
    for name, module in EXTRA_ERRORS.items():
        obj = getattr(importlib.import_module(module), name)
        found.setdefault(id(obj), Entry(module, name, obj))
    return found


def all_errors() -> list[Entry]:
    """The exception classes of the reference, in the order of the error tree."""
    return [e for e in entries().values() if _is_error(e.obj)]


def _is_error(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, BaseException)


# -- names and links ------------------------------------------------------------------------


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def heading(entry: Entry) -> str:
    obj = entry.obj
    if _is_error(obj):
        return f"exception `{entry.qualname}`"
    if inspect.isclass(obj):
        return f"class `{entry.qualname}`"
    if callable(obj):
        return f"`{entry.qualname}()`"
    return f"`{entry.qualname}`"


def link(entry: Entry, text: str | None = None) -> str:
    return f"[`{text or entry.name}`](#{slug(heading(entry))})"


def md(text: str) -> str:
    """Docstring text as Markdown: ``code`` -> `code`; layer tags dropped."""
    return _LAYER.sub("", text).replace("``", "`")


def first_sentence(doc: str) -> str:
    para = " ".join(doc.split("\n\n", 1)[0].split())
    match = re.match(r"(.+?\.)(\s|$)", para)
    return md(match.group(1) if match else para)


def docstring(obj: Any) -> str:
    """The object's own docstring, cleaned ("" for none: nothing inherited from a base,
    and not the signature a dataclass makes up when it has none)."""
    if not (inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj, property)):
        return ""
    doc = obj.__doc__
    if not isinstance(doc, str) or (inspect.isclass(obj) and doc.startswith(obj.__name__ + "(")):
        return ""
    return inspect.cleandoc(doc)


def data_doc(module: str, name: str) -> str:
    """The docstring of a module-level constant: a string literal right after it."""
    for mod_name in sorted(m for m in sys.modules if m == "asyncrpc" or m.startswith("asyncrpc.")):
        source = inspect.getsource(sys.modules[mod_name]) if _has_source(mod_name) else ""
        if f"{name} =" not in source:
            continue
        body = ast.parse(source).body
        for node, after in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(node, ast.Assign | ast.AnnAssign)
                and _assigns(node, name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
            ):
                return inspect.cleandoc(str(after.value.value))
    return ""


def _has_source(module: str) -> bool:
    return getattr(sys.modules[module], "__file__", None) is not None


def _assigns(node: ast.Assign | ast.AnnAssign, name: str) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


# -- docstrings as Markdown -----------------------------------------------------------------


def parse(doc: str) -> list[tuple[str, list[str]]]:
    """Split a Google-style docstring into blocks, in order: ("", its lines) for prose,
    (section title, its items) for ``Args:`` and the other sections.

    An item is one line at the section's indent with its deeper-indented continuation
    lines joined to it; a line at the docstring's own indent ends the section.
    """
    blocks: list[tuple[str, list[str]]] = []
    for line in doc.splitlines():
        bare, title = line.strip(), blocks[-1][0] if blocks else ""
        if bare.endswith(":") and bare[:-1] in SECTIONS and not line.startswith(" "):
            blocks.append((bare[:-1], []))
        elif title and line.startswith("    ") and _continues(blocks[-1][1], line):
            blocks[-1][1][-1] += " " + bare
        elif title and (line.startswith("    ") or not bare):
            blocks[-1][1].extend([bare] if bare else [])
        elif title or not blocks:
            blocks.append(("", [line]))
        else:
            blocks[-1][1].append(line)
    return blocks


def _continues(items: list[str], line: str) -> bool:
    """Whether a section's line continues its last item: indented deeper than the items,
    or free text (no "name: text") after an item of free text: a sentence wrapped at the
    items' own indent."""
    if not items:
        return False
    if line.startswith("        "):
        return True
    return _ITEM.match(items[-1]) is None and _ITEM.match(line.strip()) is None


def sections(doc: str) -> dict[str, list[str]]:
    """A docstring's sections by title (``Args``...), each a list of items."""
    return {title: items for title, items in parse(doc) if title}


def render_doc(doc: str, skip: tuple[str, ...] = ()) -> list[str]:
    out: list[str] = []
    for title, lines in parse(doc):
        if not title:
            out += ["", *(md(line) for line in _trim(lines))]
        elif title in ("Returns", "Yields"):
            out += ["", f"**{title}:** {md(' '.join(lines))}"]
        elif title not in skip:
            out += ["", f"**{title}**", "", *(_item(item) for item in lines)]
    return _trim(out)


def _trim(lines: list[str]) -> list[str]:
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text).splitlines() if text else []


def _item(text: str) -> str:
    match = _ITEM.match(text)
    if match is None:
        return f"- {md(text)}"
    names = ", ".join(f"`{n}`" for n in match["name"].split(", "))
    kind = f" ({md(match['type'])})" if match["type"] else ""
    return f"- {names}{kind}: {md(match['text'])}"


def signature(name: str, obj: Any, method: bool = False) -> list[str]:
    """The call signature as a ``text`` block, one parameter per line when long.

    A method's first parameter (``self``, ``cls``) is left out, and so are the private
    fields of a dataclass (not meant to be passed).
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    private = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    kept = list(sig.parameters.values())[1 if method else 0 :]
    sig = sig.replace(parameters=[p for p in kept if not (p.name in private and p.name[0] == "_")])
    params = _parameters(sig)
    if inspect.isclass(obj):
        returns = ""
    else:
        empty = sig.return_annotation is sig.empty
        returns = "" if empty else f" -> {_annotation(sig.return_annotation)}"
    one_line = f"{name}({', '.join(params)}){returns}"
    if " at 0x" in one_line:
        raise ValueError(f"{name}: a default has no stable text: {one_line}")
    if len(one_line) <= _SIGNATURE_WIDTH:
        return ["```text", one_line, "```"]
    return ["```text", f"{name}(", *(f"    {p}," for p in params), f"){returns}", "```"]


def _annotation(annotation: Any) -> str:
    # With ``from __future__ import annotations`` every annotation is its source text.
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _parameter(param: inspect.Parameter) -> str:
    text = param.name
    if param.kind is param.VAR_POSITIONAL:
        text = "*" + text
    elif param.kind is param.VAR_KEYWORD:
        text = "**" + text
    if param.annotation is not param.empty:
        text += f": {_annotation(param.annotation)}"
    if param.default is not param.empty:
        text += (" = " if param.annotation is not param.empty else "=") + repr(param.default)
    return text


def _parameters(sig: inspect.Signature) -> list[str]:
    """Each parameter's text, with the ``/`` and ``*`` markers ``str(sig)`` would show."""
    kinds = inspect.Parameter
    params = list(sig.parameters.values())
    out: list[str] = []
    for index, param in enumerate(params):
        before = params[index - 1].kind if index else None
        if before is kinds.POSITIONAL_ONLY and param.kind is not kinds.POSITIONAL_ONLY:
            out.append("/")
        if param.kind is kinds.KEYWORD_ONLY and before not in (
            kinds.KEYWORD_ONLY,
            kinds.VAR_POSITIONAL,
        ):
            out.append("*")
        out.append(_parameter(param))
    if params and params[-1].kind is kinds.POSITIONAL_ONLY:
        out.append("/")
    return out


# -- one entry ------------------------------------------------------------------------------


def render_entry(entry: Entry) -> list[str]:
    obj = entry.obj
    out = [f"### {heading(entry)}", ""]
    if inspect.isclass(obj):
        out += _render_class(entry)
    elif callable(obj):
        out += [*signature(entry.name, obj), "", *render_doc(docstring(obj))]
    else:
        out += ["```text", f"{entry.name} = {obj!r}", "```", "", *render_doc(_data_doc(entry))]
    return [*_trim(out), ""]


def _data_doc(entry: Entry) -> str:
    return data_doc(entry.home, entry.name) or (docstring(entry.obj) if callable(entry.obj) else "")


def _render_class(entry: Entry) -> list[str]:
    cls = entry.obj
    out: list[str] = []
    bases = _bases(cls)
    if bases:
        out += [f"Bases: {', '.join(bases)}", ""]
    made_for_you = f"{cls.__module__}.{cls.__qualname__}" in MADE_FOR_YOU
    # An error's constructor is shown when it has its own: its arguments are the fields
    # it carries (``e.worker``, ``e.timeout``...).
    own_init = "__init__" in vars(cls)
    if not (made_for_you or isinstance(cls, enum.EnumMeta) or (_is_error(cls) and not own_init)):
        out += [*signature(entry.name, cls), ""]
    is_options = dataclasses.is_dataclass(cls) and "Attributes" in sections(docstring(cls))
    out += render_doc(docstring(cls), skip=("Attributes",) if is_options else ())
    init = vars(cls).get("__init__")
    if not _is_error(cls) and not made_for_you and init is not None and docstring(init):
        out += ["", *render_doc(docstring(init))]  # the constructor's own arguments
    if isinstance(cls, enum.EnumMeta):
        out += ["", "Members: " + ", ".join(f"`{m.name}`" for m in cls)]  # type: ignore[var-annotated]
    if is_options:
        out += ["", f"#### `{cls.__name__}` fields", "", *options_table(cls)]
    if not _is_error(cls) and not _is_hook(cls):
        out += _render_members(cls)
    return out


def _bases(cls: type) -> list[str]:
    known = {id(e.obj): e for e in entries().values()}
    names: list[str] = []
    for base in cls.__bases__:
        if id(base) in known:
            names.append(link(known[id(base)]))
        elif base.__module__ == "builtins" and base is not object:
            names.append(f"`{base.__name__}`")
        elif base.__module__.startswith("torch"):
            names.append(f"`{_torch_name(base)}`")
    return names


def _torch_name(cls: type) -> str:
    import torch

    public = {torch.futures.Future: "torch.futures.Future", torch.nn.Module: "torch.nn.Module"}
    return public.get(cls, f"{cls.__module__}.{cls.__qualname__}")


def _is_hook(cls: type) -> bool:
    from asyncrpc.runtime.calls.pipeline import CallHook

    return issubclass(cls, CallHook)


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties a class defines itself, in source order."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        target = value.__func__ if isinstance(value, staticmethod | classmethod) else value
        if inspect.isfunction(target) or isinstance(target, property):
            yield name, target


def _render_members(cls: type) -> list[str]:
    out: list[str] = []
    refused: dict[str, list[str]] = {}  # what each says, "it" for its name -> names
    for name, member in _members(cls):
        qualname = f"{cls.__name__}.{name}"
        if isinstance(member, property):
            returns = inspect.signature(member.fget).return_annotation  # type: ignore[arg-type]
            out += ["", f"#### `{qualname}` (property): `{returns}`", ""]
        elif inspect.signature(member).return_annotation == "NoReturn":
            said = first_sentence(docstring(member)).replace(f"`{name}`", "it")
            refused.setdefault(said, []).append(f"`{name}`")
            continue
        else:
            method = not isinstance(vars(cls)[name], staticmethod)
            out += ["", f"#### `{qualname}()`", "", *signature(name, member, method), ""]
        out += render_doc(docstring(member))
    if refused:
        out += ["", f"#### Methods `{cls.__name__}` refuses", ""]
        out += [f"- {', '.join(names)}: {said}" for said, names in refused.items()]
    return out


# -- the options table ----------------------------------------------------------------------


def options_table(cls: type) -> list[str]:
    """One row per field of an options dataclass: type, default and its Attributes text."""
    meanings = option_meanings(cls)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for group, text in _option_groups(cls, meanings):
        fields = [f for f in dataclasses.fields(cls) if f.name in group]
        types = {str(f.type) for f in fields}
        defaults = {_default(f) for f in fields}
        names = ", ".join(f"`{f.name}`" for f in fields)
        if len(types) == 1 and len(defaults) == 1:
            rows.append(f"| {names} | `{types.pop()}` | {defaults.pop()} | {_cell(text)} |")
        else:
            rows += [f"| `{f.name}` | `{f.type}` | {_default(f)} | {_cell(text)} |" for f in fields]
    return rows


def option_meanings(cls: type) -> dict[tuple[str, ...], str]:
    """The ``Attributes`` section of ``cls``: (field names) -> meaning."""
    items = sections(docstring(cls)).get("Attributes", [])
    meanings: dict[tuple[str, ...], str] = {}
    for item in items:
        match = _ITEM.match(item)
        if match is not None:
            meanings[tuple(match["name"].split(", "))] = match["text"]
    return meanings


def public_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def _option_groups(
    cls: type, meanings: dict[tuple[str, ...], str]
) -> Iterator[tuple[tuple[str, ...], str]]:
    seen: set[tuple[str, ...]] = set()
    for name in public_fields(cls):
        group = next((g for g in meanings if name in g), (name,))
        if group not in seen:
            seen.add(group)
            yield group, meanings.get(group, "")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return "(required)" if f.default_factory is dataclasses.MISSING else "`{}`"
    value = f.default
    if type(value) is int and value >= 1 << 16 and value % 1024 == 0:
        return f"`{value}` ({_bytes(value)})"
    return f"`{value!r}`"


def _bytes(value: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        size = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[unit]
        if value % size == 0:
            return f"{value // size} {unit}"
    return f"{value} B"


def _cell(text: str) -> str:
    return md(text).replace("|", "\\|")


# -- modules and the file -------------------------------------------------------------------


def render_module(module: str, homes: dict[str, list[Entry]]) -> list[str]:
    mod = importlib.import_module(module)
    doc = inspect.getdoc(mod) or ""
    out = [f"## `{module}`", "", md(" ".join(doc.split("\n\n", 1)[0].split())), ""]
    out += ["| name | |", "|---|---|"]
    known = {id(e.obj): e for e in entries().values()}
    errors = [
        known[id(getattr(mod, n))] for n in public_names(module) if _is_error(getattr(mod, n))
    ]
    for name in public_names(module):
        obj = getattr(mod, name)
        if _is_error(obj) and module != "asyncrpc.errors":
            continue  # one row for them all, below
        if inspect.ismodule(obj):
            summary = first_sentence(inspect.getdoc(obj) or "")
            out.append(f"| [`{name}`](#{slug(f'`{obj.__name__}`')}) | module: {_cell(summary)} |")
            continue
        entry = known[id(obj)]
        summary = first_sentence(docstring(obj) or _data_doc(entry))
        alias = f" (the same as `{entry.qualname}`)" if entry.name != name else ""
        out.append(f"| {link(entry, name)} | {_cell(summary)}{alias} |")
    if errors and module != "asyncrpc.errors":
        out.append(f"| exceptions | {', '.join(link(e, e.name) for e in errors)} |")
    if module == "asyncrpc.errors":
        out += ["", "The tree (builtin bases in brackets):", "", *error_tree()]
    for entry in homes.get(module, []):
        out += ["", *render_entry(entry)]
    return out


def error_tree() -> list[str]:
    from asyncrpc.errors import AsyncRpcError

    errors = {e.obj: e for e in all_errors()}
    lines = ["```text"]

    def walk(cls: type, depth: int) -> None:
        builtin = [b.__name__ for b in cls.__bases__ if b.__module__ == "builtins"]
        extra = f" [{', '.join(builtin)}]" if builtin else ""
        where = errors[cls].home if cls in errors else cls.__module__
        lines.append(f"{'    ' * depth}{cls.__name__}{extra}  ({where})")
        subclasses: list[type] = cls.__subclasses__()
        for sub in sorted(subclasses, key=lambda c: c.__name__):
            if sub in errors and sub.__bases__[0] is cls:
                walk(sub, depth + 1)

    walk(AsyncRpcError, 0)
    return [*lines, "```"]


def render() -> str:
    """The whole reference, as Markdown."""
    import asyncrpc

    homes: dict[str, list[Entry]] = {}
    for entry in entries().values():  # EXTRA_ERRORS are described beside the others
        homes.setdefault(entry.home if entry.home in MODULES else "asyncrpc.errors", []).append(
            entry
        )
    out = [
        "# API reference",
        "",
        "<!-- Generated by `make docs` (docs/apidoc.py) from the docstrings: edit those. -->",
        "",
        f"asyncrpc {asyncrpc.__version__}: every public name, with its signature and defaults,",
        "what it returns and what it raises. The options of a worker are in",
        "[`RpcBackendOptions` fields](#rpcbackendoptions-fields); the exception tree is under",
        "[`asyncrpc.errors`](#asyncrpcerrors). `make docs` writes this file from the",
        "docstrings, and `make test` fails when it is stale or a public name has no docstring.",
        "",
        *(f"- [`{m}`](#{slug(f'`{m}`')}): {first_sentence(_module_doc(m))}" for m in MODULES),
    ]
    for module in MODULES:
        out += ["", *render_module(module, homes)]
    anchors = [slug(line.lstrip("#")) for line in out if line.startswith("#")]
    duplicates = sorted({a for a in anchors if anchors.count(a) > 1})
    if duplicates:
        raise ValueError(f"headings with the same anchor: {duplicates}")
    return "\n".join(_trim(out)) + "\n"


def _module_doc(module: str) -> str:
    return inspect.getdoc(importlib.import_module(module)) or ""


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if REFERENCE.read_text() != text:
            print(f"{REFERENCE.relative_to(ROOT)} is stale: run `make docs`", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
