"""PyTorch's RPC tutorials, each written once and run with either ``torch.distributed.rpc``
or ``asyncrpc`` (``--impl torch|asyncrpc``): the import is the only difference.

Run one by hand: ``python -m tests.integration.tutorials.rnn --impl asyncrpc --out DIR``.
"""
