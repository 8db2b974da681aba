"""Sub-floor L2.2, the network: connections to the other workers and frames over them.

``listener.py`` (open before the join; parks what it accepts), ``network.py`` (the
worker's connections, built once joined), ``transport.py`` (one socket, framed),
``tls.py`` (mutual TLS contexts), ``loopback.py`` (calls to self), ``peers.py`` (one
authenticated connection per peer, dialling and "lost"), ``links.py`` (frames to a peer in
order across reconnects, refcount frames until read) and ``heartbeat.py`` (liveness of idle
connections). May import ``shm/`` and the runtime's base modules; never ``group/``,
``calls/`` or the agent.
"""
