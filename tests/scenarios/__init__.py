"""Scenario processes for the integration tests (test layer).

A scenario is a program that joins a group of its own as a separate process (the pytest
process already runs the shared group's "driver"), does one thing and prints one line
``RESULT {json}`` of observations. ``python -m tests.scenarios NAME [options]`` is the one
entry point (``__main__.py``); ``registry.py`` holds the ``@scenario`` decorator and the one
option parser; ``start`` (``launch.py``) is the one way tests start a scenario. The
scenarios live in one module per topic (auth, autograd, ddp, dynamic, faults, heal, hosts,
init, rref, shm, stream).
"""

from tests.scenarios.launch import Observations, ScenarioProcess, cpp_log_lines, start

__all__ = ["Observations", "ScenarioProcess", "cpp_log_lines", "start"]
