"""Entry point: ``python -m examples.model_parallel [--steps S]``."""

from __future__ import annotations

import sys

from examples.model_parallel.mp import main

sys.exit(main())
