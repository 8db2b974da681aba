"""Mutual TLS between real worker processes; the key handshake still runs inside it.

Certificates are made by ``openssl`` for the test (skipped when it is missing): one CA
signs the workers' certificate; a stranger's certificate from another CA is refused, and
so is a plain TCP client.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import pytest

from asyncrpc.testing import free_port, spawn_worker, stop_workers
from tests import scenarios

pytestmark = pytest.mark.timeout(120)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_pki(directory: Path, prefix: str = "") -> None:
    """``{prefix}ca.pem`` and a ``{prefix}worker.pem``/``.key`` it signs (EC P-256)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", f"{prefix}ca.key", "-out", f"{prefix}ca.pem",
             "-days", "2", "-subj", "/CN=asyncrpc test CA", cwd=directory)  # fmt: skip
    _openssl("req", *ec, "-keyout", f"{prefix}worker.key", "-out", f"{prefix}worker.csr",
             "-subj", "/CN=asyncrpc worker", cwd=directory)  # fmt: skip
    (directory / "ext.cnf").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl("x509", "-req", "-in", f"{prefix}worker.csr", "-CA", f"{prefix}ca.pem",
             "-CAkey", f"{prefix}ca.key", "-CAcreateserial", "-out", f"{prefix}worker.pem",
             "-days", "2", "-extfile", "ext.cnf", cwd=directory)  # fmt: skip


def _refused(host: str, port: int, context: ssl.SSLContext | None) -> bool:
    """True when t1 refuses this client: the TLS handshake fails or the connection drops."""
    try:
        with socket.create_connection((host, port), timeout=5) as raw:
            if context is None:
                raw.sendall(b"\x00" * 64)  # plain bytes where TLS is expected
                return raw.recv(1024) == b""
            with context.wrap_socket(raw) as tls:
                tls.sendall(b"\x00" * 64)
                return tls.recv(1024) == b""
    except (ssl.SSLError, ConnectionError, TimeoutError):
        return True


def test_tls_calls_and_tensors_over_mutual_tls(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is missing")
    make_pki(tmp_path)
    make_pki(tmp_path, prefix="other-")
    init = f"tcp://127.0.0.1:{free_port()}"
    tls_args = ["--tls-cert", str(tmp_path / "worker.pem"), "--tls-key",
                str(tmp_path / "worker.key"), "--tls-ca", str(tmp_path / "ca.pem")]  # fmt: skip
    worker = spawn_worker("t1", 1, 2, init, log_dir=tmp_path, shutdown_timeout=20.0,
                          extra_args=tls_args)  # fmt: skip
    driver = scenarios.start("tls", "--init-method", init, "--tls-dir", str(tmp_path))
    try:
        host, port = json.loads(driver.wait_line("READY", 60.0).split(" ", 1)[1])
        stranger = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        stranger.check_hostname = False
        stranger.load_cert_chain(tmp_path / "other-worker.pem", tmp_path / "other-worker.key")
        stranger.load_verify_locations(tmp_path / "ca.pem")  # trusts t1, but t1 not it
        refusals = {"plain": _refused(host, port, None), "other_ca": _refused(host, port, stranger)}
        trusted = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        trusted.check_hostname = False
        trusted.load_cert_chain(tmp_path / "worker.pem", tmp_path / "worker.key")
        trusted.load_verify_locations(tmp_path / "ca.pem")
        with (
            socket.create_connection((host, port), timeout=5) as raw,
            trusted.wrap_socket(raw) as tls,
        ):
            tls_version = tls.version()  # t1 speaks TLS, with the certificate our CA signed
        driver.send("POKED")
        code, obs = driver.result(60.0)
    finally:
        driver.kill()
        codes = stop_workers([worker], timeout=20.0)
    logs = driver.text() + worker.log()
    assert code == 0, logs
    assert obs["add"]["value"] == 5, logs
    assert obs["echo_ok"]["value"] is True
    assert refusals == {"plain": True, "other_ca": True}
    assert tls_version in ("TLSv1.2", "TLSv1.3")
    assert obs["still_serves"]["value"] == 2
    assert obs["shutdown"]["error"] is None
    assert codes == [0], logs
