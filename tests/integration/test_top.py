"""``python -m asyncrpc.top`` attached to a live 4-worker group: every worker shown, then a
stopped one (SIGSTOP) marked HUNG at once and, when the group's heartbeats find it, named
lost by the others; attached through the group's rendezvous store, every worker found,
and a store that does not answer said at once. ``--once`` always runs; the live screen is
read through tmux, skipped where tmux is not installed."""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncrpc.testing import free_port
from asyncrpc.top.__main__ import main

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4


@dataclass
class Group:
    processes: list[subprocess.Popen[bytes]]
    logs: list[Path]
    ports: list[int]
    init: str  # the init_method the workers joined by

    def text(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _wait(
    what: str, check: Callable[[], object], timeout: float, debug: Callable[[], str]
) -> float:
    """Poll ``check`` until it is truthy; the seconds it took."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what}: not within {timeout}s\n{debug()}")
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    pytest.importorskip("prometheus_client")  # the workers serve /metrics with it
    init = f"tcp://127.0.0.1:{free_port()}"
    processes: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"t{rank}.log" for rank in range(WORLD)]
    try:
        for rank, log in enumerate(logs):
            with open(log, "wb") as out:
                processes.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.integration.top_worker", f"t{rank}",
                     str(rank), str(WORLD), init],
                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                    env=_env(),
                ))  # fmt: skip
        made = Group(processes, logs, [], init)
        _wait("workers ready", lambda: all("READY" in log.read_text() for log in logs), 90.0,
              made.text)  # fmt: skip
        for log in logs:
            made.ports.append(int(re.findall(r"METRICS (\d+)", log.read_text())[0]))
        yield made
    finally:
        for process in processes:  # only PIDs we started; a stopped one must go on
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
        for process in processes:
            with contextlib.suppress(OSError):
                process.stdin.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + 20.0
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10.0)


def top_once(ports: list[int], *options: str) -> tuple[int, str]:
    command = [sys.executable, "-m", "asyncrpc.top", "--once", *options]
    if ports:
        command.append(",".join(map(str, ports)))
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=90, cwd=ROOT, env=_env()
    )
    return done.returncode, done.stdout + done.stderr


def row(screen: str, worker: str) -> list[str]:
    """The cells of a worker's line (empty when it is not on the screen)."""
    for line in screen.splitlines():
        cells = line.split()
        if cells and cells[0] == worker:
            return cells
    return []


def test_Top_once_shows_every_worker_then_a_stopped_one_hung(group: Group) -> None:
    code, screen = top_once(group.ports)
    assert code == 0, screen
    assert "4/4 up, world size 4" in screen, screen
    for rank in range(WORLD):
        cells = row(screen, f"t{rank}")
        assert cells[1:3] == [str(rank), "up"], screen
        assert float(cells[3].rstrip("k")) > 0, screen  # calls made per second
    assert "STREAMS" in screen, screen  # t0 reads an endless stream from t1
    os.kill(group.processes[1].pid, signal.SIGSTOP)  # a PID we started; SIGCONT in finally
    code, screen = top_once(group.ports)
    assert code == 2, screen
    # A fresh view never heard t1, so it is named by its endpoint; HUNG all the same.
    assert re.search(rf"^\?\s+HUNG.*\n\s+\^ \? \(http://127.0.0.1:{group.ports[1]}/metrics\): "
                     r"no answer in 1s", screen, re.M), screen  # fmt: skip
    for rank in (0, 2, 3):
        assert row(screen, f"t{rank}")[2] == "up", screen


def test_Top_once_finds_every_worker_through_the_rendezvous_store(group: Group) -> None:
    # t0 and t1 served their metrics before init_rpc, t2 and t3 after (top_worker.py).
    code, screen = top_once([], "--rendezvous", group.init)
    assert code == 0, screen
    assert "4/4 up, world size 4" in screen, screen
    for rank in range(WORLD):
        cells = row(screen, f"t{rank}")
        assert cells[1:3] == [str(rank), "up"], screen
    # In rank order, as the store lists them.
    workers = [line.split()[0] for line in screen.splitlines() if line.startswith("t")]
    assert workers == [f"t{r}" for r in range(WORLD)], screen


def test_Top_says_at_once_that_no_store_answers() -> None:
    started = time.monotonic()
    code, said = top_once([], "--store-timeout", "1", "--rendezvous",
                          f"tcp://127.0.0.1:{free_port()}")  # fmt: skip
    took = time.monotonic() - started
    assert code == 1, said
    assert "asyncrpc.top: no rendezvous store answered at tcp://127.0.0.1:" in said, said
    assert "Traceback" not in said, said
    assert took < 30.0, took  # the interpreter and torch's import, then the 1 s timeout
    code, said = top_once([], "--rendezvous", "file:///tmp/nowhere")
    assert code == 1, said
    assert "give tcp://HOST:PORT or env://" in said, said


def test_Discovery_finds_workers_that_publish_later() -> None:
    # A dynamic group's newcomers: published after the view attached, read on its next
    # refresh (a real TCPStore, as the workers' rank 0 hosts it).
    import datetime

    import torch.distributed as dist

    from asyncrpc.runtime.group import endpoints
    from asyncrpc.top.discover import Discovery, StoreUnreachableError

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))  # fmt: skip
    endpoints.publish(host, 1, "127.0.0.1", 9101)
    discovery = Discovery(f"tcp://127.0.0.1:{port}", timeout=5.0)
    assert discovery.urls([]) == ["http://127.0.0.1:9101/metrics"]
    endpoints.publish(host, 0, "0.0.0.0", 9100, rpc_host="10.0.0.7")
    endpoints.publish(host, 1, "127.0.0.1", 9111)  # rank 1 again: its latest entry counts
    assert discovery.urls([]) == ["http://10.0.0.7:9100/metrics", "http://127.0.0.1:9111/metrics"]
    # A counted entry not written yet (its worker between its two requests) waits.
    host.add("asyncrpc/metrics_count", 1)
    assert len(discovery.urls([])) == 2
    host.set("asyncrpc/metrics/4", "2 127.0.0.1 9102")
    assert discovery.urls([])[-1] == "http://127.0.0.1:9102/metrics"
    del host  # the store's host goes: the view keeps what it knew, and says why
    known = ["http://127.0.0.1:9100/metrics"]
    assert discovery.urls(known) == known
    assert discovery.error
    with pytest.raises(StoreUnreachableError):
        Discovery(f"tcp://127.0.0.1:{port}", timeout=0.5)


