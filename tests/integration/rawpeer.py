"""For tests that talk to a worker of the running group from raw sockets: the address a
worker published, and whether it closes a connection fed some bytes."""

from __future__ import annotations

import socket

from asyncrpc.protocol.address import PeerAddress
from asyncrpc.runtime.current import current_agent


def published_address(rank: int) -> PeerAddress:
    """The address ``rank`` published at rendezvous (read in the store if not met yet)."""
    agent = current_agent()
    agent.group.directory.worker_info(rank)  # its address is read when first needed
    return agent.group.addresses[rank]


def closed_by_peer(port: int, data: bytes, timeout: float) -> tuple[bool, bytes]:
    """Send ``data`` on a fresh raw connection; return (closed by the peer in time, bytes got)."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(data)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            return True, received
        except TimeoutError:
            return False, received
    return True, received
