"""``python -m asyncrpc.top``: a live view of a running group, read from its workers'
``/metrics`` endpoints (layer L4, standard library only).

The parts, bottom up: ``exposition`` reads Prometheus' text format, ``figures`` turns a
scrape into a worker's figures and two into rates and quantiles, ``scrape`` reads every
endpoint at once within a timeout, ``discover`` finds the endpoints in the group's
rendezvous store (``--rendezvous``), ``board`` keeps their recent history and marks the
silent ones, ``render`` makes a frame's text, ``screen`` shows it with curses.
"""

from __future__ import annotations

__all__: list[str] = []
