"""What a benchmark run measures: systems, workloads, measurement items, rows and presets.

Part of ``asyncrpc.bench`` (a tool above the library's L4 API). An *item* is one
measurement one system makes (e.g. asyncrpc's ``rpc_sync`` of a no-op); a *row* of a report
table lines up the items of every system that answer the same question.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "ALL_SYSTEMS",
    "AUTOGRAD_BATCH",
    "AUTOGRAD_FEATURES",
    "AUTOGRAD_OWNERS",
    "FLOOR_CALL_BYTES",
    "KIB",
    "MIB",
    "PLAIN_PAIRS",
    "PLAIN_ROWS",
    "PLAIN_SYSTEMS",
    "POLLED",
    "PRIMARY_METRIC",
    "PS_FLOATS",
    "PS_SHAPES",
    "RPC_SYSTEMS",
    "WORKLOADS",
    "BenchConfig",
    "Item",
    "Row",
    "format_size",
    "items_for",
    "parse_size",
    "rows_for",
]

KIB = 1024
MIB = 1024 * KIB

# Systems, in table order. torch_tcp is TensorPipe forced onto plain TCP (opt-in).
ALL_SYSTEMS = ("asyncrpc", "torch", "torch_tcp", "floor")
RPC_SYSTEMS = ("asyncrpc", "torch", "torch_tcp")
WORKLOADS = ("latency", "throughput", "echo", "remote", "ps", "dist-autograd", "plain")
# The plain workload is a user's own program (asyncrpc.bench.plain), run by both libraries.
PLAIN_SYSTEMS = ("asyncrpc", "torch")

# The raw floor's stand-in for a small call: one frame of this many bytes each way (8-byte
# length prefix included), about the size of asyncrpc's request frame for a no-op.
FLOOR_CALL_BYTES = 96

# The parameter server's model: a small MLP's tensors, 1,050,112 floats (4.2 MB).
PS_SHAPES: tuple[tuple[int, ...], ...] = ((1024, 512), (1024,), (512, 1024), (512,))
PS_FLOATS = sum(math.prod(shape) for shape in PS_SHAPES)

# dist-autograd's model: Linear(64, 64) on one server, ReLU on the client, Linear(64, 64) on
# another, trained on one fixed batch. The owners are worker names (the child processes'
# roles): the server, and the third process, which ps uses as its second trainer and which
# serves calls like any worker between its own commands; sharing it keeps the process
# count, and so the other workloads' conditions, unchanged.
AUTOGRAD_FEATURES = 64
AUTOGRAD_BATCH = 32
AUTOGRAD_OWNERS = ("server", "trainer")

# The figure each workload's tables and ratios are about, and which way is better.
PRIMARY_METRIC: dict[str, tuple[str, str, bool]] = {
    # workload: (stat key, unit, higher is better)
    "latency": ("p50_us", "µs", False),
    "throughput": ("calls_per_s", "calls/s", True),
    "echo": ("mb_per_s", "MB/s", True),
    "remote": ("p50_us", "µs", False),
    "ps": ("updates_per_s", "updates/s", True),
    "dist-autograd": ("steps_per_s", "steps/s", True),
    "plain": ("p50_us", "µs", False),
}

# The plain program's rows (asyncrpc.bench.plain), in its order: (key, what one timed
# iteration is), all in a world of two processes. "backward alone" is timed inside the
# iterations of "ctx+fwd+backward"; "step" is the tutorials' training step.
PLAIN_ROWS: tuple[tuple[str, str], ...] = (
    ("noop", "rpc_sync(to, noop)"),
    ("torch.add", "rpc_sync(to, torch.add, (a, b)), 2 elements"),
    ("remote", "remote(to, value).to_here()"),
    ("x*2 8KiB", "rpc_sync(to, times2, (x,)), x 8 KiB"),
    ("fwd(rref,x)", "rpc_sync(to, forward, (rref, x)), Linear(64, 64)"),
    ("ctx+fwd", "the same in dist_autograd.context()"),
    ("ctx+fwd+backward", "the same + dist_autograd.backward"),
    ("backward alone", "dist_autograd.backward alone"),
    ("step", "training step: local + remote Linear, optimizer"),
)

# The key suffix of the plain program's rows run with ``plain_busy_poll_us``.
POLLED = " polled"

# The harness rows that measure what a row of the plain program measures: (workload, item
# key of both systems, plain row key). Their agreement is checked in every run that has both.
PLAIN_PAIRS: tuple[tuple[str, str, str], ...] = (
    ("latency", "sync/sync", "noop"),
    ("latency", "builtin/sync", "torch.add"),
    ("remote", "value/sync", "remote"),
)


@dataclass(frozen=True, slots=True)
class Item:
    """One measurement of one system, sent to its client process as JSON.

    Attributes:
        key: unique within the workload and system, e.g. ``"sync/rpc_sync"``.
        kind: the workload it belongs to.
        fn: which remote function: ``sync``, ``async``, ``builtin``, ``value``, ``echo``.
        style: how the client calls: ``await`` (``await asyncrpc.call``), ``sync``
            (``rpc_sync``), ``futures`` (``rpc_async`` + ``wait`` window), ``callbacks``
            (``rpc_async`` + ``add_done_callback`` window), ``raw`` (floor).
        inflight: calls kept in flight (throughput).
        size: bytes per message (echo).
    """

    key: str
    kind: str
    fn: str = ""
    style: str = ""
    inflight: int = 1
    size: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Item:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class Row:
    """One line of a report table: per system, the item key that answers it (absent: n/a)."""

    label: str
    keys: dict[str, str]


@dataclass(slots=True)
class BenchConfig:
    """Everything a run needs to know; built by the command line (see ``cli``)."""

    systems: tuple[str, ...] = ("asyncrpc", "torch", "floor")
    workloads: tuple[str, ...] = WORKLOADS
    rounds: int = 5
    duration: float = 0.5  # seconds per item per round (all workloads but ps)
    warmup: float = 0.2  # seconds each item runs untimed right before it is timed
    sizes: tuple[int, ...] = (KIB, MIB, 16 * MIB, 64 * MIB)
    inflight: tuple[int, ...] = (1, 32, 256)
    ps_duration: float = 3.0
    ps_trainers: int = 2
    plain_calls: int = 400  # timed iterations per row of the plain program
    # asyncrpc's plain program run again with this busy_poll_us (0: not), in rows of its own
    plain_busy_poll_us: int = 0
    freeze: bool = True  # SIGSTOP the systems not being measured
    fresh: bool = True  # start every system's processes anew for each round
    idle_seconds: float = 1.0  # how long idle CPU use is sampled per system
    start_timeout: float = 90.0
    quick: bool = False
    log_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_size(text: str) -> int:
    """Parse ``1KiB``, ``16MiB``, ``64M`` or a plain byte count.

    Raises:
        ValueError: not a size.
    """
    units = {"kib": KIB, "k": KIB, "kb": KIB, "mib": MIB, "m": MIB, "mb": MIB, "b": 1, "": 1}
    raw = text.strip().lower()
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :]
    if not digits or unit not in units:
        raise ValueError(f"not a size: {text!r} (try 1KiB, 16MiB)")
    size = int(float(digits) * units[unit])
    if size < 4 or size % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return size


def format_size(size: int) -> str:
    """``1048576`` -> ``1 MiB``."""
    if size >= MIB and size % MIB == 0:
        return f"{size // MIB} MiB"
    if size >= KIB and size % KIB == 0:
        return f"{size // KIB} KiB"
    return f"{size} B"


def items_for(workload: str, system: str, config: BenchConfig) -> list[Item]:
    """The items ``system`` measures for ``workload`` (empty: it has nothing to run)."""
    return _ITEM_BUILDERS[workload](system, config)


def _latency_items(system: str, config: BenchConfig) -> list[Item]:
    if system == "floor":
        return [Item("frame", "latency", style="raw")]
    if system != "asyncrpc":  # torch has no @inline: its rows compare with its def no-op
        return [Item(f"{fn}/sync", "latency", fn, "sync") for fn in ("sync", "async", "builtin")]
    fns = ("sync", "inline", "async", "builtin")
    return [Item(f"{fn}/{style}", "latency", fn, style) for fn in fns for style in _STYLES]


def _throughput_items(system: str, config: BenchConfig) -> list[Item]:
    items = []
    for n in config.inflight:
        if system == "floor":
            items.append(Item(f"frame/{n}", "throughput", style="raw", inflight=n))
        elif system == "asyncrpc":
            items.append(Item(f"sync/{n}/await", "throughput", "sync", "await", n))
            items.append(Item(f"sync/{n}/futures", "throughput", "sync", "futures", n))
            items.append(Item(f"sync/{n}/callbacks", "throughput", "sync", "callbacks", n))
            items.append(Item(f"inline/{n}/await", "throughput", "inline", "await", n))
            items.append(Item(f"async/{n}/await", "throughput", "async", "await", n))
        else:
            items.append(Item(f"sync/{n}/futures", "throughput", "sync", "futures", n))
            items.append(Item(f"sync/{n}/callbacks", "throughput", "sync", "callbacks", n))
            items.append(Item(f"async/{n}/futures", "throughput", "async", "futures", n))
    return items


def _echo_items(system: str, config: BenchConfig) -> list[Item]:
    style = {"floor": "raw", "asyncrpc": "await"}.get(system, "sync")
    return [Item(str(size), "echo", "echo", style, size=size) for size in config.sizes]


def _remote_items(system: str, config: BenchConfig) -> list[Item]:
    if system == "floor":
        return [Item("frame", "remote", style="raw")]
    styles = ("sync", "await") if system == "asyncrpc" else ("sync",)
    return [Item(f"value/{style}", "remote", "value", style) for style in styles]


def _ps_items(system: str, config: BenchConfig) -> list[Item]:
    if system == "floor":
        return []  # the floor has no RPC layer to run a parameter server on
    return [Item("updates", "ps", style="sync")]


def _autograd_items(system: str, config: BenchConfig) -> list[Item]:
    if system == "floor":
        return []  # the floor has no RPC layer, let alone distributed autograd
    return [Item("steps", "dist-autograd", style="sync")]


def _plain_items(system: str, config: BenchConfig) -> list[Item]:
    # One run of the whole plain program; its rows come back as the item's results.
    return [Item("program", "plain", style="plain")] if system in PLAIN_SYSTEMS else []


_ITEM_BUILDERS = {
    "plain": _plain_items,
    "latency": _latency_items,
    "throughput": _throughput_items,
    "echo": _echo_items,
    "remote": _remote_items,
    "ps": _ps_items,
    "dist-autograd": _autograd_items,
}

_STYLES = ("sync", "await")
_FN_LABELS = {
    "sync": "def no-op",
    "inline": "@inline def no-op",
    "async": "async def no-op",
    "builtin": "torch.add",
}
_STYLE_LABELS = {
    "sync": "rpc_sync",
    "await": "await call",
    "futures": "rpc_async window",
    "callbacks": "rpc_async + done-callback",
}


# torch's function for each asyncrpc one: @inline has no torch counterpart, so its rows
# compare with torch's plain def no-op (what the same user code costs on torch).
_TORCH_FN = {"sync": "sync", "inline": "sync", "async": "async", "builtin": "builtin"}
# torch has no await: those rows compare with its rpc_async window; callbacks with its own.
_TORCH_STYLE = {"callbacks": "callbacks"}
_THROUGHPUT_KINDS = (
    ("sync", "await"),
    ("sync", "futures"),
    ("sync", "callbacks"),
    ("inline", "await"),
    ("async", "await"),
)


def _torch_keys(key: str) -> dict[str, str]:
    return {"torch": key, "torch_tcp": key}


def rows_for(workload: str, config: BenchConfig) -> list[Row]:
    """The table rows of ``workload``.

    torch has no ``await`` style: those rows compare asyncrpc's ``await call`` with torch's
    ``rpc_sync``; its ``async def`` stand-in is an ``@async_execution`` function.
    """
    return _ROW_BUILDERS[workload](config)


def _latency_rows(config: BenchConfig) -> list[Row]:
    return [
        Row(
            f"{_FN_LABELS[fn]}, {_STYLE_LABELS[style]}",
            {"asyncrpc": f"{fn}/{style}", **_torch_keys(f"{_TORCH_FN[fn]}/sync"), "floor": "frame"},
        )
        for fn in ("sync", "inline", "async", "builtin")
        for style in _STYLES
    ]


def _throughput_rows(config: BenchConfig) -> list[Row]:
    rows = []
    for n in config.inflight:
        for fn, style in _THROUGHPUT_KINDS:
            rows.append(
                Row(
                    f"{n:>3} in flight, {_FN_LABELS[fn]}, {_STYLE_LABELS[style]}",
                    {
                        "asyncrpc": f"{fn}/{n}/{style}",
                        **_torch_keys(f"{_TORCH_FN[fn]}/{n}/{_TORCH_STYLE.get(style, 'futures')}"),
                        "floor": f"frame/{n}",
                    },
                )
            )
    return rows


def _echo_rows(config: BenchConfig) -> list[Row]:
    return [
        Row(
            f"float32 tensor, {format_size(s)}",
            {"asyncrpc": str(s), **_torch_keys(str(s)), "floor": str(s)},
        )
        for s in config.sizes
    ]


def _remote_rows(config: BenchConfig) -> list[Row]:
    return [
        Row(
            f"remote(){label}",
            {"asyncrpc": f"value/{style}", **_torch_keys("value/sync"), "floor": "frame"},
        )
        for style, label in (("sync", ".to_here()"), ("await", ", await to_here_future()"))
    ]


def _ps_rows(config: BenchConfig) -> list[Row]:
    label = f"{config.ps_trainers} trainers, pull + push {PS_FLOATS / 1e6:.2f}M floats"
    return [Row(label, {"asyncrpc": "updates", **_torch_keys("updates")})]


def _autograd_rows(config: BenchConfig) -> list[Row]:
    width = AUTOGRAD_FEATURES
    label = f"2 x Linear({width}, {width}) on 2 servers, batch {AUTOGRAD_BATCH}, rpc_sync + SGD"
    return [Row(label, {"asyncrpc": "steps", **_torch_keys("steps")})]


def _plain_rows(config: BenchConfig) -> list[Row]:
    rows = [Row(what, dict.fromkeys(PLAIN_SYSTEMS, key)) for key, what in PLAIN_ROWS]
    poll = config.plain_busy_poll_us
    if poll:  # against torch's same row with its default options
        rows += [
            Row(f"{what}, busy_poll_us={poll}", {"asyncrpc": key + POLLED, "torch": key})
            for key, what in PLAIN_ROWS
        ]
    return rows


_ROW_BUILDERS = {
    "plain": _plain_rows,
    "latency": _latency_rows,
    "throughput": _throughput_rows,
    "echo": _echo_rows,
    "remote": _remote_rows,
    "ps": _ps_rows,
    "dist-autograd": _autograd_rows,
}
