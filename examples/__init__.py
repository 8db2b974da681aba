"""Runnable examples of asyncrpc: ``python -m examples.parameter_server`` and friends."""

import warnings

# torch warns at import when numpy is absent; the examples do not use numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
