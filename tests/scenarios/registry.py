"""The scenario registry and the one option parser (test layer).

``@scenario(name, option(...), ..., world_size=4)`` registers a function taking the parsed
``argparse.Namespace`` and returning an exit code. Every scenario gets the common flags
(``--init-method``, ``--name``, ``--rank``, ``--world-size``, ``--rpc-timeout``,
``--shutdown-timeout``); its own flags are declared with it, and keyword arguments
override the common flags' defaults for it alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Run = Callable[[argparse.Namespace], int]


@dataclass(frozen=True, slots=True)
class Option:
    """One ``add_argument`` call, kept until the parser is built."""

    flags: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def option(*flags: str, **kwargs: Any) -> Option:
    """A scenario-specific flag: the arguments of ``ArgumentParser.add_argument``."""
    return Option(flags, kwargs)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    run: Run
    options: tuple[Option, ...]
    defaults: dict[str, Any]
    summary: str


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, *options: Option, **defaults: Any) -> Callable[[Run], Run]:
    """Register the decorated function as scenario ``name`` (names are unique)."""

    def register(run: Run) -> Run:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} registered twice")
        summary = (run.__doc__ or "").strip().split("\n\n")[0]
        SCENARIOS[name] = Scenario(name, run, options, defaults, summary)
        return run

    return register


def _add_common(parser: argparse.ArgumentParser) -> None:
    # Added to each scenario's parser anew (not through ``parents``, whose actions are
    # shared: one scenario's ``set_defaults`` would change the others' defaults).
    parser.add_argument("--init-method", default="env://")
    parser.add_argument("--name", default="driver")
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--rpc-timeout", type=float, default=10.0)
    parser.add_argument("--shutdown-timeout", type=float, default=10.0)


def parser() -> argparse.ArgumentParser:
    """``SCENARIO [common options] [its options]`` for every registered scenario."""
    top = argparse.ArgumentParser(
        prog="python -m tests.scenarios", description="Run one integration-test scenario."
    )
    subs = top.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for entry in sorted(SCENARIOS.values(), key=lambda s: s.name):
        sub = subs.add_parser(entry.name, help=entry.summary, description=entry.summary)
        _add_common(sub)
        for extra in entry.options:
            sub.add_argument(*extra.flags, **extra.kwargs)
        sub.set_defaults(**entry.defaults)
    return top


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)
