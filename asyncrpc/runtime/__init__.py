"""Floor L2, the loop side: one worker's event-loop agent and the parts it is made of.

The folders are sub-floors, lowest first; a module imports only from its own sub-floor or
lower ones (``tests/unit/test_layering.py`` checks it):

- the loose modules here: ``metrics.py`` (counters, the loop-lag probe);
- ``threads/``: the worker pool, the loop thread, hand-offs between threads;
- ``futures/``: ``asyncrpc.Future`` (torch's JitFuture contract), where its callbacks
  run, its bridges to torch, asyncio and concurrent futures;
- ``services.py``: what the runtime asks of the RRef layer above it;
- ``shm/``: same-host memory for large tensors;
- ``net/``: the listener (open before the join), the ``Network``: connections, one
  authenticated connection per peer, ordered delivery across reconnects, liveness, TLS,
  calls to self;
- ``group/``: joining the group (``join`` returns the frozen ``Group``), its members,
  graceful shutdown;
- ``calls/``: the ``Outbox`` (outgoing calls from encoding to their end), the call
  pipeline, the ``Dispatcher`` (one ``ServedRequest`` per received request), and in
  ``calls/streams/`` streaming calls, both ends;
- ``cuda/``: the device seam, stream scheduling and staged copies, and the device-map
  hook the agent plugs into the call pipeline;
- ``agent.py``: the composition root, built from the ``Group`` once joined, that wires
  the parts; ``current.py`` (the process's agent).
"""
