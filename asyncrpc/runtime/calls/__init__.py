"""Sub-floor L2.4, the calls: outgoing calls awaiting replies (``pending.py``), the call
pipeline every call passes through (``pipeline.py``), and the dispatcher that runs received
requests (``dispatch.py``, with ``builtins.py``: where torch's own functions run). May import
``group/``, ``net/``, ``shm/`` and the runtime's base modules; never the agent.
"""
