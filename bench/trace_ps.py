"""Trace the parameter-server example and draw its spans: the picture in
``docs/observability.md``.

    python bench/trace_ps.py [--trainers 2] [--steps 5] [--out docs/trace_ps.svg]

Runs ``examples/parameter_server`` (the server and its trainer processes) with an
OpenTelemetry SDK tracer provider on every process, exporting into memory; each process
writes the spans it ended to ``--spans DIR/<worker>.json`` as it exits, and this one
draws them all with ``trace_svg.py`` (one row per span, under its parent, a colour per
worker, on one time axis). The training (the trainers' ``train`` calls) runs under one
user span, ``parameter_server``, so every call of it is in one trace. The server's side
is ``ps.serve`` again, that span added around the training. Needs ``opentelemetry-sdk``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the examples import from the root
    sys.path.insert(0, str(ROOT))

import asyncrpc  # noqa: E402
from asyncrpc.testing import free_port, record_spans, recorded_spans  # noqa: E402
from bench.trace_svg import render  # noqa: E402
from examples._launch import workers  # noqa: E402
from examples.parameter_server import ps  # noqa: E402


def dump(worker: str, folder: Path) -> None:
    """Write the spans this process ended, as plain data (ids as hex, times in ns)."""
    spans = [
        {
            "worker": worker, **s, "trace_id": f"{s['trace_id']:032x}",
            "span_id": f"{s['span_id']:016x}",
            "parent_id": None if s["parent_id"] is None else f"{s['parent_id']:016x}",
        }
        for s in recorded_spans()
    ]  # fmt: skip
    (folder / f"{worker}.json").write_text(json.dumps(spans))


def trainer(argv: list[str]) -> int:
    """A trainer process (``--role worker``): traced, its spans dumped as it exits."""
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--spans", type=Path, required=True)
    known, rest = ours.parse_known_args(argv)
    record_spans()
    args = ps.parse(rest)
    asyncio.run(ps.trainer_worker(args))
    dump(f"trainer{args.rank}", known.spans)
    return 0


async def serve(args: argparse.Namespace) -> None:
    """``ps.serve``, the training (not the joining) under one user span."""
    from opentelemetry import trace

    world = args.trainers + 1
    options = ps._options(args, serves_whole_run=False)
    async with asyncrpc.worker("ps", rank=0, world_size=world, rpc_backend_options=options):
        ps_rref = asyncrpc.RRef(ps.ParameterServer(args.trainers, args.steps, args.lr))
        with trace.get_tracer("trace_ps").start_as_current_span("parameter_server"):
            await asyncio.gather(*(
                asyncrpc.call(f"trainer{r}", ps.train, ps_rref, r, args.steps, args.batch)
                for r in range(1, world)
            ))  # fmt: skip
        del ps_rref


def run(trainers: int, steps: int, folder: Path) -> None:
    """The example's main process (the server); its trainers, traced as well."""
    record_spans()
    args = ps.parse(["--trainers", str(trainers), "--steps", str(steps)])
    args.init_method = f"tcp://127.0.0.1:{free_port()}"
    extra = ["--timeout", str(args.timeout), "--deadline", str(args.deadline),
             "--spans", str(folder)]  # fmt: skip
    ranks = range(1, trainers + 1)
    with workers("bench.trace_ps", ranks, trainers + 1, args.init_method, extra, args.deadline):
        asyncio.run(serve(args))
        dump("ps", folder)


def main() -> int:
    if "--role" in sys.argv:
        return trainer(sys.argv[1:])
    parser = argparse.ArgumentParser(prog="python bench/trace_ps.py")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--spans", type=Path, help="keep the spans here (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "trace_ps.svg")
    args = parser.parse_args()
    folder = args.spans or Path(tempfile.mkdtemp(prefix="trace_ps-"))
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    run(args.trainers, args.steps, folder)
    spans = [s for f in sorted(folder.glob("*.json")) for s in json.loads(f.read_text())]
    title = (f"python bench/trace_ps.py --trainers {args.trainers} --steps {args.steps}: "
             f"{len(spans)} spans")  # fmt: skip
    args.out.write_text(render(spans, title))
    print(f"{len(spans)} spans from {folder} -> {args.out} "
          f"({args.out.stat().st_size} bytes) in {time.monotonic() - started:.1f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
