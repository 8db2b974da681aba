"""What TLS costs asyncrpc: small-call latency and a 64 MiB echo, plain vs mutual TLS.

    python bench/tls_cost.py [--calls 2000] [--echoes 5] [--rounds 3]

Each round starts a fresh pair of workers (this process and one server on 127.0.0.1) per
mode, plain and TLS alternating, with certificates made by ``openssl`` in a temporary
directory. Prints p50 latency of a no-op ``rpc_sync`` and the echo bandwidth (2 x bytes /
median time), with the TLS/plain ratios. Also the time of the first call to a peer (dial,
handshake(s), call) against a later one.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import asyncrpc
from asyncrpc.bench import workloads as fns
from asyncrpc.testing import free_port, spawn_worker, stop_workers


def _openssl(args: list[str], directory: Path) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30)


def make_pki(directory: Path) -> list[str]:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
              "-subj", "/CN=bench CA"], directory)  # fmt: skip
    _openssl(["req", *ec, "-keyout", "w.key", "-out", "w.csr", "-subj", "/CN=bench worker"],
             directory)  # fmt: skip
    (directory / "ext.cnf").write_text(
        "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(["x509", "-req", "-in", "w.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
              "-CAcreateserial", "-out", "w.pem", "-days", "2", "-extfile", "ext.cnf"],
             directory)  # fmt: skip
    return [str(directory / "w.pem"), str(directory / "w.key"), str(directory / "ca.pem")]


def measure(tls: list[str] | None, calls: int, echoes: int, log_dir: Path) -> dict[str, float]:
    init = f"tcp://127.0.0.1:{free_port()}"
    extra = [] if tls is None else ["--tls-cert", tls[0], "--tls-key", tls[1], "--tls-ca", tls[2]]
    server = spawn_worker("server", 1, 2, init, log_dir=log_dir, extra_args=extra)
    options = asyncrpc.RpcBackendOptions(init_method=init, rpc_timeout=120.0)
    if tls is not None:
        options.tls_cert, options.tls_key, options.tls_ca = tls
    try:
        asyncrpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=options)
        started = time.perf_counter()
        asyncrpc.rpc_sync("server", fns.noop)
        first = time.perf_counter() - started
        samples = []
        for _ in range(calls):
            started = time.perf_counter()
            asyncrpc.rpc_sync("server", fns.noop)
            samples.append(time.perf_counter() - started)
        big = torch.ones(16 << 20)  # 64 MiB of float32
        asyncrpc.rpc_sync("server", fns.echo, args=(big,))  # warm-up: buffers, pools
        times = []
        for _ in range(echoes):
            started = time.perf_counter()
            asyncrpc.rpc_sync("server", fns.echo, args=(big,))
            times.append(time.perf_counter() - started)
        asyncrpc.shutdown()
    finally:
        stop_workers([server], timeout=30)
    return {
        "first_call_ms": first * 1e3,
        "p50_us": statistics.median(samples) * 1e6,
        "echo_mb_s": 2 * big.nbytes / statistics.median(times) / 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--echoes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tls = make_pki(Path(tmp))
        results: dict[str, list[dict[str, float]]] = {"plain": [], "tls": []}
        for _ in range(args.rounds):  # alternate, so drifts of the machine hit both
            results["plain"].append(measure(None, args.calls, args.echoes, Path(tmp)))
            results["tls"].append(measure(tls, args.calls, args.echoes, Path(tmp)))
    print(f"{'':22s}{'plain':>10s}{'TLS':>10s}{'TLS/plain':>11s}")
    for key, label in (("p50_us", "no-op p50 (µs)"), ("echo_mb_s", "64 MiB echo (MB/s)"),
                       ("first_call_ms", "first call (ms)")):  # fmt: skip
        plain = statistics.median(r[key] for r in results["plain"])
        tls_value = statistics.median(r[key] for r in results["tls"])
        print(f"{label:22s}{plain:10.1f}{tls_value:10.1f}{tls_value / plain:10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
