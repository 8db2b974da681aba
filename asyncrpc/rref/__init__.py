"""Floor L3, remote references: ``forks.py`` (one worker's fork bookkeeping and owner
values, the reference-counting protocol in action: built before anything that pickles),
``context.py`` (the ``RRefs`` feature: ``remote()`` and the calls handles make, built
after the outbox), ``handle.py`` (the ``RRef`` users hold), ``proxies.py`` (its proxies,
which run a method of the value on its owner) and ``values.py`` (how an owner's value
futures are waited on).

The runtime below never imports this package: the public API hands the agent factories
that build the bookkeeping and the feature from the agent's ports.
"""
