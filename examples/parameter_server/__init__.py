"""Batch-updating parameter server with async trainers: ``python -m examples.parameter_server``."""
