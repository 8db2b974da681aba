"""Worker options and identities: ``RpcBackendOptions`` and ``WorkerInfo`` (layer L1).

``RpcBackendOptions`` mirrors torch's ``TensorPipeRpcBackendOptions`` so code written for
``torch.distributed.rpc`` only changes its import; a torch options object passed in is read
field by field by ``coerce_options``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncrpc.errors import InitArgumentError, InitError, WorkerNameError
from asyncrpc.protocol.wire import DEFAULT_MAX_FRAME_SIZE

__all__ = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_RPC_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
    "RpcBackendOptions",
    "WorkerInfo",
    "check_worker_name",
    "coerce_options",
]

DEFAULT_RPC_TIMEOUT = 60.0
DEFAULT_INIT_METHOD = "env://"
# torch's sentinels: -1 means "use the default timeout", 0 means "no timeout".
UNSET_RPC_TIMEOUT = -1.0

# Worker names as torch accepts them: letters, digits, '_', ':' and '-', under 128 chars.
MAX_NAME_LEN = 128
# A poll longer than this is a spinning thread, not a wait that saves a wake-up.
_MAX_POLL_US = 10_000
_NAME = re.compile(r"[A-Za-z0-9_:\-]+")


def check_worker_name(name: object) -> None:
    """Reject a worker name torch would reject too.

    Raises:
        WorkerNameError: ``name`` is not a string, is empty, is 128 characters or longer,
            or has characters outside ``[A-Za-z0-9_:-]``.
    """
    if not isinstance(name, str) or not name:
        raise WorkerNameError(f"worker name {name!r}: a worker name must be non-empty")
    if len(name) >= MAX_NAME_LEN:
        raise WorkerNameError(
            f"worker name {name[:20]!r}... ({len(name)} characters) must be shorter than "
            f"{MAX_NAME_LEN}"
        )
    if _NAME.fullmatch(name) is None:
        raise WorkerNameError(
            f"worker name {name!r} is not valid: Worker name must match [A-Za-z0-9_:-]+"
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's identity: its unique ``name`` and its rank ``id`` (torch's names).

    Attributes:
        name: the worker's name, unique in its group.
        id: its rank.

    Raises:
        WorkerNameError: ``name`` is not a valid worker name.
    """

    name: str
    id: int

    def __post_init__(self) -> None:
        check_worker_name(self.name)

    def __str__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


def _device_key(device: Any) -> str:
    # torch.device('cuda', 0) and 'cuda:0' and 0 all mean the same device.
    if isinstance(device, int):
        return f"cuda:{device}"
    return str(device)


