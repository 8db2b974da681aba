"""Floor L1, the sans-I/O core: what goes on the wire and the bookkeeping it drives.

``wire/`` (frames and protocol messages), ``serde/`` (pickling with out-of-band tensors,
remote exceptions) and ``refcount.py`` (RRef reference counting as a state machine). Nothing
here imports asyncio, sockets or threads; ``wire/`` and ``refcount.py`` not even torch.
"""