def _tmux(socket: str, *args: str) -> str:
    done = subprocess.run(
        ["tmux", "-L", socket, *args], check=False, capture_output=True, text=True, timeout=10
    )
    return done.stdout


def _tmux_top(socket: str, *args: str) -> None:
    """Start ``python -m asyncrpc.top ARGS`` in a 150x30 pane of our own tmux server."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in _env().items() if k == "PYTHONPATH")
    # Without the runner's COLUMNS/LINES: the view must take the pane's own size.
    command = (f"env -u COLUMNS -u LINES {env} {shlex.quote(sys.executable)} -m asyncrpc.top "
               + " ".join(map(shlex.quote, args)))  # fmt: skip
    subprocess.run(
        ["tmux", "-L", socket, "-f", "/dev/null", "new-session", "-d", "-s", "top",
         "-x", "150", "-y", "30", "-c", str(ROOT), command],
        check=True, timeout=10,
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_Top_live_screen_marks_a_stopped_worker_at_once(group: Group) -> None:
    socket = f"asyncrpc-top-{os.getpid()}"
    _tmux_top(socket, *map(str, group.ports))
    screens: list[str] = []

    def screen() -> str:
        screens.append(_tmux(socket, "capture-pane", "-p", "-t", "top"))
        return screens[-1]

    def last() -> str:
        return screens[-1] if screens else "(no screen)"

    try:
        _wait("every worker up and calling",
              lambda: all(row(s := screen(), f"t{r}")[2:3] == ["up"]
                          and row(s, f"t{r}")[3] != "-" for r in range(WORLD)),
              60.0, last)  # fmt: skip
        print(last())  # every worker up (pytest -s shows the screens)
        os.kill(group.processes[1].pid, signal.SIGSTOP)  # a PID we started; SIGCONT in finally
        # One frame: at most the interval (1 s) plus the scrape timeout (1 s), with slack
        # for a loaded machine.
        took = _wait("t1 marked HUNG", lambda: row(screen(), "t1")[2:3] == ["HUNG"], 8.0, last)
        print(f"t1 marked HUNG {took:.1f}s after SIGSTOP")
        cells = row(last(), "t1")
        assert cells[3] == "-", last()  # no figures are shown for it as if current
        # The group's heartbeats then find it: the others name it lost.
        _wait("t1 lost by t0 t2 t3", lambda: "lost by t0 t2 t3" in screen(), 45.0, last)
        assert "^ t1: no answer in 1s; last answer" in last()
        for rank in (0, 2, 3):
            assert row(last(), f"t{rank}")[-1] == "t1", last()  # their LOST column
        print(last())
    finally:
        _tmux(socket, "send-keys", "-t", "top", "q")
        time.sleep(0.5)
        _tmux(socket, "kill-server")  # our own server, on its own socket


def stream_items(screen: str, worker: str) -> float | None:
    """The items so far on ``worker``'s stream line, None when it has none."""
    found = re.search(rf"^  {worker}\s+\d+ open  \[(.*)\]  ([\d.]+)([kMG]?) items so far",
                      screen, re.M)  # fmt: skip
    if found is None:
        return None
    return float(found[2]) * {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}[found[3]]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_Top_live_screen_through_the_store_shows_a_stream_moving(group: Group) -> None:
    socket = f"asyncrpc-top-rdzv-{os.getpid()}"
    _tmux_top(socket, "--rendezvous", group.init)
    screens: list[str] = []

    def screen() -> str:
        screens.append(_tmux(socket, "capture-pane", "-p", "-t", "top"))
        return screens[-1]

    def last() -> str:
        return screens[-1] if screens else "(no screen)"

    try:
        _wait("every worker found and up",
              lambda: "4/4 up, world size 4" in screen()
              and all(row(last(), f"t{r}")[2:3] == ["up"] for r in range(WORLD)),
              60.0, last)  # fmt: skip
        # t0 reads an endless stream from t1 (an item every 20 ms): both show it, and
        # the count grows from frame to frame.
        _wait("t0's stream line", lambda: stream_items(screen(), "t0") is not None, 10.0, last)
        first = stream_items(last(), "t0")
        time.sleep(3.0)
        _wait("t0's items grow", lambda: (stream_items(screen(), "t0") or 0) > (first or 0),
              5.0, last)  # fmt: skip
        line = next(line for line in last().splitlines() if line.startswith("  t0 "))
        strip = line[line.index("[") + 1 : line.index("]")]
        assert any(cell in ":-=#" for cell in strip), line  # items moved in recent scrapes
        assert "items/s" in line, line
        assert stream_items(last(), "t1") is not None, last()  # the producing end
        print(last())  # pytest -s shows the screen
    finally:
        _tmux(socket, "send-keys", "-t", "top", "q")
        time.sleep(0.5)
        _tmux(socket, "kill-server")  # our own server, on its own socket


