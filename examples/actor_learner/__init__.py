"""IMPALA-style actors and learner over asyncrpc streams (see README.md)."""
