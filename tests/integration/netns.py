"""Network namespaces for multi-host tests: hosts of our own, on one machine (test layer).

``hosts(n)`` creates n namespaces, each with one veth interface and an address in
10.213.0.0/24, joined by a bridge in a namespace of their own; addresses exist only inside
them, and everything is removed on exit. Needs root and iproute2: ``unavailable()`` says why
not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.213.0"


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def exec_prefix(self) -> list[str]:
        """Run a command inside this host (``ip netns exec`` execs it: the PID is its own)."""
        return ["ip", "netns", "exec", self.namespace]


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip command is missing"
    probe = f"arpc-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    tag = uuid.uuid4().hex[:6]
    bridge_ns = f"arpc-br-{tag}"
    made: list[str] = []
    try:
        _ip("netns", "add", bridge_ns)
        made.append(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        found = []
        for i in range(count):
            ns, inside, outside = f"arpc-h{i}-{tag}", f"eth{i}", f"port{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", inside, "netns", ns, "type", "veth",
                "peer", "name", outside, "netns", bridge_ns)  # fmt: skip
            address = f"{SUBNET}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", bridge_ns, "link", "set", outside, "master", "br0")
            _ip("-n", bridge_ns, "link", "set", outside, "up")
            found.append(Host(ns, address))
        yield found
    finally:
        for ns in reversed(made):  # deleting a namespace removes its interfaces too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