# -- without workers: what a scrape makes of a silent listener and of a closed port -----


EMPTY = ""  # what an endpoint serves before init_rpc
CANNED = (
    'asyncrpc_worker_info{rank="0",worker="w0",world_size="3"} 1.0\n'
    'asyncrpc_calls_sent_total{worker="w0"} 5.0\n'
)


class _Canned(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = (EMPTY if self.path == "/empty" else CANNED).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass  # no request log on stderr


def test_Top_once_tells_a_silent_endpoint_from_a_closed_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    # A listener that never accepts: the kernel completes the handshake, as for a stopped
    # process, and nothing is ever said.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    closed = free_port()  # nothing listens there
    try:
        endpoints = [str(server.server_port), str(silent.getsockname()[1]), str(closed),
                     f"http://127.0.0.1:{server.server_port}/empty"]  # fmt: skip
        started = time.monotonic()
        code = main(["--once", "--interval", "0.2", "--timeout", "0.5", ",".join(endpoints)])
        took = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
        silent.close()
    screen = capsys.readouterr().out
    assert code == 2, screen
    assert row(screen, "w0")[:3] == ["w0", "0", "up"], screen
    assert f"? ({'http://127.0.0.1:' + endpoints[1]}/metrics): no answer in 0.5s" in screen
    assert re.search(rf"^\?\s+DOWN.*\n\s+\^ \? \(http://127.0.0.1:{closed}/metrics\)", screen,
                     re.M), screen  # fmt: skip
    assert re.search(r"^\?\s+idle.*\n.*/empty\): no worker runs there", screen, re.M), screen
    assert "1/4 up" in screen
    # Two rounds of scrapes, each bounded by the timeout, whatever the silent one does.
    assert took < 5.0, took
