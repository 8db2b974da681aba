"""``python -m asyncrpc.bench`` end to end: a tiny --quick run of every workload, and the CLI's
errors. The run starts real processes for asyncrpc, torch.distributed.rpc and the raw floor."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrpc.bench.cli import build_config, main
from asyncrpc.bench.config import KIB, MIB, parse_size
from asyncrpc.bench.runner import torch_rpc_unavailable

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("asyncrpc", "torch", "floor")
WORKLOADS = ("latency", "throughput", "echo", "remote", "ps", "dist-autograd", "plain")
NO_FLOOR = ("ps", "dist-autograd", "plain")  # workloads the floor has no RPC layer to run
TINY = [
    "--quick", "--rounds", "1", "--duration", "0.05", "--warmup", "0.02",
    "--sizes", "1KiB,1MiB", "--inflight", "1,8", "--ps-duration", "0.3", "--no-progress",
    "--plain-calls", "20",
]  # fmt: skip


def _run_bench(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncrpc.bench", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False,
    )  # fmt: skip


@pytest.mark.timeout(240)
def test_bench_quick_reports_every_workload_for_all_systems(tmp_path: Path) -> None:
    reason = torch_rpc_unavailable()
    if reason is not None:
        pytest.skip(f"torch.distributed.rpc is needed for the comparison: {reason}")
    out = tmp_path / "bench.json"
    args = [*TINY, "--workloads", ",".join(WORKLOADS), "--json", str(out)]
    args += ["--log-dir", str(tmp_path / "logs")]
    proc = _run_bench(args, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["status"] == dict.fromkeys(SYSTEMS, "ok"), doc["status"]
    assert list(doc["workloads"]) == list(WORKLOADS)
    for name, summary in doc["workloads"].items():
        assert summary["rows"], name
        for row in summary["rows"]:
            for system in SYSTEMS:
                cell = row["values"][system]
                if name in NO_FLOOR and system == "floor":
                    assert cell["value"] is None
                    continue
                assert isinstance(cell["value"], float), (name, row["label"], system, cell)
                assert cell["value"] > 0
                if name != "ps" and not row["keys"].get(system, "").startswith("backward alone"):
                    # ps reports per trainer, not per call; the plain program's backward
                    # is timed inside another row's iterations, so it has no CPU of its own.
                    # The cost model: CPU microseconds per call of each process.
                    cpu = {k: v for k, v in cell["median"].items() if k.startswith("cpu_us_")}
                    assert cpu["cpu_us_client"] > 0, (name, system, cpu)
                    assert cpu["cpu_us_server"] >= 0, (name, system, cpu)
                    parts = sum(v for k, v in cpu.items() if k != "cpu_us_total")
                    assert cpu["cpu_us_total"] == pytest.approx(parts)
                if system == "asyncrpc" and name in ("latency", "throughput", "remote"):
                    # The cost model's hand-offs: none for an awaited coroutine or @inline
                    # function, a few at most for any call; a def over rpc_sync takes the
                    # calling thread's lane (runtime/lanes/): no hand-off on either side.
                    handoffs = cell["median"]["handoffs_total"]
                    assert 0 <= handoffs < 20, (name, row["label"], cell["median"])
                    if row["label"] == "def no-op, rpc_sync":
                        assert handoffs < 0.5, cell["median"]
            assert isinstance(row["ratios"]["asyncrpc/torch"], float)
    assert {t["verdict"] for t in doc["targets"]} <= {"met", "missed", "not measured"}
    # The harness rows that have a plain twin are checked against it, both libraries.
    checks = {(c["workload"], c["plain"]): c for c in doc["plain_checks"]}
    assert set(checks) == {("latency", "noop"), ("latency", "torch.add"), ("remote", "remote")}
    for check in checks.values():
        assert check["verdict"] in ("agrees", "disagrees"), check
        assert set(check["systems"]) == {"asyncrpc", "torch"}
    assert "== latency" in proc.stdout
    assert "== the harness against the plain program" in proc.stdout
    assert "== plain program" in proc.stdout
    assert "== CPU time per call" in proc.stdout


@pytest.mark.timeout(180)
def test_bench_dist_autograd_trains_on_both_rpc_systems(tmp_path: Path) -> None:
    reason = torch_rpc_unavailable()
    if reason is not None:
        pytest.skip(f"torch.distributed.rpc is needed for the comparison: {reason}")
    out = tmp_path / "bench.json"
    # Two rounds (a later option wins over TINY's), so the figure is a median of two.
    args = [*TINY, "--rounds", "2", "--duration", "0.1", "--workloads", "dist-autograd"]
    args += ["--json", str(out), "--log-dir", str(tmp_path / "logs")]
    proc = _run_bench(args, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["status"] == dict.fromkeys(SYSTEMS, "ok"), doc["status"]
    (row,) = doc["workloads"]["dist-autograd"]["rows"]
    assert doc["workloads"]["dist-autograd"]["metric"] == "steps_per_s"
    for system in ("asyncrpc", "torch"):
        cell = row["values"][system]
        assert isinstance(cell["value"], float), (system, cell)
        assert cell["value"] > 0
        assert len(cell["rounds"]) == 2
        assert cell["median"]["steps"] >= 5  # the loop's minimum, however slow the machine
    assert row["values"]["floor"] == {"value": None, "note": "n/a"}
    assert isinstance(row["ratios"]["asyncrpc/torch"], float)
    (target,) = [t for t in doc["targets"] if t["target"].startswith("distributed training")]
    assert target["verdict"] in ("met", "missed")
    assert "== distributed training" in proc.stdout


def test_bench_plot_without_matplotlib_is_a_clear_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed")
    assert main(["--plot", str(tmp_path / "x.png"), "--workloads", "latency"]) == 2
    err = capsys.readouterr().err
    # The hint names a package pip can install for this: `asyncrpc[plot]` would fetch the
    # unrelated PyPI project named asyncrpc.
    assert "pip install matplotlib" in err
    assert "asyncrpc[" not in err
    assert not (tmp_path / "x.png").exists()


def test_bench_config_applies_explicit_options_over_the_quick_preset() -> None:
    from asyncrpc.bench.cli import _parser

    args = _parser().parse_args(["--quick", "--rounds", "2", "--sizes", "1KiB,2MiB", "--big"])
    config = build_config(args)
    assert config.quick
    assert config.rounds == 2
    assert config.sizes == (KIB, 2 * MIB, 256 * MIB)
    assert config.systems == SYSTEMS


@pytest.mark.parametrize("text", ["", "3", "1.5x", "-4"])
def test_parse_size_rejects_what_is_not_a_float32_size(text: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - ValueError is parse_size's only error
        parse_size(text)


@pytest.mark.timeout(120)
def test_bench_without_torch_rpc_runs_the_other_systems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncrpc.bench import runner
    from asyncrpc.bench.config import BenchConfig
    from asyncrpc.bench.report import summarize
    from asyncrpc.bench.tables import render

    monkeypatch.setattr(runner, "torch_rpc_unavailable", lambda: "no RPC in this build")
    config = BenchConfig(
        workloads=("latency",), rounds=1, duration=0.05, warmup=0.02, idle_seconds=0.1,
        log_dir=str(tmp_path),
    )  # fmt: skip
    result = runner.run_bench(config, progress=False)
    assert result.status["asyncrpc"] == "ok"
    assert result.status["floor"] == "ok"
    assert result.status["torch"].startswith("unavailable")
    doc = summarize(result, ["--workloads", "latency"])
    row = doc["workloads"]["latency"]["rows"][0]
    assert isinstance(row["values"]["asyncrpc"]["value"], float)
    assert row["values"]["torch"]["value"] is None
    assert row["ratios"]["asyncrpc/torch"] is None
    assert isinstance(row["ratios"]["asyncrpc/floor"], float)
    assert "no RPC in this build" in render(doc)


def test_cuda_workload_says_it_was_skipped_without_a_gpu() -> None:
    # On a machine without CUDA the CUDA rows print one clear line and the run succeeds.
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA rows run (make bench-cuda)")
    out = subprocess.run(
        [sys.executable, "-m", "asyncrpc.bench", "--workloads", "cuda"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "cuda: skipped, no CUDA device here" in out.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("reuse", "starts"), [(False, 2), (True, 1)])
def test_bench_starts_fresh_processes_for_each_round_unless_asked_to_reuse(
    tmp_path: Path, reuse: bool, starts: int
) -> None:
    # One start's scheduling luck held for a whole run decided its figures (bench/RESULTS.md):
    # by default every round runs on processes started for it. The floor starts fastest.
    from asyncrpc.bench import runner
    from asyncrpc.bench.config import BenchConfig

    config = BenchConfig(
        systems=("floor",), workloads=("latency",), rounds=2, duration=0.05, warmup=0.02,
        idle_seconds=0.1, fresh=not reuse, log_dir=str(tmp_path),
    )  # fmt: skip
    result = runner.run_bench(config, progress=False)
    assert result.status == {"floor": "ok"}
    assert result.starts == {"floor": starts}
    (outcomes,) = result.raw["floor"]["latency"].values()
    assert len(outcomes) == 2  # one measured outcome per round
    assert all(o["stats"]["p50_us"] > 0 for o in outcomes)


@pytest.mark.timeout(180)
def test_bench_plain_alone_runs_only_the_users_programs(tmp_path: Path) -> None:
    reason = torch_rpc_unavailable()
    if reason is not None:
        pytest.skip(f"torch.distributed.rpc is needed for the comparison: {reason}")
    from asyncrpc.bench import report, runner, tables
    from asyncrpc.bench.config import PLAIN_ROWS, POLLED, BenchConfig

    config = BenchConfig(workloads=("plain",), rounds=1, plain_calls=10, log_dir=str(tmp_path),
                         plain_busy_poll_us=200)  # fmt: skip
    result = runner.run_bench(config, progress=False)
    assert result.starts == {}  # no harness process was needed
    keys = [key for key, _ in PLAIN_ROWS]
    for system, expected in (("asyncrpc", keys + [k + POLLED for k in keys]), ("torch", keys)):
        rows = result.raw[system]["plain"]
        assert list(rows) == expected
        for key, (outcome,) in rows.items():
            assert outcome["stats"]["p50_us"] > 0, (system, key, outcome)
            assert outcome["stats"]["n"] == 10
    assert "floor" not in result.raw
    # The polled rows are rows of their own, against torch's same rows (its defaults).
    text = tables.render(report.summarize(result, []))
    assert "dist_autograd.backward alone, busy_poll_us=200" in text


@pytest.mark.timeout(240)
def test_stream_cost_reports_the_stream_rows_with_their_ratios() -> None:
    # bench/stream_cost.py, tiny: every row is there, and the rounds' figures are sane.
    done = subprocess.run(
        [sys.executable, "bench/stream_cost.py", "--rounds", "1", "--items", "500",
         "--calls", "100", "--tensors", "5"],
        capture_output=True, text=True, timeout=200, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for row in ("stream, async for", "stream_arg, async for", "bidi echo, send + read",
                "medians of the rounds' ratios"):  # fmt: skip
        assert row in done.stdout, done.stdout
    (rounds,) = json.loads(done.stdout.split("rounds: ", 1)[1].splitlines()[0])
    for key in ("calls_per_s", "items_per_s", "client_items_per_s", "bidi_items_per_s"):
        assert rounds[key] > 0, rounds
