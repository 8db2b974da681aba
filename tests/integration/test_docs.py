"""Every ```python block of README.md and docs/*.md runs, against real workers.

A block is a whole program unless the HTML comment on the line before it says otherwise:

- no comment, or ``<!-- doc-test: program NAME -->``: a complete program. It is written to
  a file of its own and run as ``python FILE`` in a fresh directory, as a reader runs it,
  with ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` set to a free port (torch's ``env://``
  variables, which the programs read with a default), and must exit 0. A program that
  needs several workers starts them itself, as its text shows.
- ``<!-- doc-test: excerpt NAME (why) -->``: lines quoted from program NAME elsewhere in
  the docs; each of its lines must be a line of that program (which runs).
- ``<!-- doc-test: skip (why) -->``: a fragment that cannot run alone; the reason is shown
  in the skip.

Blocks inside a ``>`` quote count too. The programs run ``AT_ONCE`` at a time, each
bounded by ``RUN_TIMEOUT``; each program's process group, its workers included, is killed
in ``finally``. (All at once, some forty processes started together on two cores, each
importing torch: a worker starved of the CPU for seconds was declared lost by its peers,
the false loss its heartbeat is meant to allow for under load, not a program's fault.)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncrpc.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_TIMEOUT = 90.0
AT_ONCE = 4  # programs running at a time (each starts two to four processes)
pytestmark = pytest.mark.timeout(240)

_FENCE = re.compile(r"^(?P<quote>>?\s?)```(?P<lang>\S*)\s*$")
_DIRECTIVE = re.compile(r"^>?\s*<!--\s*doc-test:\s*(?P<kind>[a-z]+)\s*(?P<arg>.*?)\s*-->\s*$")
_KINDS = ("program", "excerpt", "skip")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int  # 1-based line of its opening fence
    lang: str
    code: str
    kind: str  # "program", "excerpt" or "skip"
    arg: str  # the program's name, the excerpt's program and reason, or the skip's reason

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def name(self) -> str:
        return self.arg.split()[0] if self.arg else ""


def _blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        start, quote = index, fence["quote"]
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].strip() not in ("```", "> ```", ">```"):
            body.append(lines[index].removeprefix(quote) if quote else lines[index])
            index += 1
        previous = lines[start - 1] if start else ""
        directive = _DIRECTIVE.match(previous)
        kind, arg = (directive["kind"], directive["arg"]) if directive else ("program", "")
        yield Block(path, start + 1, fence["lang"], "\n".join(body) + "\n", kind, arg)
        index += 1


ALL = [block for path in DOCS for block in _blocks(path)]
PYTHON = [block for block in ALL if block.lang == "python"]
PROGRAMS = [block for block in PYTHON if block.kind == "program"]


@dataclass
class Outcome:
    code: int | None
    output: str
    seconds: float


def _kill_group(proc: subprocess.Popen[str]) -> None:
    # The group is the program's own session (start_new_session): it and the workers it
    # started, nothing else.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Run every program, ``AT_ONCE`` at a time; each one's exit code and output, by id."""
    waiting = list(enumerate(PROGRAMS))
    running: dict[str, tuple[subprocess.Popen[str], float, Path]] = {}
    results: dict[str, Outcome] = {}
    try:
        # Bounded: each program ends or is killed within RUN_TIMEOUT of its start.
        while waiting or running:
            while waiting and len(running) < AT_ONCE:
                number, block = waiting.pop(0)
                running[block.id] = _start(block, tmp_path_factory.mktemp(f"doc{number}"))
            for block_id, (proc, started, log) in list(running.items()):
                late = time.monotonic() - started > RUN_TIMEOUT
                if proc.poll() is None and not late:
                    continue
                suffix = ""
                if proc.poll() is None:
                    _kill_group(proc)
                    proc.wait(10)
                    suffix = f"\n[killed after {RUN_TIMEOUT:g} s]"
                output = log.read_text(errors="replace") + suffix
                results[block_id] = Outcome(proc.returncode, output, time.monotonic() - started)
                del running[block_id]
            time.sleep(0.05)
    finally:
        for proc, _, _ in running.values():
            _kill_group(proc)
            if proc.poll() is None:
                proc.wait(10)
    return results


def _start(block: Block, workdir: Path) -> tuple[subprocess.Popen[str], float, Path]:
    """Start ``block``'s program in ``workdir``; its process, start time and output file."""
    script = workdir / f"{block.name or 'program'}.py"
    script.write_text(block.code)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log = workdir / "output.txt"
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, script.name], cwd=workdir, env=env, text=True, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return proc, time.monotonic(), log


def test_docs_blocks_found() -> None:
    names = [block.name for block in PROGRAMS if block.name]
    assert len(names) == len(set(names)), "program names must be unique"
    assert {block.path.name for block in PROGRAMS} >= {"README.md"}
    assert len(PROGRAMS) >= 4


@pytest.mark.parametrize("block", ALL, ids=[block.id for block in ALL])
def test_docs_block_names_its_language(block: Block) -> None:
    # An untagged block could hide Python from these tests: say ```bash, ```text...
    assert block.lang, f"{block.id}: the fence names no language"
    assert block.kind in _KINDS, f"{block.id}: unknown doc-test directive {block.kind!r}"


@pytest.mark.parametrize("block", PROGRAMS, ids=[block.id for block in PROGRAMS])
def test_docs_program_runs(block: Block, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[block.id]
    assert outcome.code == 0, f"{block.id} exited {outcome.code}:\n{outcome.output}"
    assert "Traceback" not in outcome.output, outcome.output


EXCERPTS = [block for block in PYTHON if block.kind == "excerpt"]


@pytest.mark.parametrize("block", EXCERPTS, ids=[block.id for block in EXCERPTS])
def test_docs_excerpt_is_in_its_program(block: Block) -> None:
    program = next((p for p in PROGRAMS if p.name == block.name), None)
    assert program is not None, f"{block.id}: no program named {block.name!r}"
    lines = {line.strip() for line in program.code.splitlines()}
    missing = [line for line in block.code.splitlines() if line.strip() not in lines]
    assert not missing, f"{block.id}: not in program {block.name!r}: {missing}"


SKIPPED = [block for block in PYTHON if block.kind == "skip"]


def test_docs_fragments_say_why() -> None:
    for block in SKIPPED:  # not run: each says why, and still parses
        assert block.arg, f"{block.id}: a skipped block says why"
        compile(block.code, block.id, "exec")
