"""Sub-floor L2.02, the futures: ``asyncrpc.Future`` with torch's JitFuture contract.

``future.py`` is the public home of the names (``Future``, ``collect_all``, ``wait_all``)
and of the runtime's package-private helpers over a future (completing it from the loop,
chaining without a new public future); ``core.py`` holds the class; ``callbacks.py`` and
``callbackpool.py`` decide where callbacks run (batched wake-ups of one pool thread);
``bridge.py`` converts to and from torch, asyncio and concurrent futures. Imports only the
``threads/`` room and the floors below the runtime.
"""

from asyncrpc.runtime.futures.future import (
    Future,
    FutureAlreadyDoneError,
    FutureNotDoneError,
    add_hook,
    chain,
    collect_all,
    copy_outcome,
    make_sibling,
    on_cancel,
    on_value,
    set_default_callback_loop,
    try_set_exception,
    try_set_result,
    wait_all,
)

__all__ = [
    "Future",
    "FutureAlreadyDoneError",
    "FutureNotDoneError",
    "add_hook",
    "chain",
    "collect_all",
    "copy_outcome",
    "make_sibling",
    "on_cancel",
    "on_value",
    "set_default_callback_loop",
    "try_set_exception",
    "try_set_result",
    "wait_all",
]
