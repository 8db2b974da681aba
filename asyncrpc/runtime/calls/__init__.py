"""Sub-floor L2.4, the calls: the outbox of outgoing calls (``outbox.py``: encoding once,
starting, timeouts, cancels, replies, over the table of ``pending.py``), the call pipeline
every call passes through (``pipeline.py``), and the dispatcher that runs received requests,
one ``ServedRequest`` each (``dispatch.py``; the record and what the lanes share with it
in ``served.py``; ``builtins.py``: where torch's own functions run), and the deadline of
the request being served (``deadline.py``). May import
``group/``, ``net/``, ``shm/`` and the runtime's base modules; never the agent.
"""
