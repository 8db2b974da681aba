"""Entry point: ``python -m examples.pipeline_parallel [--steps S] [--micro-batches M]``."""

from __future__ import annotations

import sys

from examples.pipeline_parallel.pp import main

sys.exit(main())