@dataclass(slots=True)
class RpcBackendOptions:
    """Options of an asyncrpc worker, named as torch's ``TensorPipeRpcBackendOptions``.

    Attributes:
        init_method: rendezvous URL: ``env://``, ``tcp://host:port`` or ``file://path``.
        rpc_timeout: default per-call timeout in seconds (0 disables it).
        num_worker_threads: size of the thread pool that runs synchronous functions.
        max_worker_threads: hard cap on that pool's threads. A pool thread blocked on an
            RPC reply (``rpc_sync`` inside a remote function) does not count against
            ``num_worker_threads``: a stand-in starts, up to this cap, so nested blocking
            calls deeper than the pool complete. With all of them blocked, further
            synchronous functions fail with ``ThreadPoolExhaustedError``.
        device_maps: per callee name, a map of this worker's CUDA devices to the callee's.
        devices: the CUDA devices this worker may send from or receive to.
        cuda_transfer: how CUDA tensors cross: "staged" (default: copies on side streams
            through pinned memory; no thread waits for the GPU, the frame leaves once its
            copies are done and the receiver's streams wait on events), "auto" (by CUDA IPC
            handle to same-host peers whose probe passed, else staged; run on one GPU,
            not the default until it beats torch at every size), "ipc" (by handle to
            every same-host peer, unprobed)
            or "host" (the sending thread waits for the tensor's stream, then copies).
        cuda_stream_pool_size: streams per CUDA device a callee leases requests' functions
            from (one request holds one per device it involves, until its reply has left).
        cuda_stream_pool_timeout: seconds a request waits for a free pool stream before
            it fails with ``StreamPoolExhaustedError`` (a ``TimeoutError``).
        cuda_pinned_pool_bytes: bytes of pinned host memory the staged transfer keeps for
            reuse, at most (0: none kept; a staged tensor past the bound gets a fresh
            pinned buffer rather than waiting).
        listen_host: the address the worker listens on (loopback by default; "0.0.0.0"
            for every interface).
        listen_port: the port to listen on (0: any free one).
        unix_sockets: also listen on a Unix socket, and reach peers on the same host
            (same boot id and host name) through theirs, falling back to TCP. Off with TLS.
        shared_memory: send large tensors to peers on the same host through shared memory
            (one copy into a pooled memfd arena; the receiver maps it, no copy), once the
            peer has shown it can map this worker's memory. Off with TLS.
        shm_threshold: segments of at least this many bytes take shared memory.
        shm_arena_bytes: bytes of shared memory this worker lends at most; a segment that
            finds no room goes over the socket.
        advertise_host: the address other workers dial to reach this one, when it is not
            ``listen_host`` (listening on every interface, containers, NAT).
        advertise_port: the port they dial, when a proxy or NAT maps the listening port.
        max_frame_size: the largest frame (header, pickle and tensor bytes of one message)
            accepted from a peer, checked before allocating; 4 GiB by default. Peers learn
            it at the handshake: a larger message fails at its sender with
            ``FrameTooLargeError`` before any byte is written, and the connection stays up.
        shutdown_timeout: seconds a graceful shutdown may wait for the other workers
            when ``shutdown`` is given no timeout. None or 0 (the default, as torch's
            ``DEFAULT_SHUTDOWN_TIMEOUT``) waits without limit: a worker that calls
            ``shutdown()`` right after joining serves its peers until all are done. Past
            a bound, ``shutdown`` raises ``ShutdownTimeoutError``.
        lost_workers: what a graceful shutdown does about workers that died during the
            job. The survivors never wait for a dead worker (it is left out of the
            barriers once declared lost) and finish together; then "warn" (log a warning
            naming them), "error" (raise ``WorkersLostError`` once this worker stopped)
            or "ignore".
        rref_leaks: what a graceful shutdown does with owner RRefs still referenced
            elsewhere: "warn" (log a warning), "error" (raise ShutdownError) or "ignore".
        auth_key: the group's shared secret (bytes or str); every worker must be given
            the same. None reads ``ASYNCRPC_AUTH_KEY``; without either, rank 0 makes a
            random key and the others read it from the rendezvous store (which must then
            be trusted: set a key for any run that spans hosts).
        handshake_timeout: seconds an accepted connection has to authenticate.
        tls_cert, tls_key, tls_ca: PEM paths of this worker's certificate, its key, and the
            CA that signs every worker's: all three turn on mutual TLS for every
            connection (the key handshake still runs inside it).
        heartbeat_interval: seconds of silence after which an idle connection is pinged
            (0 turns heartbeats off).
        heartbeat_timeout: seconds of silence after which the peer's process is probed
            (its lane listener dialled, which a thread of its own answers, not its event
            loop); no answer within ``min(1, heartbeat_timeout)`` s, or nothing listening,
            and the peer is declared lost: its pending calls fail with ``PeerLostError``,
            even those with no timeout. A stopped or dead worker is found in about 2 to 3 s
            with the defaults.
        silent_link_timeout: seconds of silence after which a peer is declared lost even
            though its process answers probes: its event loop blocked that long by user
            code, or its connection carries nothing. It is also the limit where no probe
            can be made (the peer takes no lanes: ``sync_lanes=0`` or TLS). Never shorter
            than ``heartbeat_timeout``.
        idle_timeout: seconds after which a connection that carried no call either way,
            with nothing in flight on either side, is closed by agreement of both sides
            (0, the default, keeps connections for the worker's life, as torch does); the
            next call dials again. For large groups whose traffic moves between peers:
            a worker then holds descriptors only for the peers it talks to now. A
            calling thread's lane (``rpc_sync``'s own connection) unused that long is
            closed too.
        print_errors: print, on this worker's stderr, the traceback of every exception a
            function raises when it runs here for a peer (as torch's agent does); the
            caller gets the exception either way.
        inherit_deadlines: a call made inside a function this worker runs for a peer
            gets what is left of that request's deadline when it is shorter than the
            call's own timeout, so budgets follow the work down a chain of workers (see
            ``asyncrpc.time_remaining``). False gives every call only its own timeout:
            for a function that starts work meant to outlive its caller.
        stream_window: the default flow-control window of streams (``asyncrpc.stream``):
            a producer runs at most this many items ahead of its consumer.
        stream_window_bytes: the default byte window of streams, beside ``stream_window``:
            a producer makes its next item only while the items its consumer has not yet
            taken hold fewer bytes than this (payload and tensor segments), so at most this
            much plus one item is in flight, and an item larger than the window still
            goes, alone. 0 counts items only.
        sync_lanes: lanes this worker serves at once (0 turns lanes off, on both sides).
            A lane is a connection a calling thread opens to a peer at its second
            ``rpc_sync`` there and then uses alone, in blocking I/O: its calls skip the
            event loop on both sides (a plain function runs on the lane's thread at the
            callee). Past the limit, and for calls a lane does not carry (hooks active,
            RRef forks, large frames, ``async def`` functions), calls go through the
            event loop as before. Off with TLS.
        busy_poll_us: microseconds a thread waiting on a lane polls its socket before it
            sleeps: a calling thread for its reply, a lane's thread at the callee for the
            next request after each reply. Each poll it saves also saves a thread's
            wake-up, 20-30 µs on a virtual machine, at the cost of up to this much CPU
            per call on each side, spent whether or not a message comes (as TensorPipe's
            shared-memory transport spends it). 0 (the default) never polls; the
            loop's path never polls either way.
    """

    init_method: str = DEFAULT_INIT_METHOD
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    num_worker_threads: int = 16
    max_worker_threads: int = 512
    device_maps: dict[str, dict[str, str]] | None = None
    devices: list[str] | None = None
    cuda_transfer: str = "staged"
    cuda_stream_pool_size: int = 32
    cuda_stream_pool_timeout: float = 30.0
    cuda_pinned_pool_bytes: int = 512 << 20
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    unix_sockets: bool = True
    shared_memory: bool = True
    shm_threshold: int = 256 << 10
    shm_arena_bytes: int = 1 << 30
    advertise_host: str | None = None
    advertise_port: int | None = None
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    shutdown_timeout: float | None = None
    lost_workers: str = "warn"
    rref_leaks: str = "warn"
    auth_key: bytes | str | None = field(default=None, repr=False)
    handshake_timeout: float = 5.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 1.25
    silent_link_timeout: float = 10.0
    idle_timeout: float = 0.0
    print_errors: bool = True
    inherit_deadlines: bool = True
    stream_window: int = 128
    stream_window_bytes: int = 64 << 20
    sync_lanes: int = 64
    busy_poll_us: int = 0
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.rpc_timeout < 0:
            raise InitError(f"rpc_timeout must be >= 0 seconds, got {self.rpc_timeout}")
        _check_shutdown(self.shutdown_timeout, self.lost_workers, self.rref_leaks)
        if not self.handshake_timeout > 0:
            raise InitError(f"handshake_timeout must be > 0 seconds, got {self.handshake_timeout}")
        if self.heartbeat_interval < 0 or (
            self.heartbeat_interval > 0 and not self.heartbeat_timeout > self.heartbeat_interval
        ):
            raise InitError(
                "need heartbeat_interval >= 0 and, when it is on, heartbeat_timeout > interval "
                f"(got {self.heartbeat_interval} and {self.heartbeat_timeout})"
            )
        if not self.silent_link_timeout > 0:
            raise InitError(
                f"silent_link_timeout must be > 0 seconds, got {self.silent_link_timeout}"
            )
        if not self.idle_timeout >= 0:
            raise InitError(f"idle_timeout must be >= 0 seconds (0: off), got {self.idle_timeout}")
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(p is not None for p in tls) and not all(p is not None for p in tls):
            raise InitError("TLS needs all of tls_cert, tls_key and tls_ca")
        _check_streams(self.stream_window, self.stream_window_bytes)
        _check_lanes(self.sync_lanes, self.busy_poll_us)
        if self.num_worker_threads < 1:
            raise InitError(f"num_worker_threads must be >= 1, got {self.num_worker_threads}")
        if self.max_worker_threads < self.num_worker_threads:
            raise InitError(
                f"max_worker_threads ({self.max_worker_threads}) must be >= "
                f"num_worker_threads ({self.num_worker_threads})"
            )
        if self.cuda_transfer not in ("auto", "ipc", "staged", "host"):
            raise InitError(
                "cuda_transfer must be 'auto', 'ipc', 'staged' or 'host', "
                f"got {self.cuda_transfer!r}"
            )
        _check_cuda_pools(
            self.cuda_stream_pool_size, self.cuda_stream_pool_timeout, self.cuda_pinned_pool_bytes
        )
        if self.device_maps is not None:
            self.device_maps = {
                str(callee): {_device_key(k): _device_key(v) for k, v in mapping.items()}
                for callee, mapping in self.device_maps.items()
            }
        if self.devices is not None:
            self.devices = [_device_key(d) for d in self.devices]

    def set_device_map(self, to: str, device_map: Mapping[Any, Any]) -> None:
        """Add or extend the device map towards worker ``to`` (torch's method of that name).

        Args:
            to: the callee's name.
            device_map: this worker's devices to the callee's (``{0: 1}``,
                ``{"cuda:0": "cuda:1"}``, ``torch.device`` keys); merged into any map
                already set for ``to``.
        """
        maps = self.device_maps if self.device_maps is not None else {}
        maps.setdefault(to, {}).update(
            {_device_key(k): _device_key(v) for k, v in device_map.items()}
        )
        self.device_maps = maps

    def set_devices(self, devices: list[Any]) -> None:
        """Set the devices this worker uses (torch's method of that name).

        Args:
            devices: CUDA devices (``0``, ``"cuda:0"``, ``torch.device``), replacing any
                set before.
        """
        self.devices = [_device_key(d) for d in devices]


