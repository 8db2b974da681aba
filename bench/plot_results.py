"""Draw the chart of a saved run: ``python bench/plot_results.py RESULTS.json OUT.png``.

The same chart ``python -m asyncrpc.bench --plot`` draws, made afterwards from ``--json``
output (needs matplotlib: ``pip install matplotlib``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrpc.bench.report import PlotUnavailableError, write_plot


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        write_plot(json.loads(Path(argv[0]).read_text()), argv[1])
    except PlotUnavailableError as exc:
        print(f"plot_results: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
