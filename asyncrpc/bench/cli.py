"""The command line of ``python -m asyncrpc.bench``: options, presets and output files.

Part of ``asyncrpc.bench``. ``--quick`` is the short preset ``make bench`` runs (3-6 minutes
on 2 cores); ``--json`` writes the full document for machines, ``--plot`` a PNG for
people.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from asyncrpc.bench.config import ALL_SYSTEMS, MIB, WORKLOADS, BenchConfig, parse_size
from asyncrpc.bench.report import PlotUnavailableError, check_plot_available, summarize
from asyncrpc.bench.tables import render

__all__ = ["build_config", "main"]

CUDA = "cuda"  # the CUDA rows' workload name (asyncrpc.bench.cuda)

_EXAMPLES = """\
examples:
  python -m asyncrpc.bench --quick
  python -m asyncrpc.bench --json bench/results.json --plot bench/results.png
  python -m asyncrpc.bench --workloads latency,echo --sizes 1MiB,64MiB --rounds 3
  python -m asyncrpc.bench --torch-tcp --big
"""


def _csv(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (got {text!r})")
        return values

    return parse


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(parse_size(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m asyncrpc.bench",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="asyncrpc vs torch.distributed.rpc (TensorPipe) vs a raw uvloop socket floor, "
        "in fresh processes on 127.0.0.1, rounds interleaved between systems.",
    )
    add = p.add_argument
    add("--quick", action="store_true", help="a short run (3-6 minutes on 2 cores)")
    add(
        "--workloads", type=_csv((*WORKLOADS, CUDA)),
        help=f"comma list of {', '.join(WORKLOADS)}, or {CUDA} (the CUDA rows, on a GPU machine; "
        "python -m asyncrpc.bench.cuda -h for their options)",
    )  # fmt: skip
    add("--systems", type=_csv(ALL_SYSTEMS), help="comma list (default asyncrpc,torch,floor)")
    add("--torch-tcp", action="store_true", help="also run torch with TensorPipe forced to TCP")
    add("--rounds", type=int, help="measured rounds (default 5, quick 3)")
    add("--duration", type=float, help="seconds per item per round (default 0.5, quick 0.25)")
    add("--warmup", type=float, help="seconds each item runs untimed just before it is timed")
    add("--sizes", type=_sizes, help="echo sizes, e.g. 1KiB,1MiB,16MiB,64MiB")
    add("--big", action="store_true", help="add a 256 MiB echo")
    add("--inflight", type=_ints, help="calls in flight for throughput (default 1,32,256)")
    add("--ps-duration", type=float, help="seconds per parameter-server round")
    add(
        "--plain-calls", type=int,
        help="timed iterations per row of the plain program (default 400, quick 200)",
    )  # fmt: skip
    add(
        "--plain-busy-poll-us", type=int, metavar="US",
        help="run asyncrpc's plain program again with busy_poll_us=US, in rows of its own "
        "(default off, quick 300)",
    )  # fmt: skip
    add("--json", metavar="PATH", help="write the full results as JSON")
    add("--plot", metavar="PATH.png", help="write a chart (needs matplotlib)")
    add(
        "--targets",
        action="store_true",
        help="also check the project's own speed targets (the JSON always has them)",
    )
    add("--no-progress", action="store_true", help="no progress bar on stderr")
    add(
        "--no-freeze",
        action="store_true",
        help="keep the other systems running (not SIGSTOPped) while one is measured",
    )
    add(
        "--reuse-processes",
        action="store_true",
        help="start each system once and reuse its processes in every round (faster; one "
        "start's luck then decides the whole run: see bench/RESULTS.md)",
    )
    add("--log-dir", metavar="DIR", help="keep the processes' logs here")
    return p


def build_config(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration: the preset, then every option given explicitly."""
    config = BenchConfig()
    if args.quick:
        config = BenchConfig(
            rounds=3, duration=0.25, warmup=0.05, ps_duration=1.0, idle_seconds=0.5,
            plain_calls=200, plain_busy_poll_us=300, quick=True,
        )  # fmt: skip
    if args.systems:
        config.systems = tuple(s for s in ALL_SYSTEMS if s in args.systems)
    if args.torch_tcp and "torch_tcp" not in config.systems:
        config.systems = tuple(s for s in ALL_SYSTEMS if s in (*config.systems, "torch_tcp"))
    if args.workloads:
        config.workloads = tuple(w for w in WORKLOADS if w in args.workloads)
    names = ("rounds", "duration", "warmup", "sizes", "inflight", "ps_duration", "plain_calls",
             "plain_busy_poll_us")  # fmt: skip
    for name in (*names, "log_dir"):
        if getattr(args, name) is not None:
            setattr(config, name, getattr(args, name))
    if args.big and 256 * MIB not in config.sizes:
        config.sizes = (*config.sizes, 256 * MIB)
    config.freeze = not args.no_freeze
    config.fresh = not args.reuse_processes
    return config


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the tables; write ``--json`` and ``--plot``.

    Returns:
        0 when asyncrpc was measured, 1 when it could not run, 2 on bad options.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    for flag, value in (("--rounds", args.rounds), ("--plain-calls", args.plain_calls)):
        if value is not None and value < 1:
            print(f"asyncrpc.bench: {flag} must be at least 1", file=sys.stderr)
            return 2
    if args.plot:
        try:
            check_plot_available()
        except PlotUnavailableError as exc:
            print(f"asyncrpc.bench: {exc}", file=sys.stderr)
            return 2
    if args.workloads and CUDA in args.workloads:
        # Their own harness (one GPU, device maps both ways): run alone or before the rest.
        from asyncrpc.bench import cuda

        cuda.main([])
        if set(args.workloads) == {CUDA}:
            return 0
    from asyncrpc.bench.runner import run_bench

    config = build_config(args)
    result = run_bench(config, progress=not args.no_progress)
    doc = summarize(result, argv)
    sys.stdout.write(render(doc, targets=args.targets))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        from asyncrpc.bench.report import write_plot

        write_plot(doc, args.plot)
    return 0 if result.status.get("asyncrpc", "ok") == "ok" else 1
