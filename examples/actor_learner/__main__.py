"""Entry point: ``python -m examples.actor_learner [--actors N] [--unrolls U]``."""

from __future__ import annotations

import sys

from examples.actor_learner.impala import main

sys.exit(main())
