"""Floor L3, remote references: ``handle.py`` (the ``RRef`` users hold, its proxies) and
``context.py`` (one agent's owner values and the reference-counting protocol in action).

The runtime below never imports this package: the public API hands ``RRefContext`` to the
agent as its RRef service.
"""
