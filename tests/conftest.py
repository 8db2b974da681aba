"""What every test directory shares: worker and scenario processes forked from a server
that imported torch once (``asyncrpc.testing.prefork``), not fresh interpreters.

A fresh interpreter importing torch and asyncrpc costs about 2 s of CPU here, and the
integration tests start hundreds. ``ASYNCRPC_TEST_PREFORK=0`` starts every process fresh
(to rule the server out when a test behaves differently). The server starts on the first
process a test asks for, so runs without processes never pay for it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from asyncrpc.testing import launcher
from asyncrpc.testing.prefork import Preforker

# The modules every worker and scenario process imports before it does anything.
PRELOAD = ("torch", "asyncrpc", "asyncrpc.testing.worker", "tests.scenarios.__main__")


@pytest.fixture(scope="session", autouse=True)
def _forked_processes() -> Iterator[None]:
    if os.environ.get("ASYNCRPC_TEST_PREFORK", "1") == "0":
        yield
        return
    server = Preforker(PRELOAD, cwd=launcher.REPO_ROOT, env=launcher.repo_env())
    launcher.use_preforker(server)
    try:
        yield
    finally:
        launcher.use_preforker(None)
        server.close()
