"""The test side of a scenario (test layer): start ``python -m tests.scenarios NAME ...``
and read its output lines, its ``RESULT {json}`` line and its exit code.

The pytest process imports this without the scenario modules (nor torch).
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from asyncrpc.testing.launcher import REPO_ROOT, repo_env, start_module
from asyncrpc.testing.prefork import PreforkedProcess

RESULT_PREFIX = "RESULT "  # printed by ``common.report``

Observations = dict[str, Any]


# What torch's C++ code writes on stderr when it logs an error with its stack: the c10d
# tag, the line naming where it was raised, and one line per C++ frame.
_CPP_LOG_MARKS = ("[c10d]", "Exception raised from", "frame #")


def cpp_log_lines(text: str) -> list[str]:
    """The lines of ``text`` that torch's C++ logging wrote (see ``_CPP_LOG_MARKS``)."""
    return [line for line in text.splitlines() if any(m in line for m in _CPP_LOG_MARKS)]


class ScenarioProcess:
    """A scenario process we started: its output lines arrive through a reader thread."""

    def __init__(self, process: subprocess.Popen[str] | PreforkedProcess) -> None:
        self.process = process
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def text(self) -> str:
        return "".join(self.output)

    def wait_line(self, wanted: str, timeout: float) -> str:
        """Wait for an output line that is ``wanted`` or starts with it and a space; return
        it. AssertionError with the output if none comes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {wanted!r} within {timeout} s:\n{self.text()}") from None
            if line is None:
                raise AssertionError(f"exited before {wanted!r}:\n{self.text()}")
            if line == wanted or line.startswith(wanted + " "):
                return line

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def result(self, timeout: float) -> tuple[int, Observations]:
        """Wait for the exit; return the exit code and the parsed ``RESULT`` line."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"scenario still running after {timeout} s:\n{self.text()}"
            ) from None
        self._reader.join(5)
        for line in self.output:
            if line.startswith(RESULT_PREFIX):
                return code, json.loads(line[len(RESULT_PREFIX) :])
        raise AssertionError(f"no RESULT line (exit code {code}):\n{self.text()}")

    def kill(self) -> None:
        """SIGKILL the process (by the PID we started) if it still runs, reap it, close pipes."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._reader.join(5)  # EOF once the process is gone: the pipe can then be closed
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def start(
    scenario: str,
    *args: str,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> ScenarioProcess:
    """Start ``python -m tests.scenarios scenario *args`` from the repository root.

    Every test starts its scenario processes here.

    Args:
        scenario: a registered scenario's name (``tests/scenarios/registry.py``).
        *args: its command-line options.
        env: extra environment variables.
        prefix: a launcher that execs the command in place (``ip netns exec NS``).

    Returns:
        The running process; the caller stops it with ``kill`` in a ``finally``.
    """
    full_env = repo_env({"PYTHONUNBUFFERED": "1", **(env or {})})
    process = start_module(
        "tests.scenarios", [scenario, *args], env=full_env, cwd=REPO_ROOT, prefix=prefix,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    return ScenarioProcess(process)
