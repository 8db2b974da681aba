"""``TrackGrads``: the policy of stream items distributed autograd follows. Both sides list
each message's tensors requiring grad in the same order, one message after another."""

from __future__ import annotations

import torch

from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.serde.policy import DEFAULT, TrackGrads


def test_TrackGrads_lists_each_messages_grads_in_the_same_order_on_both_sides() -> None:
    serializer = Serializer()
    sender, receiver = TrackGrads(DEFAULT), TrackGrads(DEFAULT)
    a = torch.ones(2, requires_grad=True)
    b = torch.zeros(100_000, requires_grad=True)  # a segment; ``a`` rides in the pickle
    plain = torch.ones(3)
    for message in ([b, plain, a], {"x": a}):
        payload, segments, _, _ = serializer.dumps(message, policy=sender)
        sent = sender.take()
        back = serializer.loads(payload, [bytes(v) for v, _ in segments], policy=receiver)
        received = receiver.take()
        assert [t.shape for t in sent] == [t.shape for t in received]
        assert all(t.requires_grad for t in received)
    assert sender.take() == []  # taken: the next message starts empty
    assert isinstance(back, dict)


def test_TrackGrads_lists_nothing_for_a_message_without_grad() -> None:
    serializer = Serializer()
    policy = TrackGrads(DEFAULT)
    serializer.dumps([torch.ones(4), 3], policy=policy)
    assert policy.take() == []
