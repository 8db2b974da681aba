"""Floor L1, the sans-I/O core: what goes on the wire and the bookkeeping it drives.

``wire/`` (frames and protocol messages), ``serde/`` (pickling with out-of-band tensors,
remote exceptions), ``refcount.py`` (RRef reference counting as a state machine),
``handshake.py`` (a connection's authenticated handshake as a state machine) and ``auth.py``
(its proofs). Nothing here imports asyncio, sockets or threads; outside ``serde/``, not even
torch.
"""
