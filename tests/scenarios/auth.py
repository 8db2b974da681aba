"""The authentication scenario (test layer): rank 0 ("a0") of a group of three.

a1 shares our key (ASYNCRPC_AUTH_KEY), a2 has another one. From raw sockets, we attack a1
the ways a stranger who reaches its port could, each with a request whose payload would
create ``--marker`` if it were ever unpickled and run.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path
from typing import Any

import asyncrpc
from asyncrpc.protocol import auth
from asyncrpc.protocol.serde import Serializer
from asyncrpc.protocol.wire import PROTOCOL_VERSION, FrameDecoder, encode_frame
from asyncrpc.protocol.wire.messages import Auth, CallMode, Hello, Request, decode_message
from asyncrpc.runtime.current import current_agent
from tests.integration import remote_fns as fns
from tests.scenarios.common import options, report
from tests.scenarios.registry import option, scenario

_SERIALIZER = Serializer()


def frame(message: Any, value: object = None) -> bytes:
    payload, segments, _, _ = _SERIALIZER.dumps(value) if value is not None else (b"", [], [], None)
    return b"".join(bytes(p) for p in encode_frame(message.to_fields(), payload, segments))


def evil_request(marker: str) -> bytes:
    # Unpickling this and running it creates the marker file.
    return frame(
        Request(1, 0.0, CallMode.CALL, "pathlib.Path.touch"), (Path.touch, (Path(marker),), {})
    )


def closed_by_worker(sock: socket.socket, timeout: float) -> bool:
    """True once the worker closes the connection (EOF or reset) within ``timeout``."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:  # bounded
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def attacks(host: str, port: int, marker: str) -> dict[str, bool]:
    results = {}
    # 1. A well-formed Hello claiming a2 (a name a1 knows, not connected to it), then a
    #    wrong proof and a request right behind it.
    with socket.create_connection((host, port)) as sock:
        sock.sendall(frame(Hello(PROTOCOL_VERSION, "a2", 2, auth.new_nonce())))
        decoder, frames = FrameDecoder(), list[Any]()
        sock.settimeout(5.0)
        while not frames:  # bounded by the timeout: the reply comes at once
            frames = decoder.feed(sock.recv(65536))
        reply = decode_message(frames[0].fields)
        results["challenged"] = getattr(reply, "accepted", False) is True
        sock.sendall(frame(Auth(b"\0" * 32)) + evil_request(marker))
        results["wrong_proof_closed"] = closed_by_worker(sock, 5.0)
    # 2. A request with no handshake at all.
    with socket.create_connection((host, port)) as sock:
        sock.sendall(evil_request(marker))
        results["no_handshake_closed"] = closed_by_worker(sock, 5.0)
    # 3. A Hello whose header is far over the pre-auth cap.
    with socket.create_connection((host, port)) as sock:
        sock.sendall(frame(Hello(PROTOCOL_VERSION, "a0" * 5000, 0, auth.new_nonce())))
        results["big_hello_closed"] = closed_by_worker(sock, 5.0)
    # 4. Connect and say nothing: the handshake deadline (1 s for a1) closes it.
    with socket.create_connection((host, port)) as sock:
        results["idle_closed"] = closed_by_worker(sock, 10.0)
    return results


@scenario("auth_attacks", option("--marker", required=True), rpc_timeout=20.0,
          shutdown_timeout=20.0)  # fmt: skip
def auth_attacks(args: argparse.Namespace) -> int:
    """Rank 0 of {a0, a1, a2}: attack a1 from raw sockets, then call a1 and a2."""
    marker = args.marker
    asyncrpc.init_rpc("a0", rank=0, world_size=3, rpc_backend_options=options(args))
    out: dict[str, Any] = {"a1_add": asyncrpc.rpc_sync("a1", fns.add, args=(2, 3))}
    before = asyncrpc.rpc_sync("a1", asyncrpc.get_metrics)["auth_failures"]
    a1 = current_agent().group.addresses[1]
    out.update(attacks(a1.host, a1.port, marker))
    out["a1_auth_failures"] = (
        asyncrpc.rpc_sync("a1", asyncrpc.get_metrics)["auth_failures"] - before
    )
    out["a1_still_serves"] = asyncrpc.rpc_sync("a1", fns.add, args=(1, 1)) == 2
    try:
        asyncrpc.rpc_sync("a2", fns.add, args=(1, 1))
        out["a2_error"] = None
    except Exception as exc:
        out["a2_error"] = type(exc).__name__
    out["a0_auth_failures"] = asyncrpc.get_metrics()["auth_failures"]
    out["marker_exists"] = os.path.exists(marker)
    asyncrpc.shutdown(graceful=False)
    report(out)
    return 0
