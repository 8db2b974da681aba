"""Credit of a backward pass (``asyncrpc.autograd.credit``): shares never below one unit,
the pass is over exactly when all of it is back, and the nested replies still decide
when credit is lost or a hop fails."""

from __future__ import annotations

import pytest

from asyncrpc.autograd.credit import FULL, Credits, PassCredit, first_of, split
from asyncrpc.runtime.futures import Future


def test_split_gives_every_hop_at_least_one_unit_and_loses_none() -> None:
    credit = PassCredit(root=0, pass_id=7, amount=FULL)
    shares = split(credit, 3)
    assert shares is not None
    assert sum(s.amount for s in shares) == FULL
    assert all(s.amount >= 1 and s.root == 0 and s.pass_id == 7 for s in shares)
    assert split(PassCredit(0, 7, 2), 3) is None  # cannot split: the nested way
    assert split(credit, 0) is None


def test_a_chain_of_binary_splits_holds_62_levels() -> None:
    credit = PassCredit(0, 1, FULL)
    for _ in range(62):
        shares = split(credit, 2)
        assert shares is not None
        credit = shares[1]
    assert credit.amount == 1
    assert split(credit, 2) is None


def test_the_pass_is_over_only_when_all_credit_is_back() -> None:
    credits = Credits()
    pass_id = credits.begin()
    over = credits.over(pass_id)
    shares = split(PassCredit(0, pass_id, FULL), 3)
    assert shares is not None
    for share in shares[:2]:
        credits.hand_back(pass_id, share.amount)
    assert not over.done()
    credits.hand_back(pass_id, shares[2].amount)
    assert over.done()
    assert credits.passes_over_early == 1
    assert len(credits) == 0
    credits.hand_back(pass_id, 5)  # late or unknown credit is ignored
    credits.hand_back(999, FULL)


def test_over_asked_for_after_the_credit_is_back_is_done() -> None:
    # The future is made only when asked for (most passes never ask): asked late, it is
    # done at once; asked early, it completes with the last credit.
    credits = Credits()
    late, early = credits.begin(), credits.begin()
    waiting = credits.over(early)
    credits.hand_back(late, FULL)
    assert credits.over(late).done()
    assert not waiting.done()
    credits.hand_back(early, FULL - 1)
    assert not waiting.done()
    credits.hand_back(early, 1)
    assert waiting.done()
    credits.end(late)
    credits.end(early)
    assert credits.over(late).done()  # ended: nothing left to wait for


def test_first_of_takes_the_credit_or_the_replies_and_their_error() -> None:
    over, replies = Future[None](), Future[None]()
    done = first_of(over, replies)
    over.set_result(None)
    assert done.done()
    replies.set_exception(KeyError("late"))  # after the credit: changes nothing
    assert done.exception() is None

    over, replies = Future[None](), Future[None]()
    done = first_of(over, replies)
    replies.set_exception(KeyError("hop failed"))  # a failed pass hands no credit back
    with pytest.raises(KeyError):
        done.wait(1)

    over, replies = Future[None](), Future[None]()
    done = first_of(over, replies)
    replies.set_result(None)  # the credit was lost: the replies end the pass
    assert done.done()
    assert done.exception() is None
