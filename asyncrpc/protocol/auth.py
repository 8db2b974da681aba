"""Mutual HMAC-SHA256 challenge-response for the connection handshake (layer L1, sans-I/O).

Both sides hold a shared key. The dialer's Hello carries a fresh nonce; the acceptor
answers with a nonce of its own and its proof; the dialer checks it and sends its proof.
Each proof is an HMAC over both nonces and both claimed identities (name and rank), tagged
with the prover's role, so a proof cannot be replayed on another connection, reflected
back to its sender, or moved to another claimed name. Proofs are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct

__all__ = [
    "ACCEPTOR",
    "DIALER",
    "KEY_ENV",
    "NONCE_SIZE",
    "key_bytes",
    "new_key",
    "new_nonce",
    "proof",
    "verify",
]

ACCEPTOR = b"asyncrpc-acceptor"
DIALER = b"asyncrpc-dialer"
NONCE_SIZE = 32
KEY_ENV = "ASYNCRPC_AUTH_KEY"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def new_key() -> bytes:
    """A random group key (what rank 0 makes when no key is configured)."""
    return secrets.token_bytes(32)


def key_bytes(key: bytes | str | None) -> bytes | None:
    """The configured key as bytes: the option if given, else ``ASYNCRPC_AUTH_KEY``."""
    if key is None:
        key = os.environ.get(KEY_ENV) or None
    if key is None:
        return None
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise ValueError("the auth key is empty")
    return raw


def _identity(name: str, rank: int) -> bytes:
    encoded = name.encode()
    return struct.pack("!qI", rank, len(encoded)) + encoded


def proof(
    key: bytes,
    role: bytes,
    dialer_nonce: bytes,
    acceptor_nonce: bytes,
    dialer: tuple[str, int],
    acceptor: tuple[str, int],
) -> bytes:
    """The proof that the side playing ``role`` holds ``key`` on this handshake."""
    message = b"".join(
        (
            role,
            struct.pack("!I", len(dialer_nonce)),
            dialer_nonce,
            struct.pack("!I", len(acceptor_nonce)),
            acceptor_nonce,
            _identity(*dialer),
            _identity(*acceptor),
        )
    )
    return hmac.new(key, message, hashlib.sha256).digest()


def verify(expected: bytes, received: object) -> bool:
    """Constant-time comparison; anything that is not bytes fails."""
    return isinstance(received, bytes) and hmac.compare_digest(expected, received)
