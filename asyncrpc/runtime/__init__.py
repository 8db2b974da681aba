"""Floor L2, the loop side: one worker's event-loop agent and the parts it is made of.

``agent.py`` wires them: ``transport.py`` (connections), ``peers.py`` (one connection per
peer, the handshake), ``pending.py`` (outgoing calls awaiting replies, timeouts),
``dispatch.py`` (running received requests), ``pipeline.py`` (the hooks every call passes
through), ``threadpool.py`` (threads for synchronous functions), ``loopback.py`` (calls to
self), ``shutdown.py`` (graceful shutdown), ``rendezvous.py``, ``loopthread.py``,
``metrics.py``, ``options.py``, ``future.py`` (``asyncrpc.Future``: the class in
``jitfuture.py``, where callbacks run in ``callbacks.py``, the bridges to asyncio, concurrent
and torch futures in ``futurebridge.py``), ``current.py`` (the process's agent) and
``services.py`` (what the agent asks of the RRef layer above it).
"""
