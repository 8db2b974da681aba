"""Sub-floor L2.42, streaming calls, one room: the ``StreamHub`` that opens streams,
routes their frames and ends them with the agent (``hub.py``), the producing side that
drives a generator within the consumer's credit (``producer.py``), the consuming side's
state on the loop (``consumer.py``) and the ``Stream`` the application iterates
(``stream.py``); client streams are the same streams opened by the callee on the caller's
iterables (``sources.py``), and a ``Bidi`` pairs one of each (``bidi.py``). The wire's side
is ``protocol/wire/stream.py``. May import ``calls/`` and everything below it.
"""
