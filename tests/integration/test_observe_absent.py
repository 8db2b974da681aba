"""Without the optional extras: workers in processes that cannot import opentelemetry or
prometheus_client make and serve every kind of call (``absent_job.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.observe_jobs import run_group

pytestmark = pytest.mark.timeout(120)


def test_observe_absent_extras_leave_calls_working(tmp_path: Path) -> None:
    outputs = run_group("tests.integration.absent_job", 2, [], tmp_path)
    assert "OK" in outputs[0].splitlines(), outputs[0]