def _check_lanes(sync_lanes: int, busy_poll_us: int) -> None:
    if type(sync_lanes) is not int or sync_lanes < 0:
        raise InitError(f"sync_lanes must be an int >= 0, got {sync_lanes!r}")
    if type(busy_poll_us) is not int or not 0 <= busy_poll_us <= _MAX_POLL_US:
        raise InitError(
            f"busy_poll_us must be an int from 0 to {_MAX_POLL_US}, got {busy_poll_us!r}"
        )


def _check_streams(window: object, window_bytes: object) -> None:
    if type(window) is not int or window < 1:
        raise InitError(f"stream_window must be an int >= 1, got {window!r}")
    if type(window_bytes) is not int or window_bytes < 0:
        raise InitError(f"stream_window_bytes must be an int >= 0, got {window_bytes!r}")


def _check_shutdown(timeout: float | None, lost_workers: str, rref_leaks: str) -> None:
    """Refuse a negative shutdown bound or an unknown reporting policy."""
    if timeout is not None and not timeout >= 0:
        raise InitError(
            f"shutdown_timeout must be None or >= 0 seconds (0 and None: no limit), got {timeout}"
        )
    for name, value in (("lost_workers", lost_workers), ("rref_leaks", rref_leaks)):
        if value not in ("warn", "error", "ignore"):
            raise InitError(f"{name} must be 'warn', 'error' or 'ignore', got {value!r}")


