"""Entry point of ``python -m asyncrpc.bench`` (see ``asyncrpc.bench.cli``)."""

from __future__ import annotations

import sys

from asyncrpc.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
