"""Sub-floor L2.46, lanes: a calling thread's own blocking connection to a peer, for its
synchronous calls (``client.py``), the threads that serve peers' lanes here
(``server.py``), the frames over one blocking socket (``frames.py``) and the lane's
handshake (``handshake.py``: the protocol's own machine, driven by a thread). May import
``calls/``, ``net/``, ``group/`` and the runtime's base modules; never the agent.
"""