def _check_cuda_pools(size: object, timeout: object, pinned: object) -> None:
    """Refuse CUDA pool sizes or a timeout that the pools cannot run with."""
    if type(size) is not int or size < 1:
        raise InitError(f"cuda_stream_pool_size must be an int >= 1, got {size!r}")
    if type(timeout) not in (int, float) or not 0 < timeout < float("inf"):  # type: ignore[operator]
        raise InitError(
            f"cuda_stream_pool_timeout must be a finite number of seconds > 0, got {timeout!r}"
        )
    if type(pinned) is not int or pinned < 0:
        raise InitError(f"cuda_pinned_pool_bytes must be an int >= 0, got {pinned!r}")


def coerce_options(options: object | None, backend: object = None) -> RpcBackendOptions:
    """Return asyncrpc options for ``options``: ours, torch's, or None for the defaults.

    Args:
        options: ``RpcBackendOptions``, a torch ``TensorPipeRpcBackendOptions``, or None.
        backend: the ``backend`` argument of ``init_rpc``, already checked.

    Returns:
        A fresh ``RpcBackendOptions``.

    Raises:
        InitArgumentError: the object is neither kind (a TypeError).
        InitError: a field has a bad value.
    """
    if options is None:
        return RpcBackendOptions()
    if isinstance(options, RpcBackendOptions):
        return options
    if not hasattr(options, "init_method") or not hasattr(options, "rpc_timeout"):
        raise InitArgumentError(
            f"Argument rpc_backend_options must be an instance of RpcBackendOptions: "
            f"asyncrpc.RpcBackendOptions or torch's TensorPipeRpcBackendOptions, "
            f"got {type(options).__name__}"
        )
    names = {cls.__name__ for cls in type(options).__mro__}
    if "TensorPipeRpcBackendOptions" not in names:
        # torch infers the backend from the options' class, and the TensorPipe backend
        # takes only its own class: another kind of options is refused, in torch's words.
        if backend is None:
            raise InitArgumentError(
                f"Could not infer backend for options of type {type(options).__name__}: "
                "pass asyncrpc.RpcBackendOptions or torch's TensorPipeRpcBackendOptions"
            )
        raise InitArgumentError(
            f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions` (or "
            f"asyncrpc.RpcBackendOptions), got {type(options).__name__}"
        )
    return RpcBackendOptions(
        init_method=str(options.init_method),
        rpc_timeout=float(options.rpc_timeout),
        num_worker_threads=int(getattr(options, "num_worker_threads", 16)),
        device_maps=dict(getattr(options, "device_maps", None) or {}) or None,
        devices=list(getattr(options, "devices", None) or []) or None,
    )


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's options class, under its name and with its constructor (keyword-only, the
    same defaults), so a program's ``rpc.TensorPipeRpcBackendOptions(...)`` line runs as
    it is. The result is an ``RpcBackendOptions``: asyncrpc's own options may be passed
    too, by keyword.

    ``_transports`` and ``_channels`` name TensorPipe's transports and channels (private
    in torch). asyncrpc has its own (TCP, Unix sockets, shared memory: see
    ``RpcBackendOptions``), so they are accepted and have no effect.
    """

    __slots__ = ()

    def __init__(
        self,
        *,
        num_worker_threads: int = 16,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: Mapping[str, Mapping[Any, Any]] | None = None,
        devices: list[Any] | None = None,
        _transports: list[str] | None = None,
        _channels: list[str] | None = None,
        **asyncrpc_options: Any,
    ) -> None:
        super().__init__(
            init_method=init_method,
            rpc_timeout=rpc_timeout,
            num_worker_threads=num_worker_threads,
            device_maps={k: dict(v) for k, v in device_maps.items()} if device_maps else None,
            devices=list(devices) if devices is not None else None,
            **asyncrpc_options,
        )
