"""A model split across two workers, trained through RRef proxies.

Run: ``python -m examples.model_parallel``.
"""
