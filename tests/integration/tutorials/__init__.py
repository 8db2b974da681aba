"""PyTorch's RPC tutorials, each written once and run with either ``torch.distributed.rpc``
or ``asyncrpc`` (``--impl torch|asyncrpc``): the import is the only difference.

Run one by hand: ``python -m tests.integration.tutorials.rnn --impl asyncrpc --out DIR``.

``make test`` runs them at short lengths (``tests/integration/test_tutorials.py``). With
``--full`` each takes the default lengths of the pytorch/examples ``distributed/rpc``
program it stands for (episodes, epochs, batches, world sizes; synthetic data in place of
MNIST), and ``make examples-torch`` runs them so (``test_tutorials_full.py``), torch then
asyncrpc, comparing results and recording wall times:

=====================  ==============================================  =====================
program                upstream (``distributed/rpc/...``)              full length
=====================  ==============================================  =====================
``reinforce``          ``rl/main.py``                                  until solved (CartPole)
``batch_reinforce``    ``batch/reinforce.py``                          10 episodes x 500 steps
``batch_ps``           ``batch/parameter_server.py``                   5 trainers x 6 batches
``parameter_server``   ``parameter_server/rpc_parameter_server.py``    3 trainers x 1875 batches
``rnn``                ``rnn/main.py``                                 10 epochs x 5 batches
``ddp_rpc``            ``ddp_rpc/main.py``                             2 trainers x 100 x 10
``pipeline``           ``pipeline/main.py``                            3 batches, splits 1-8
=====================  ==============================================  =====================

The models stay small (the upstream's ResNet-50 and MNIST net are compute on two cores,
not RPC); each program's docstring says what else it changes and why.
"""
