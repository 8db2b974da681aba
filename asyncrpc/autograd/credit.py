"""Knowing early that a distributed backward pass is over (layer L3): credit.

A backward pass is a tree of hops, each an RPC whose reply waits for the hops it started
(torch's FAST mode nests them the same way), so the worker that called ``backward`` hears
the pass is over only once every reply has come back up the tree: in a chain
A -> B -> C -> D, two replies travel after D's pass ended, carrying nothing.

Credit (weight-throwing termination detection) lets the root know at the moment the last
pass ends. The root starts with ``FULL`` credit; a worker that runs a hop's pass splits
the hop's credit among the hops it sends on, or, when it sends none, hands the credit
back to the root: in its reply when the root called it, else in a call of its own. The
pass is over when the root holds ``FULL`` again, since credit is handed back only after a
pass that has accumulated its gradients and sent all its hops. The nested replies still
come (and still carry errors: a pass that fails hands no credit back); credit only lets
the root stop waiting for acknowledgements. Losing a credit message costs nothing but
that: the root then finishes when the nested replies arrive, as before.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, NamedTuple

from asyncrpc.runtime.futures import Future, add_hook, try_set_exception, try_set_result

__all__ = ["FULL", "Credits", "PassCredit", "first_of", "split"]

# The root's credit. Split in equal integer shares, it lasts 62 levels of binary fan-out;
# a hop whose credit cannot be split (fewer units than hops) sends its hops without
# credit and hands its own back once they have all replied (the nested way).
FULL = 1 << 62


class PassCredit(NamedTuple):
    """The credit a hop carries: which pass, its root, and how much."""

    root: int  # the rank of the worker that called backward
    pass_id: int
    amount: int


def split(credit: PassCredit, hops: int) -> list[PassCredit] | None:
    """``credit`` in ``hops`` shares of at least one unit each (the first takes what does
    not divide), or None when it has fewer units than that."""
    if hops <= 0 or credit.amount < hops:
        return None
    share, rest = divmod(credit.amount, hops)
    amounts = [share + rest] + [share] * (hops - 1)
    return [PassCredit(credit.root, credit.pass_id, amount) for amount in amounts]


class Credits:
    """The passes this worker is the root of, and the credit handed back to each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        # id -> [credit held, the future of ``over`` if asked for yet]
        self._passes: dict[int, list[Any]] = {}
        self.passes_over_early = 0  # passes whose credit came back before the replies
        self.calls = 0  # credit handed back in calls of their own (credit_returned)

    def begin(self) -> int:
        """A new pass; its id."""
        with self._lock:
            pass_id = next(self._ids)
            self._passes[pass_id] = [0, None]
        return pass_id

    def over(self, pass_id: int) -> Future[None]:
        """A future completed once all the credit of pass ``pass_id`` is back (done at
        once where it is, or where the pass ended). Made only when asked for: most passes
        end without anyone waiting on it (their one hop's reply brings the credit back)."""
        with self._lock:
            entry = self._passes.get(pass_id)
            if entry is not None:
                if entry[1] is None:
                    entry[1] = Future()
                return entry[1]  # type: ignore[no-any-return]
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def hand_back(self, pass_id: int, amount: int) -> None:
        """Credit returned to pass ``pass_id`` (unknown or ended passes ignore it)."""
        with self._lock:
            entry = self._passes.get(pass_id)
            if entry is None:
                return
            entry[0] += amount
            if entry[0] < FULL:
                return
            del self._passes[pass_id]
            self.passes_over_early += 1
            over = entry[1]
        if over is not None:
            try_set_result(over, None)

    def end(self, pass_id: int) -> None:
        """Forget pass ``pass_id`` (its replies came back, or it failed)."""
        with self._lock:
            self._passes.pop(pass_id, None)

    def __len__(self) -> int:
        return len(self._passes)


def first_of(over: Future[None], replies: Future[Any]) -> Future[None]:
    """Done when the credit is back (``over``) or when the nested replies are (``replies``:
    then with their error, if any)."""
    done: Future[None] = Future()

    def from_replies(replies: Future[Any]) -> None:
        error = replies.exception()
        if error is None:
            try_set_result(done, None)
        else:
            try_set_exception(done, error)

    add_hook(over, lambda _: try_set_result(done, None))
    add_hook(replies, from_replies)
    return done
