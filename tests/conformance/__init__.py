"""torch's own RPC test suites run against asyncrpc (see ``suite.py`` and ``run.py``).

Not collected by pytest (no ``test_*.py`` files here): ``make conformance`` runs it.
"""
