"""Imported first by a worker (``--import tests.integration.cuda_world_on``): puts it in the
fake CUDA world of ``cuda_world`` (test layer)."""

from __future__ import annotations

from tests.integration import cuda_world

cuda_world.install()
