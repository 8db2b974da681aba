"""Entry point: ``python -m examples.parameter_server [--trainers N] [--steps S]``."""

from __future__ import annotations

import sys

from examples.parameter_server.ps import main

sys.exit(main())
