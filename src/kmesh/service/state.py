"""What the service's loop and its operations share: options, the connection record, the state, the loop's side.

The loop (server.py) owns sockets, frames and timers; the operations (ops_*.py) own what a request does. Both
work on one ServiceState: the registry, the store, the disk reads, the copy runner, the connections, the
counters, and the two flags every part reads (`stopping`, `version`). An operation answers a connection only
through Replies, a few of the loop's own methods handed over at construction, so no operation module imports
the loop.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kmesh.service import identity
from kmesh.service.diskreads import DiskReads
from kmesh.service.errors import NotAuthorizedError, ServiceError
from kmesh.service.handles import CudaIpcTable
from kmesh.service.jobs import CopyRunner
from kmesh.service.process import ADMIN_TOKEN_NAME
from kmesh.service.protocol import FrameAssembler, Request
from kmesh.service.registry import Client, Registration, Registry
from kmesh.service.remotetier import RemoteTier
from kmesh.service.store import Store, header_section
from kmesh.storage.remote import RemoteSpec

log = logging.getLogger("kmesh.service")
DEFERRED = object()  # a handler's "the reply comes later" (parked wait, parked load)
# Deliberate flaws for negative controls (tests prove the checks can fail), opt-in only (--fault):
#   ignore_in_flight  closing counts as drained although copies run (registry)
#   collect_raises    collecting a finished copy whose key starts with FAULT_KEY_PREFIX raises
#   tick_raises       the periodic tick raises while a live client named FAULT_TICK_CLIENT exists
#   read_on_loop      disk read-backs run on the loop thread (the old serialised design: nobody is answered)
FAULTS = ("ignore_in_flight", "collect_raises", "tick_raises", "read_on_loop")
FAULT_KEY_PREFIX = b"kmesh-fault:"
FAULT_TICK_CLIENT = "kmesh-fault:tick"
MAX_REGS_PER_CLIENT = 512  # a client's record lists its registration ids: this keeps it under protocol.ITEM_MAX


@dataclass
class ServiceOptions:
    runtime_dir: Path
    device: str = "cpu"                   # "cuda" also accepts CUDA IPC registrations
    heartbeat_timeout_s: float = 10.0
    store_capacity_bytes: int = 1 << 30
    chunk_bytes: int = 1 << 20            # copy granularity when a gate is in use
    gate_fd: int | None = None            # test/stage hook: a ChunkGate pipe that paces every copy chunk
    socket_mode: int = 0o600
    allowed_uids: frozenset[int] = field(default_factory=lambda: frozenset({os.getuid()}))
    max_regs_per_client: int = 64        # at most MAX_REGS_PER_CLIENT (a client's listed item stays bounded)
    max_regs: int = 4096
    max_tombstones: int = 16384           # released records kept to answer "released" / "not yours"
    max_objects: int = 65536              # originals in the store (besides its byte capacity)
    max_jobs: int = 4096                  # copies in flight, and finished ones kept for wait/status
    max_connections: int = 256
    max_out_bytes: int = 4 << 20          # a client that does not read its replies is disconnected
    faults: tuple[str, ...] = ()          # negative controls only (FAULTS)
    disk_dir: Path | None = None          # disk tier under the host-RAM store (kmesh.storage object files)
    adopt: bool = True                    # re-adopt the object files a previous run left in disk_dir
    disk_read_threads: int = 2            # reader pool for read-backs of evicted originals
    max_disk_reads: int = 64              # read-backs in flight (one per object; joined loads not counted)
    disk_read_gate_fd: int | None = None  # test hook: a ChunkGate pipe, one token per read-back
    eviction: str = "lru"                 # a full RAM tier evicts LRU originals nobody holds (kmesh.service.store)
    high_watermark: float = 1.0           # ... when a reservation would pass this fraction of --store-bytes
    low_watermark: float = 0.9            # ... down to this fraction
    remote: RemoteSpec | None = None      # remote tier (kmesh.storage.remote): publish commits, fetch what is missing
    max_remote_fetches: int = 64          # fetches in flight (one per object; joined loads not counted)
    remote_agent_log: Path | None = None  # the store agent's log (None: remote-agent.log in the runtime dir)

    def check(self) -> None:
        """Every collection the service keeps has a limit of at least one (ServiceError otherwise)."""
        for name in ("max_regs_per_client", "max_regs", "max_tombstones", "max_objects", "max_jobs"):
            if getattr(self, name) < 1:
                raise ServiceError(f"{name} must be at least 1, not {getattr(self, name)}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ServiceError(f"watermarks must satisfy 0 < low <= high <= 1, got low {self.low_watermark}, "
                               f"high {self.high_watermark}")
        if self.max_regs_per_client > MAX_REGS_PER_CLIENT:
            raise ServiceError(f"max_regs_per_client {self.max_regs_per_client} > {MAX_REGS_PER_CLIENT}")

    @classmethod
    def from_argv(cls, argv: list[str] | None, prog: str, description: str) -> tuple[ServiceOptions, str]:
        """The service's command line (kmesh.service.process.start writes it): the options and the log level."""
        p = argparse.ArgumentParser(prog=prog, description=description)
        p.add_argument("--runtime-dir", required=True, type=Path)
        p.add_argument("--device", default="cpu")
        p.add_argument("--heartbeat-timeout", type=float, default=10.0)
        p.add_argument("--store-bytes", type=int, default=1 << 30)
        p.add_argument("--chunk-bytes", type=int, default=1 << 20)
        p.add_argument("--gate-fd", type=int, default=None)
        p.add_argument("--socket-mode", type=lambda s: int(s, 8), default=0o600)
        p.add_argument("--allow-uid", type=int, action="append", default=None)
        p.add_argument("--max-regs-per-client", type=int, default=64)
        p.add_argument("--max-regs", type=int, default=4096)
        p.add_argument("--max-tombstones", type=int, default=16384)
        p.add_argument("--max-objects", type=int, default=65536)
        p.add_argument("--max-jobs", type=int, default=4096)
        p.add_argument("--disk-dir", type=Path, default=None)
        p.add_argument("--no-adopt", action="store_true",
                       help="start with an empty store although --disk-dir holds a previous run's object files")
        p.add_argument("--disk-read-threads", type=int, default=2)
        p.add_argument("--max-disk-reads", type=int, default=64)
        p.add_argument("--disk-read-gate-fd", type=int, default=None, help=argparse.SUPPRESS)
        p.add_argument("--eviction", choices=("lru", "none"), default="lru",
                       help="lru: a full RAM tier makes room by evicting the least recently used originals nobody "
                            "holds (to the disk tier, or forgotten without one); none: refuse the save")
        p.add_argument("--high-watermark", type=float, default=1.0)
        p.add_argument("--low-watermark", type=float, default=0.9)
        p.add_argument("--remote-master", default=None,
                       help="remote tier: the Mooncake master's host:port (with --remote-metadata)")
        p.add_argument("--remote-metadata", default=None, help="remote tier: its metadata service URL")
        p.add_argument("--remote-hostname", default="127.0.0.1", help="this host's address as other hosts reach it")
        p.add_argument("--remote-segment-bytes", type=int, default=64 << 20,
                       help="memory this service contributes to the store")
        p.add_argument("--remote-call-timeout", type=float, default=10.0,
                       help="the longest one store call may take (a hung store: the load fails, the agent restarts)")
        p.add_argument("--max-remote-fetches", type=int, default=64)
        p.add_argument("--remote-agent-log", type=Path, default=None,
                       help="the store agent's log (the client's own lines; default: in the runtime dir)")
        p.add_argument("--log-level", default="INFO")
        p.add_argument("--fault", action="append", choices=FAULTS, default=[], help=argparse.SUPPRESS)
        a = p.parse_args(argv)
        if (a.remote_master is None) != (a.remote_metadata is None):
            p.error("--remote-master and --remote-metadata go together")
        remote = RemoteSpec(a.remote_master, a.remote_metadata, a.remote_hostname, a.remote_segment_bytes,
                            call_timeout_s=a.remote_call_timeout) if a.remote_master is not None else None
        uids = frozenset(a.allow_uid) if a.allow_uid else frozenset({os.getuid()})
        opts = cls(a.runtime_dir, a.device, a.heartbeat_timeout, a.store_bytes, a.chunk_bytes, a.gate_fd,
                   a.socket_mode, uids, max_regs_per_client=a.max_regs_per_client, max_regs=a.max_regs,
                   max_tombstones=a.max_tombstones, max_objects=a.max_objects, max_jobs=a.max_jobs,
                   faults=tuple(a.fault), disk_dir=a.disk_dir, adopt=not a.no_adopt,
                   disk_read_threads=a.disk_read_threads, max_disk_reads=a.max_disk_reads,
                   disk_read_gate_fd=a.disk_read_gate_fd, eviction=a.eviction,
                   high_watermark=a.high_watermark, low_watermark=a.low_watermark, remote=remote,
                   max_remote_fetches=a.max_remote_fetches, remote_agent_log=a.remote_agent_log)
        return opts, a.log_level


