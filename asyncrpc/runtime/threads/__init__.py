"""Sub-floor L2.01, the threads of one worker and the hand-offs between them.

``pool.py``: the ``WorkerPool`` that runs synchronous functions (and stands a thread in
for one blocked on a reply, told through ``blocking.py``); ``loopinbox.py``: what other
threads hand the loop, one wake-up per batch; ``loopthread.py``: the loop thread of a
synchronous program; ``handoffs.py``: how many hand-offs of each kind happened. Imports
nothing of the runtime above it.
"""
