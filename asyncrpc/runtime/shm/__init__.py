"""Sub-floor L2.1, same-host memory: large tensors for a peer on this host go through shared
memory chunks (``shm.py``) carved out of per-peer arenas (``arena.py``). Imports only the
runtime's base modules and the floors below.
"""
