"""The same program on torch.distributed.rpc and on asyncrpc, and its async rewrite.

Run: ``python -m examples.torch_migration``.
"""
