"""A preload library that answers reverse name lookups with the numeric address, for the
rendezvous simulation's worker processes (a bench helper, no asyncrpc layer).

Why: torch's TCPStore client, on every connection, formats the store's address with
``getnameinfo`` (no ``NI_NUMERICHOST``), a reverse DNS lookup. Its server does the same
for every connection it accepts, on its one loop thread. A real job spreads the clients'
lookups over its nodes' resolvers; the simulation runs a thousand clients on one host,
whose resolver here (a sandbox's) answers about 50 lookups a second and stalls the rest
5 s each (``python -m bench.numeric_names --probe 200`` shows it). The
simulation's workers load this library (``LD_PRELOAD``) so their lookups cost what a
node's own resolver would charge one worker: nothing measurable. Callers that demand a
name (``NI_NAMEREQD``) still get the real lookup.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# Our own interposer: add NI_NUMERICHOST unless the caller insists on a name, then call
# the C library's getnameinfo.
_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>

typedef int (*lookup_fn)(const struct sockaddr *, socklen_t, char *, socklen_t,
                         char *, socklen_t, int);

int getnameinfo(const struct sockaddr *addr, socklen_t addrlen, char *host,
                socklen_t hostlen, char *serv, socklen_t servlen, int flags) {
    static lookup_fn next_lookup;
    if (next_lookup == 0) {
        next_lookup = (lookup_fn)dlsym(RTLD_NEXT, "getnameinfo");
    }
    if ((flags & NI_NAMEREQD) == 0) {
        flags |= NI_NUMERICHOST;
    }
    return next_lookup(addr, addrlen, host, hostlen, serv, servlen, flags);
}
"""


def build(directory: Path | None = None) -> Path | None:
    """Compile the library into ``directory`` (a new temporary one by default).

    Returns:
        The library's path, or None where no C compiler is found or the build fails
        (the simulation then runs with this host's resolver, and says so).
    """
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    where = directory or Path(tempfile.mkdtemp(prefix="asyncrpc-names-"))
    source, library = where / "numeric_names.c", where / "numeric_names.so"
    source.write_text(_SOURCE)
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
        capture_output=True,
        timeout=120,
        check=False,
    )
    return library if built.returncode == 0 else None


def probe(count: int) -> list[tuple[int, float]]:
    """Reverse-look up ``::ffff:127.0.0.1`` (how a dual-stack listener sees a local IPv4
    peer, and what /etc/hosts does not list) ``count`` times in a row; the lookups that
    took over half a second, as (index, seconds)."""
    slow = []
    for index in range(count):
        began = time.perf_counter()
        socket.getnameinfo(("::ffff:127.0.0.1", 1000 + index, 0, 0), socket.NI_NUMERICSERV)
        took = time.perf_counter() - began
        if took > 0.5:
            slow.append((index, round(took, 2)))
    return slow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", type=int, default=0, help="time this many lookups")
    args = parser.parse_args(argv)
    if args.probe:
        began = time.perf_counter()
        slow = probe(args.probe)
        print(f"{args.probe} lookups in {time.perf_counter() - began:.2f} s; slow: {slow}")
    else:
        print(build())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
