"""What one Future costs: asyncrpc.Future (a torch.futures.Future) against torch's own.

    python bench/future_cost.py [--n 200000] [--rounds 5]

Prints the median over rounds of the time per future, in µs, for: making one; making and
completing it; making, completing and ``value()``; and a callback registered then run
(no event loop: the callback runs in the completing thread). asyncrpc's Future builds the
C++ future underneath and completes it too, which is what ``torch.futures.wait_all`` reads.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable

import torch

from asyncrpc.runtime.futures import Future


def _cases(cls: Callable[[], object]) -> dict[str, Callable[[], object]]:
    def make() -> object:
        return cls()

    def complete() -> object:
        f = cls()
        f.set_result(1)  # type: ignore[attr-defined]
        return f

    def value() -> object:
        f = cls()
        f.set_result(1)  # type: ignore[attr-defined]
        return f.value()  # type: ignore[attr-defined]

    def callback() -> object:
        f = cls()
        f.add_done_callback(_noop)  # type: ignore[attr-defined]
        f.set_result(1)  # type: ignore[attr-defined]
        return f

    return {"make": make, "make+set_result": complete, "+value()": value, "+callback": callback}


def _noop(_: object) -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    systems = {"asyncrpc.Future": Future, "torch.futures.Future": torch.futures.Future}
    print(f"{'µs per future (median)':24}" + "".join(f"{name:>22}" for name in systems))
    cases = {name: _cases(cls) for name, cls in systems.items()}
    for case in cases["asyncrpc.Future"]:
        row = f"{case:24}"
        for name in systems:
            fn = cases[name][case]
            times = [timeit.timeit(fn, number=args.n) / args.n * 1e6 for _ in range(args.rounds)]
            row += f"{statistics.median(times):22.2f}"
        print(row)


if __name__ == "__main__":
    main()