@dataclass(eq=False)
class Conn:
    cid: int
    sock: socket.socket
    peer: identity.Peer
    asm: FrameAssembler = field(default_factory=FrameAssembler)
    out: bytearray = field(default_factory=bytearray)
    client: Client | None = None
    closing: bool = False                 # stop reading; close once `out` is flushed
    parked: dict[int, tuple[int, float]] = field(default_factory=dict)  # req -> (seq, deadline)
    parked_loads: int = 0                 # loads waiting for a disk read-back (their replies are owed)
    # load_many replies owed once every one of their copies is terminal: (seq, reqs, deadline, reply so far)
    parked_batches: list[tuple[int, list[int], float, dict[str, Any]]] = field(default_factory=list)


@dataclass(frozen=True)
class Replies:
    """The loop's side an operation may use: answer a connection now (send a reply, or a typed error that
    costs the connection only when the error is fatal), and watch a client's process for its exit."""

    send: Callable[[Conn, dict[str, Any]], None]
    fail: Callable[[Conn, int | None, ServiceError], None]
    watch_exit: Callable[[Conn], None]


@dataclass(eq=False)
class ServiceState:
    opts: ServiceOptions
    registry: Registry
    store: Store
    reads: DiskReads | None
    copies: CopyRunner
    remote: RemoteTier | None = None
    cuda: CudaIpcTable = field(default_factory=CudaIpcTable)
    conns: dict[int, Conn] = field(default_factory=dict)  # the loop adds and drops them; operations look up
    stats: dict[str, Any] = field(default_factory=lambda: {
        "frames": 0, "errors": {}, "internal_errors": 0, "connections": 0, "refused_connections": 0,
        "stale_uses": 0, "copies_done": 0, "copies_failed": 0, "copies_cancelled": 0, "loads_parked": 0,
        "parked_loads_dropped": 0})
    stopping: bool = False
    # Bumped by everything that may change what status/list show (not copy progress): a client that
    # pages through lists can tell whether it saw one consistent state (ServiceClient.status).
    version: int = 0
    admin_token: bytes | None = None  # set by the loop's bind(); None refuses every admin op
    admin_path: Path | None = None
    fd_baseline: int = 0
    _logged_at: dict[str, float] = field(default_factory=dict, init=False, repr=False)  # site -> last full log

    @classmethod
    def open(cls, opts: ServiceOptions, unmap: Callable[[CopyRunner, Registration], None]) -> ServiceState:
        """Everything the options ask for: the registry (whose unmap callback gets the copy runner, so it can
        refuse while the engine holds a byte), the store, the disk reader pool, the copy runner."""

        def release(reg: Registration) -> None:  # `copies` is bound below, long before anything is released
            unmap(copies, reg)

        registry = Registry(release, max_regs_per_client=opts.max_regs_per_client, max_regs=opts.max_regs,
                            max_tombstones=opts.max_tombstones, ignore_in_flight="ignore_in_flight" in opts.faults)
        store = Store(opts.store_capacity_bytes, pinned=opts.device.startswith("cuda"),
                      max_objects=opts.max_objects, disk_dir=opts.disk_dir, adopt=opts.adopt,
                      eviction=opts.eviction, high_watermark=opts.high_watermark, low_watermark=opts.low_watermark)
        reads = DiskReads(opts.disk_dir, opts.disk_read_threads, opts.max_disk_reads,
                          opts.disk_read_gate_fd, on_caller="read_on_loop" in opts.faults) \
            if opts.disk_dir is not None else None
        copies = CopyRunner(opts.chunk_bytes, opts.gate_fd, max_jobs=opts.max_jobs)
        remote = None
        if opts.remote is not None:
            remote = RemoteTier(opts.remote, opts.max_remote_fetches,
                                agent_log=opts.remote_agent_log or opts.runtime_dir / "remote-agent.log")
            store.on_commit = lambda obj: remote.publish(obj.key, obj.tensor, header_section(obj, obj.sha256))
        return cls(opts, registry, store, reads, copies, remote, admin_path=opts.runtime_dir / ADMIN_TOKEN_NAME)

    def wake_fds(self) -> list[tuple[int, str]]:
        """The helpers' wake pipes the loop watches, each with the kind of work it brings (server._once)."""
        out = [(self.copies.wake_r, "wake")]
        if self.reads is not None:
            out.append((self.reads.wake_r, "diskread"))
        if self.remote is not None:
            out.append((self.remote.wake_r, "remote"))
        return out

    def helpers_busy(self) -> bool:
        """Copies running, disk read-backs or remote fetches in flight: replies a shutdown still owes."""
        return bool(self.copies.running() or (self.reads is not None and self.reads.in_flight())
                    or (self.remote is not None and self.remote.flights))

    def close_helpers(self) -> None:
        self.copies.close()
        if self.reads is not None:
            self.reads.close()
        if self.remote is not None:
            self.remote.close()

    def internal(self, site: str, detail: str = "") -> None:
        """Count and log an internal error (the exception being handled): in full the first time per site,
        then at most once a second per site, so a fault that recurs on every tick cannot flood the log."""
        self.stats["internal_errors"] += 1
        now = time.monotonic()
        if now - self._logged_at.get(site, -1e9) >= 1.0:
            self._logged_at[site] = now
            log.error("internal error in %s%s (%d so far):\n%s", site, f" ({detail})" if detail else "",
                      self.stats["internal_errors"], traceback.format_exc())

    def require_admin(self, conn: Conn, req: Request, what: str) -> None:
        """Admin = the service's uid (or root) AND the admin token from the runtime dir, compared in constant
        time. Same-uid clients without the token are ordinary clients. Admin ops (shutdown, status and lists of
        all clients or of the store, evict, retain/unretain, hello takeover) need the admin token this process
        writes to a 0600 file next to its socket (identity.py)."""
        if conn.peer.uid not in (os.getuid(), 0):
            raise NotAuthorizedError(f"{what} is for the service's own uid")
        if not identity.token_ok(self.admin_token, req.args.get("admin")):
            why = "without" if req.args.get("admin") is None else "with a wrong"
            raise NotAuthorizedError(f"{what} {why} admin token refused (the token is in {self.admin_path})")
