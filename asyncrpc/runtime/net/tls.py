"""Mutual TLS contexts for a worker's connections (layer L2.2).

Built from three PEM files: the worker's certificate and key, and the CA that signs every
worker's certificate. Both directions check the other side's certificate against that CA
(mutual TLS). Host names are not checked: workers dial addresses, not names, and who a
peer is gets proven again by the HMAC handshake inside the TLS channel.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from asyncrpc.errors import InitError

__all__ = ["TlsContexts", "configured_tls", "tls_contexts"]


@dataclass(frozen=True, slots=True)
class TlsContexts:
    server: ssl.SSLContext  # for connections this worker accepts
    client: ssl.SSLContext  # for connections it dials


def tls_contexts(cert: str, key: str, ca: str) -> TlsContexts:
    """Both contexts of mutual TLS from PEM paths.

    Raises:
        InitError: a file is missing or does not hold what it should.
    """
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.verify_mode = ssl.CERT_REQUIRED
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False  # see the module docstring
        client.verify_mode = ssl.CERT_REQUIRED
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(cert, key)
            context.load_verify_locations(ca)
    except (OSError, ssl.SSLError) as exc:
        raise InitError(f"cannot set up TLS from {cert!r}, {key!r}, {ca!r}: {exc}") from exc
    return TlsContexts(server, client)


def configured_tls(cert: str | None, key: str | None, ca: str | None) -> TlsContexts | None:
    """The contexts of mutual TLS when all three paths are set, else None (plain TCP).

    Raises:
        InitError: a file is missing or does not hold what it should.
    """
    if cert is None or key is None or not ca:
        return None
    return tls_contexts(cert, key, ca)
