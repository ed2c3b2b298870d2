"""The cache-service process: one selector loop over a 0600 Unix socket; never dies of a client's mistake.

Everything that changes the registry or the store runs on this one thread, so a request is handled start to
finish without interleaving: validate (protocol), resolve (registry), accept (reservations + engine), reply.
A malformed or unauthorised message gets a typed error reply and changes nothing; a frame that cannot be
trusted (bad magic, oversized, truncated) also ends that connection. Admin ops (shutdown, status and lists of
all clients or of the store, evict, retain/unretain, hello takeover) need the admin token this process writes to
a 0600 file next to its socket (identity.py). An internal error (a bug) in one client's work is counted and logged and
costs at most that piece of work: every part of the loop (each request, each finished copy's bookkeeping,
each client / wait / registration in the tick) runs in its own try.
Every reply is bounded (status is a summary; lists are paged, protocol.cut_page), and every collection the
service keeps has a limit (objects, jobs, registrations, tombstones: ServiceOptions), so no valid request
can make a reply that does not fit in a frame; one that still would is refused as reply_too_large, non-fatally.
Copies run on kmesh.transfer engines; their completion comes back through CopyRunner's wake pipe.
Disk tier (--disk-dir): a load of an original whose RAM copy was evicted never reads the file on this thread.
It starts one read on a small reader pool (kmesh.service.diskreads) and its reply is parked; loads of the same
object arriving meanwhile join that read (`joins`); when it ends (the pool's wake pipe) the loop checks the
digest against the commit, installs the RAM copy and runs each parked load again from the top, now a RAM hit
(or sends each the same DiskReadError). Meanwhile everyone else is served. On start the store re-adopts the
object files a previous run left in the disk dir (--no-adopt: start empty; see kmesh.service.store).

    python -m kmesh.service.server --runtime-dir DIR [--device cpu|cuda] [--heartbeat-timeout S] ...
(normally started by `kmesh service start` or kmesh.service.process.start()).
"""
from __future__ import annotations

import argparse
import bisect
import logging
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kmesh.service import descriptor, identity
from kmesh.service.diskreads import DiskReads, Flight, ReadCancelledError
from kmesh.service.errors import (AuthError, CapacityError, ClientLostError, DiskReadError, FrameTooLargeError,
                                  HandleError,
                                  InternalError, LayoutMismatchError, NotAuthorizedError, NotOwnerError,
                                  ObjectMissingError, RangeError,
                                  RegistrationStateError, ReplyTooLargeError, SchemaError, SequenceError, ServiceError,
                                  ShuttingDownError, TruncatedFrameError, UnsupportedVersionError)
from kmesh.service.handles import CudaIpcTable, MappedMemfd, check_memfd, close_fds, recv_some
from kmesh.service.jobs import CopyJob, CopyRunner
from kmesh.service.process import ADMIN_TOKEN_NAME, PID_NAME, SOCKET_NAME
from kmesh.service.protocol import (VERSION, Frame, FrameAssembler, Request, clip, cut_page, error_reply, ok_reply,
                                    pack_frame, parse_request, peek_seq, unpack_body)
from kmesh.service.registry import Client, Registration, Registry, State
from kmesh.service.store import Store
from kmesh.shm import SegmentBusyError

log = logging.getLogger("kmesh.service")
_DEFERRED = object()  # a handler's "the reply comes later" (parked wait)
_READ_ONLY = frozenset({"ping", "heartbeat", "wait", "status", "list"})  # change nothing status/list show
# Deliberate flaws for negative controls (tests prove the checks can fail), opt-in only (--fault):
#   ignore_in_flight  closing counts as drained although copies run (registry)
#   collect_raises    collecting a finished copy whose key starts with FAULT_KEY_PREFIX raises
#   tick_raises       the periodic tick raises while a live client named FAULT_TICK_CLIENT exists
#   read_on_loop      disk read-backs run on the loop thread (the old serialised design: nobody is answered)
FAULTS = ("ignore_in_flight", "collect_raises", "tick_raises", "read_on_loop")
FAULT_KEY_PREFIX = b"kmesh-fault:"
FAULT_TICK_CLIENT = "kmesh-fault:tick"
MAX_REGS_PER_CLIENT = 512  # a client's record lists its registration ids: this keeps it under protocol.ITEM_MAX
VERIFY_BYTES = 64 << 20    # originals re-hashed per `list objects verify` page (at least one): bounded work


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


@dataclass(eq=False)
class ParkedLoad:
    """A load whose reply waits for its object's read-back (a Flight waiter)."""

    cid: int
    client_id: int
    req: Request
    parked_at: float = field(default_factory=time.monotonic)


class Service:
    def __init__(self, opts: ServiceOptions) -> None:
        for name in ("max_regs_per_client", "max_regs", "max_tombstones", "max_objects", "max_jobs"):
            if getattr(opts, name) < 1:
                raise ServiceError(f"{name} must be at least 1, not {getattr(opts, name)}")
        if opts.max_regs_per_client > MAX_REGS_PER_CLIENT:
            raise ServiceError(f"max_regs_per_client {opts.max_regs_per_client} > {MAX_REGS_PER_CLIENT}")
        self.opts = opts
        self.sel = selectors.DefaultSelector()
        self.registry = Registry(self._unmap, max_regs_per_client=opts.max_regs_per_client, max_regs=opts.max_regs,
                                 max_tombstones=opts.max_tombstones,
                                 ignore_in_flight="ignore_in_flight" in opts.faults)
        self.store = Store(opts.store_capacity_bytes, pinned=opts.device.startswith("cuda"),
                           max_objects=opts.max_objects, disk_dir=opts.disk_dir, adopt=opts.adopt)
        self.reads = DiskReads(opts.disk_dir, opts.disk_read_threads, opts.max_disk_reads,
                               opts.disk_read_gate_fd, on_caller="read_on_loop" in opts.faults) \
            if opts.disk_dir is not None else None
        self.copies = CopyRunner(opts.chunk_bytes, opts.gate_fd, max_jobs=opts.max_jobs)
        self.cuda = CudaIpcTable()
        self.conns: dict[int, Conn] = {}
        self._next_cid = 1
        self.stopping = False
        self.stats: dict[str, Any] = {"frames": 0, "errors": {}, "internal_errors": 0, "connections": 0,
                                      "refused_connections": 0, "stale_uses": 0, "copies_done": 0,
                                      "copies_failed": 0, "copies_cancelled": 0, "loads_parked": 0,
                                      "parked_loads_dropped": 0}
        self.socket_path = opts.runtime_dir / SOCKET_NAME
        self.pid_path = opts.runtime_dir / PID_NAME
        self.admin_path = opts.runtime_dir / ADMIN_TOKEN_NAME
        self.admin_token: bytes | None = None  # set by bind(); None refuses every admin op
        self.listener: socket.socket | None = None
        self._fd_baseline = 0
        self._logged_at: dict[str, float] = {}  # internal-error site -> when it was last logged in full
        # Bumped by everything that may change what status/list show (not copy progress): a client that
        # pages through lists can tell whether it saw one consistent state (ServiceClient.status).
        self.version = 0

    # -- setup --------------------------------------------------------------------------------------
    def bind(self) -> None:
        d = self.opts.runtime_dir
        dir_mode = 0o700 if self.opts.socket_mode & 0o077 == 0 else 0o711
        d.mkdir(mode=dir_mode, parents=True, exist_ok=True)
        st = d.stat()
        if st.st_uid != os.getuid():
            raise ServiceError(f"runtime dir {d} belongs to uid {st.st_uid}, not us ({os.getuid()})")
        os.chmod(d, dir_mode)
        if self.socket_path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.socket_path))
                raise ServiceError(f"a service already listens on {self.socket_path}")
            except (ConnectionRefusedError, FileNotFoundError):
                self.socket_path.unlink()  # stale socket of a dead service
            finally:
                probe.close()
        # Before the socket exists: whoever sees the service answer can also find its admin token.
        self.admin_token = identity.create_admin_token(self.admin_path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        old = os.umask(0o777 & ~self.opts.socket_mode)  # no window where the socket is wider than asked
        try:
            s.bind(str(self.socket_path))
        except BaseException:
            s.close()
            self.admin_path.unlink(missing_ok=True)
            raise
        finally:
            os.umask(old)
        os.chmod(self.socket_path, self.opts.socket_mode)
        s.listen(64)
        self.listener = s
        self.sel.register(s, selectors.EVENT_READ, ("listen", None))
        self.sel.register(self.copies.wake_r, selectors.EVENT_READ, ("wake", None))
        if self.reads is not None:
            self.sel.register(self.reads.wake_r, selectors.EVENT_READ, ("diskread", None))
        self.pid_path.write_text(f"{os.getpid()}\n")
        self._fd_baseline = len(os.listdir("/proc/self/fd"))

    def serve(self) -> None:
        """Run until a shutdown request (or SIGTERM) and every registration has been released."""
        signal.signal(signal.SIGTERM, lambda *_: self._begin_shutdown("SIGTERM"))
        signal.signal(signal.SIGINT, lambda *_: self._begin_shutdown("SIGINT"))
        log.info("kmesh service pid %d on %s (device %s)", os.getpid(), self.socket_path, self.opts.device)
        if self.store.disk is not None:
            k = self.store.counters
            log.info("disk tier %s: %d object(s) adopted, %d file(s) rejected, %d stale temp file(s) removed%s",
                     self.store.disk.directory, k["adopted"], k["disk_rejected"] - k["disk_temp_removed"],
                     k["disk_temp_removed"], "" if self.opts.adopt else " (--no-adopt: started empty)")
            for r in self.store.disk_rejected:
                log.warning("disk tier: %s: %s", r["file"], r["reason"])
        try:
            while not (self.stopping and not self.registry.regs and not self.copies.running()
                       and not (self.reads is not None and self.reads.in_flight())):
                self._once()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        for conn in list(self.conns.values()):
            self._flush(conn)
            self._drop_conn(conn)
        if self.listener is not None:
            self.sel.unregister(self.listener)
            self.listener.close()
            self.listener = None
        for p in (self.socket_path, self.pid_path, self.admin_path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        self.copies.close()
        if self.reads is not None:
            self.reads.close()
        log.info("kmesh service stopped")

    # -- the loop -----------------------------------------------------------------------------------
    def _once(self) -> None:
        now = time.monotonic()
        for key, mask in self.sel.select(self._timeout(now)):
            kind, obj = key.data
            if kind in ("conn", "pidfd") and obj.cid not in self.conns:
                continue  # dropped earlier in this batch
            try:
                if kind == "listen":
                    self._accept()
                elif kind == "conn":
                    if mask & selectors.EVENT_READ and not obj.closing:
                        self._read(obj)
                    if obj.cid in self.conns and mask & selectors.EVENT_WRITE:
                        self._flush(obj)
                elif kind == "pidfd":
                    self._client_died(obj)
                elif kind == "wake":
                    self._collect_copies()
                elif kind == "diskread":
                    self._collect_reads()
            except Exception:  # a bug must cost one connection at most, never the service
                self._internal(f"handling {kind}")
                if kind == "conn" and obj.cid in self.conns:
                    self._drop_conn(obj)
        try:
            self._tick(time.monotonic())
        except Exception:  # _tick guards each of its parts; this is the last line
            self._internal("tick")

    def _internal(self, site: str, detail: str = "") -> None:
        """Count and log an internal error (the exception being handled): in full the first time per site,
        then at most once a second per site, so a fault that recurs on every tick cannot flood the log."""
        self.stats["internal_errors"] += 1
        now = time.monotonic()
        if now - self._logged_at.get(site, -1e9) >= 1.0:
            self._logged_at[site] = now
            log.error("internal error in %s%s (%d so far):\n%s", site, f" ({detail})" if detail else "",
                      self.stats["internal_errors"], traceback.format_exc())

    def _timeout(self, now: float) -> float:
        t = 0.2
        for c in self.registry.clients.values():
            if c.live:
                t = min(t, c.last_seen + self.opts.heartbeat_timeout_s - now)
        for conn in self.conns.values():
            for _, deadline in conn.parked.values():
                t = min(t, deadline - now)
        return max(t, 0.005)  # a deadline whose handling keeps failing must not make the loop spin

    def _tick(self, now: float) -> None:
        """Heartbeat deadlines, parked-wait deadlines, deferred releases. Each client / wait / registration
        is handled in its own try: an internal error in one is counted and costs the others nothing."""
        released = self.registry.counters["released"]
        for c in list(self.registry.clients.values()):
            try:
                if "tick_raises" in self.opts.faults and c.live and c.name == FAULT_TICK_CLIENT:
                    raise RuntimeError(f"injected fault tick_raises (client {c.client_id})")
                if c.live and now - c.last_seen > self.opts.heartbeat_timeout_s and not self._owes_load(c):
                    log.info("client %d: heartbeat lost (%.2f s silent)", c.client_id, now - c.last_seen)
                    self.version += 1
                    self.registry.lose_client(c, "heartbeat lost")
            except Exception:
                self._internal("tick: heartbeat", f"client {c.client_id}")
        for conn in list(self.conns.values()):
            for req, (seq, deadline) in list(conn.parked.items()):
                if now < deadline:
                    continue
                del conn.parked[req]
                try:
                    self._send(conn, ok_reply(seq, self.copies.get(req).describe()))
                except Exception as e:  # the waiter still gets an answer
                    self._internal("tick: parked wait", f"request {req}")
                    self._fail(conn, seq, InternalError(f"answering the wait failed: {type(e).__name__}: {e}"))
        for reg in [r for r in self.registry.regs.values()
                    if r.state is State.DRAINED or (r.state is State.CLOSING and not r.in_flight)]:
            try:  # also retries a closing registration whose settle was cut short by an error
                self.registry.settle(reg)
            except Exception:
                self._internal("tick: settle", f"registration {reg.reg_id}")
        if self.registry.counters["released"] != released:
            self.version += 1

    def _owes_load(self, c: Client) -> bool:
        """A client whose load reply we still owe cannot heartbeat (its one connection waits for us)."""
        conn = self.conns.get(c.conn_id) if c.conn_id is not None else None
        return conn is not None and conn.parked_loads > 0

    # -- connections --------------------------------------------------------------------------------
    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            peer = identity.peer_of(sock)
            conn = Conn(self._next_cid, sock, peer)
            self._next_cid += 1
            try:
                identity.check_allowed(peer, self.opts.allowed_uids)
                if len(self.conns) >= self.opts.max_connections:
                    raise CapacityError(f"too many connections ({len(self.conns)})")
            except ServiceError as e:
                self.stats["refused_connections"] += 1
                log.warning("refused connection from pid %d uid %d: %s", peer.pid, peer.uid, e)
                try:
                    sock.send(pack_frame(error_reply(None, e) | {"fatal": True}))
                except OSError:
                    pass
                sock.close()
                if peer.pidfd >= 0:
                    os.close(peer.pidfd)
                continue
            self.conns[conn.cid] = conn
            self.stats["connections"] += 1
            self.sel.register(sock, selectors.EVENT_READ, ("conn", conn))

    def _read(self, conn: Conn) -> None:
        for _ in range(64):  # bounded work per wake-up: other clients get their turn
            try:
                data, fds, ctrunc = recv_some(conn.sock, min(conn.asm.want(), 65536))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.debug("conn %d: recv failed: %s", conn.cid, e)
                self._drop_conn(conn)
                return
            if not data:
                close_fds(fds)
                if conn.client is not None and identity.exited(conn.peer.pidfd):
                    self.registry.lose_client(conn.client, "client died")  # EOF because the process is gone
                if conn.asm.mid_frame:
                    self._fail(conn, None, TruncatedFrameError("connection closed in the middle of a frame"))
                self._drop_conn(conn)
                return
            if ctrunc:
                close_fds(fds)
                self._fail(conn, None, HandleError("more file descriptors than a frame may carry"), fatal=True)
                return
            try:
                frame = conn.asm.feed(data, fds)
            except ServiceError as e:
                close_fds(conn.asm.fds)
                self._fail(conn, None, e)
                return
            if frame is not None:
                self._on_frame(conn, frame)
                if conn.closing or conn.cid not in self.conns:
                    return

    def _fail(self, conn: Conn, seq: int | None, err: ServiceError, fatal: bool | None = None) -> None:
        self.stats["errors"][err.code] = self.stats["errors"].get(err.code, 0) + 1
        body = error_reply(seq, err)
        if fatal:
            body["fatal"] = True
        self._send(conn, body)
        if body["fatal"]:
            conn.closing = True
            self._flush(conn)

    def _send(self, conn: Conn, body: dict[str, Any]) -> None:
        if conn.cid not in self.conns:
            return
        try:
            frame = pack_frame(body)
        except FrameTooLargeError as e:
            # Our own reply is too big: that is our bug, not the client's, so it costs the client nothing (a
            # typed, non-fatal error; the connection and its registrations stay).
            err = ReplyTooLargeError(f"the reply to request seq {body.get('seq')} does not fit in a frame ({e})")
            self.stats["errors"][err.code] = self.stats["errors"].get(err.code, 0) + 1
            log.error("conn %d: %s", conn.cid, err)
            frame = pack_frame(error_reply(body.get("seq"), err))
        conn.out += frame
        self._flush(conn)

    def _flush(self, conn: Conn) -> None:
        if conn.cid not in self.conns:
            return
        try:
            while conn.out:
                n = conn.sock.send(conn.out)
                del conn.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop_conn(conn)
            return
        if len(conn.out) > self.opts.max_out_bytes:
            log.warning("conn %d: %d reply bytes unread; disconnecting", conn.cid, len(conn.out))
            self._drop_conn(conn)
            return
        if not conn.out and conn.closing:
            self._drop_conn(conn)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if self.sel.get_key(conn.sock).events != events:
            self.sel.modify(conn.sock, events, ("conn", conn))

    def _drop_conn(self, conn: Conn) -> None:
        if self.conns.pop(conn.cid, None) is None:
            return
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        close_fds(conn.asm.fds)
        conn.parked.clear()
        if conn.client is not None:
            self.version += 1
            self._forget_pidfd(conn)
            self.registry.detach_connection(conn.client)
        elif conn.peer.pidfd >= 0:
            os.close(conn.peer.pidfd)

    def _forget_pidfd(self, conn: Conn) -> None:
        if conn.peer.pidfd >= 0:
            try:
                self.sel.unregister(conn.peer.pidfd)
            except (KeyError, ValueError):
                pass
            os.close(conn.peer.pidfd)
            conn.peer = identity.Peer(conn.peer.pid, conn.peer.uid, conn.peer.gid, -1, conn.peer.pidfd_source)

    def _client_died(self, conn: Conn) -> None:
        c = conn.client
        log.info("client %s (pid %d) exited", c.client_id if c else "?", conn.peer.pid)
        if c is not None and c.live:
            self.version += 1
            self.registry.lose_client(c, "client died")
        self._drop_conn(conn)

    # -- frames -------------------------------------------------------------------------------------
    def _on_frame(self, conn: Conn, frame: Frame) -> None:
        self.stats["frames"] += 1
        seq = None
        mutating = False
        try:
            if len(frame.fds) != frame.nfds:
                raise HandleError(f"frame declares {frame.nfds} fd(s), {len(frame.fds)} arrived with it")
            if frame.version != VERSION:
                raise UnsupportedVersionError(f"protocol version {frame.version}; this service speaks {VERSION}")
            body = unpack_body(frame.payload)
            seq = peek_seq(body)
            req = parse_request(body, frame.fds)
            mutating = req.op not in _READ_ONLY
            result = self._dispatch(conn, req)
            if result is not _DEFERRED:
                self._send(conn, ok_reply(seq, result))
        except ServiceError as e:
            self._fail(conn, seq, e)
        except Exception as e:
            self._internal("a request", f"conn {conn.cid}")
            self._fail(conn, seq, InternalError(f"{type(e).__name__}: {e}"))
        finally:
            close_fds(frame.fds)  # handlers take the fds they keep out of this list
            if mutating:  # refused requests change nothing by design; counting them too is merely cautious
                self.version += 1

    def _dispatch(self, conn: Conn, req: Request) -> Any:
        if req.op == "ping":
            return {"pong": True, "protocol": VERSION, "server_pid": os.getpid()}
        if req.op == "hello":
            return self._op_hello(conn, req)
        c = conn.client
        if c is None:
            raise SequenceError(f"op {req.op!r} before hello")
        if not identity.token_ok(c.token, req.token):
            raise AuthError("token does not match this connection's client")
        c.last_seen = time.monotonic()
        if req.op == "status":
            return self._op_status(conn, req)
        if req.op == "list":  # like status: a lost client may still look at what it had
            return self._op_list(conn, req)
        self.registry.require_live(c)
        return getattr(self, f"_op_{req.op}")(conn, c, req)

    # -- ops ------------------------------------------------------------------------------------------
    def _op_hello(self, conn: Conn, req: Request) -> dict[str, Any]:
        if conn.client is not None:
            raise SequenceError("hello was already done on this connection")
        if self.stopping:
            raise ShuttingDownError("service is shutting down")
        if identity.exited(conn.peer.pidfd):
            raise ClientLostError("the connecting process has already exited")
        a, now = req.args, time.monotonic()
        if a["takeover"]:
            if a["instance"] is None:
                raise SchemaError("takeover names the instance to take over")
            self._require_admin(conn, req, "taking over a live client's instance")
        if a["instance"] is not None:
            old = self.registry.holder(a["instance"])
            if old is not None:
                self._lose_if_gone(old, now)
        c = self.registry.add_client(a["instance"], a["name"], conn.peer, identity.new_token(), conn.cid, now,
                                     takeover=a["takeover"])
        conn.client = c
        if conn.peer.pidfd >= 0:
            self.sel.register(conn.peer.pidfd, selectors.EVENT_READ, ("pidfd", conn))
        p = conn.peer
        return {"client": c.client_id, "token": c.token, "heartbeat_s": self.opts.heartbeat_timeout_s,
                "protocol": VERSION, "server_pid": os.getpid(), "device": self.opts.device,
                "peer": {"pid": p.pid, "uid": p.uid, "gid": p.gid, "pidfd": p.pidfd_source}}

    def _lose_if_gone(self, c: Client, now: float) -> None:
        """Declare c lost now if it already is, though its pidfd / heartbeat event has not been handled yet: a
        replacement that claims a dead client's instance must not be refused for the service's lag."""
        conn = self.conns.get(c.conn_id) if c.conn_id is not None else None
        if conn is not None and identity.exited(conn.peer.pidfd):
            why = "client died"
        elif now - c.last_seen > self.opts.heartbeat_timeout_s:
            why = "heartbeat lost"
        else:
            return
        log.info("client %d: %s (seen at a claim on its instance %s)", c.client_id, why, c.instance)
        self.version += 1
        self.registry.lose_client(c, why)

    def _op_heartbeat(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        return {"deadline_s": self.opts.heartbeat_timeout_s}

    def _op_register(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        a = req.args
        if self.stopping:
            raise ShuttingDownError("service is shutting down")
        layout = a["layout"]
        want = descriptor.nbytes(layout)
        if a["nbytes"] != want:
            raise LayoutMismatchError(f"registration declares {a['nbytes']} bytes, its layout covers {want}")
        if a["kind"] == "memfd":
            if len(req.fds) != 1 or a["cuda"] is not None:
                raise HandleError("a memfd registration carries exactly one fd and no cuda handle")
            check_memfd(req.fds[0], a["nbytes"])
            handle: Any = req.fds[0]
        else:
            if req.fds or a["cuda"] is None:
                raise HandleError("a cuda_ipc registration carries a cuda handle and no fd")
            if not self.opts.device.startswith("cuda"):
                raise HandleError("this service runs without CUDA; register host memory (memfd)")
            handle = a["cuda"]
        reg = self.registry.register(c, a["alloc_id"], a["generation"], a["kind"], a["nbytes"], layout,
                                     descriptor.digest(layout), descriptor.geometry_digest(layout), handle)
        if a["kind"] == "memfd":
            req.fds.remove(handle)  # the registration owns the fd now
        return {"reg": reg.reg_id, "gen": reg.generation, "state": reg.state.value,
                "layout_digest": reg.layout_digest}

    def _op_activate(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        reg = self.registry.resolve(c, req.args["reg"], req.args["gen"])
        if reg.state is not State.REGISTERED:
            raise RegistrationStateError(f"registration {reg.reg_id} is {reg.state.value}, not registered")
        try:
            if reg.kind == "memfd":
                memory: Any = MappedMemfd(os.dup(reg.handle), reg.nbytes)
                os.close(reg.handle)  # the mapping owns its fd from here on
                reg.handle = -1
            else:
                memory = self.cuda.open(reg.handle, reg.nbytes)
        except ServiceError as e:
            self.registry.close(reg, f"activate failed: {e}")
            raise
        except Exception as e:
            self.registry.close(reg, f"activate failed: {e}")
            raise HandleError(f"cannot map the registered memory: {type(e).__name__}: {e}") from None
        self.registry.activate(reg, memory)
        return {"state": reg.state.value}

    def _op_close(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        reg = self.registry.resolve(c, req.args["reg"], req.args["gen"])
        state = self.registry.close(reg, "closed by client")
        return {"state": state.value, "in_flight": sorted(reg.in_flight)}

    def _range(self, reg: Registration, offset: int, nbytes: int) -> None:
        item = descriptor.itemsize(reg.layout)
        if offset + nbytes > reg.nbytes:
            raise RangeError(f"[{offset}, {offset + nbytes}) outside the {reg.nbytes}-byte registration")
        if offset % item or nbytes % item:
            raise RangeError(f"offset {offset} / size {nbytes} not multiples of the {item}-byte element")

    def _work_reg(self, c: Client, req: Request) -> Registration:
        if self.stopping:
            raise ShuttingDownError("service is shutting down")
        reg = self.registry.resolve(c, req.args["reg"], req.args["gen"])
        self.registry.require_active(reg)
        if req.args["layout_digest"] != reg.layout_digest:
            raise LayoutMismatchError(f"request's layout digest differs from registration {reg.reg_id}'s")
        return reg

    def _op_save(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        a = req.args
        reg = self._work_reg(c, req)
        off, n = a["offset"], a["nbytes"]
        self._range(reg, off, n)
        self.copies.reservations.check(reg.reg_id, off, off + n, writes=False)
        req_id = self.copies.new_id()
        obj = self.store.begin_put(a["key"], n, reg.layout, reg.geometry)
        job = CopyJob(req_id, c.client_id, "save", reg, obj, off, n)
        return self._accept_job(job, src=reg.memory.tensor[off:off + n], dst=obj.tensor, writes=False,
                                undo=lambda: self.store.abort(obj))

    def _op_load(self, conn: Conn, c: Client, req: Request) -> Any:
        """Every check first (nothing is read for a load that would be refused); then a RAM hit starts its copy,
        and a load of an evicted original parks behind that object's one read-back (_collect_reads runs it
        again from here once the read ended)."""
        a = req.args
        reg = self._work_reg(c, req)
        obj = self.store.lookup(a["key"])
        if obj.geometry != reg.geometry:
            raise LayoutMismatchError(f"object {a['key'][:64]!r} was saved under another KV geometry")
        off, n = a["offset"], obj.nbytes
        self._range(reg, off, n)
        self.copies.reservations.check(reg.reg_id, off, off + n, writes=True)
        if not obj.in_ram:
            return self._park_load(conn, c, req, obj)
        obj = self.store.acquire(a["key"])
        try:
            req_id = self.copies.new_id()
        except BaseException:
            self.store.release(obj)
            raise
        job = CopyJob(req_id, c.client_id, "load", reg, obj, off, n)
        return self._accept_job(job, src=obj.tensor, dst=reg.memory.tensor[off:off + n], writes=True,
                                undo=lambda: self.store.release(obj))

    def _park_load(self, conn: Conn, c: Client, req: Request, obj: Any) -> Any:
        if self.reads is None:  # only a disk tier evicts RAM copies: unreachable by construction
            raise InternalError(f"object {obj.key[:64]!r} has no RAM copy and this service no disk tier")
        waiter = ParkedLoad(conn.cid, c.client_id, req)
        flight = self.reads.get(obj.key)
        if flight is not None:
            self.reads.join(flight, waiter)
            self.store.joined(obj)
        else:
            self.reads.check_room()
            t = self.store.begin_read_back(obj)  # CapacityError: refused, nothing reserved
            try:
                self.reads.start(obj.key, t, waiter)
            except BaseException:
                self.store.cancel_read_back(obj)
                raise
        conn.parked_loads += 1
        self.stats["loads_parked"] += 1
        return _DEFERRED

    def _collect_reads(self) -> None:
        """Settle every finished read-back, each in its own try; then run or fail each of its parked loads."""
        self.version += 1
        try:
            flights = self.reads.finished()
        except Exception:
            self._internal("collect reads: finished()")
            return
        for f in flights:
            try:
                self._settle_flight(f)
            except Exception:
                self._internal("collect reads", f"object {f.key[:64]!r}")

    def _settle_flight(self, f: Flight) -> None:
        err: ServiceError | None = None
        obj = self.store.objects.get(f.key)
        try:
            if obj is None or not obj.reading:  # a reading object can be neither dropped nor evicted
                raise InternalError(f"object {f.key[:64]!r} changed while its read-back was in flight")
            if isinstance(f.error, ReadCancelledError):  # shutdown came first: nothing was read
                self.store.cancel_read_back(obj)
                err = ShuttingDownError(f"service is shutting down (the read of {f.key[:64]!r} was cancelled)")
            else:
                self.store.end_read_back(obj, f.tensor, f.digest, f.error)
        except DiskReadError as e:
            log.warning("read-back of %r failed (%d load(s) refused): %s", f.key[:64], len(f.waiters), e)
            err = e
        except Exception as e:
            self._internal("collect reads: install", f"object {f.key[:64]!r}")
            err = InternalError(f"installing the read-back failed: {type(e).__name__}: {e}")
        finally:
            f.tensor = None  # type: ignore[assignment]  # installed, or dropped with the failure
        now = time.monotonic()
        for w in f.waiters:
            conn = self.conns.get(w.cid)
            if conn is None or conn.client is None or conn.client.client_id != w.client_id:
                self.stats["parked_loads_dropped"] += 1  # the connection went away meanwhile
                continue
            conn.parked_loads -= 1
            seq = w.req.seq
            try:
                if err is not None:
                    raise err
                conn.client.last_seen = now  # it could not heartbeat while we owed it this reply
                self.registry.require_live(conn.client)
                result = self._op_load(conn, conn.client, w.req)
                if result is not _DEFERRED:
                    self._send(conn, ok_reply(seq, result))
            except ServiceError as e:
                self._fail(conn, seq, e)
            except Exception as e:
                self._internal("collect reads: parked load", f"conn {conn.cid}")
                self._fail(conn, seq, InternalError(f"{type(e).__name__}: {e}"))

    def _accept_job(self, job: CopyJob, src: Any, dst: Any, writes: bool, undo: Any) -> dict[str, Any]:
        reg = job.reg
        if reg.state is not State.ACTIVE or reg.memory is None:
            self.stats["stale_uses"] += 1  # unreachable by construction; counted, never silently used
            undo()
            raise InternalError(f"registration {reg.reg_id} not mapped at accept")
        try:
            self.copies.start(job, src, dst)
        except Exception:
            undo()
            raise
        self.copies.reservations.add(reg.reg_id, job.offset, job.offset + job.nbytes, writes, job.req_id)
        self.registry.begin_work(reg, job.req_id)
        return {"req": job.req_id, "state": job.state}

    def _collect_copies(self) -> None:
        """Finish the bookkeeping of every drained copy. Each job in its own try, and what must happen
        regardless (a terminal state, the store settled, the reservation removed, the registration's in-flight
        entry ended, parked waits answered) runs step by step in _settle_job, so one job's failure can skip
        neither its own cleanup nor any other job's."""
        self.version += 1
        try:
            jobs = self.copies.finished()
        except Exception:
            self._internal("collect: finished()")
            return
        for job in jobs:
            try:
                self._complete_job(job)
            except Exception as e:
                self._internal("collect", f"request {job.req_id}")
                job.error = f"internal error collecting this copy: {type(e).__name__}: {e}"
                if job.state == "running" or not job.store_settled:
                    job.state = "failed"  # its result is not trusted (a save is aborted below)
            finally:
                self._settle_job(job)

    def _complete_job(self, job: CopyJob) -> None:
        if "collect_raises" in self.opts.faults and job.obj.key.startswith(FAULT_KEY_PREFIX):
            raise RuntimeError(f"injected fault collect_raises (request {job.req_id})")
        if job.reg.memory is None:  # the mapping went away under a running copy: must never happen
            self.stats["stale_uses"] += 1
        failed = job.ticket.state == "failed" or job.error is not None
        job.error = job.error or job.ticket.error
        state = "cancelled" if job.cancel_requested else ("failed" if failed else "done")
        job.tensors = ()  # drop our views before the registry may unmap
        if job.kind == "save":
            (self.store.commit if state == "done" else self.store.abort)(job.obj)
        else:
            self.store.release(job.obj)
        job.store_settled = True
        job.state = state

    def _settle_job(self, job: CopyJob) -> None:
        def terminal() -> None:
            if job.state == "running":
                job.state, job.error = "failed", job.error or "internal error"
            job.finished_at = job.finished_at or time.monotonic()
            job.tensors = ()
            self.stats[f"copies_{job.state}"] += 1

        def store() -> None:
            if job.store_settled:
                return
            job.store_settled = True
            if job.kind == "load":
                self.store.release(job.obj)
            elif self.store.objects.get(job.obj.key) is job.obj:  # pending, or a commit cut short: not trusted
                self.store.abort(job.obj)

        steps = [("terminal state", terminal), ("store", store),
                 ("reservation", lambda: self.copies.reservations.remove(job.reg.reg_id, job.req_id)),
                 ("end of work", lambda: self.registry.end_work(job.reg, job.req_id))]
        for name, step in steps:
            try:
                step()
            except Exception:
                self._internal(f"collect: {name}", f"request {job.req_id}")
        for conn in list(self.conns.values()):
            try:
                parked = conn.parked.pop(job.req_id, None)
                if parked is not None:
                    self._send(conn, ok_reply(parked[0], job.describe()))
            except Exception:
                self._internal("collect: answer wait", f"request {job.req_id}")

    def _own_job(self, c: Client, req_id: int) -> CopyJob:
        job = self.copies.get(req_id)
        if job.client_id != c.client_id:
            raise NotOwnerError(f"request {req_id} belongs to another client")
        return job

    def _op_wait(self, conn: Conn, c: Client, req: Request) -> Any:
        job = self._own_job(c, req.args["req"])
        if job.terminal or req.args["timeout_s"] == 0:
            return job.describe()
        if job.req_id in conn.parked:
            raise SequenceError(f"a wait for request {job.req_id} is already pending")
        conn.parked[job.req_id] = (req.seq, time.monotonic() + req.args["timeout_s"])
        return _DEFERRED

    def _op_cancel(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        job = self._own_job(c, req.args["req"])
        if not job.terminal:
            job.cancel_requested = True  # the copy runs on; its range stays reserved until it drained
        return job.describe()

    def _op_evict(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        self._require_admin(conn, req, "evict")  # originals are shared: one client may not drop others' data
        a = req.args
        out = self.store.evict(a["key"], tier=a["tier"], force=a["force"])
        return {"evicted": len(out["evicted"]), "kept": out["kept"]}

    def _op_retain(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        self._require_admin(conn, req, "retain")
        key = req.args["key"]
        obj = self.store.objects.get(key)
        if obj is None or obj.state != "committed":
            raise ObjectMissingError(f"no committed object {key[:64]!r} to retain")
        self.store.retention.retain(req.args["group"], key)
        return {"group": req.args["group"], "retained": True}

    def _op_unretain(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        self._require_admin(conn, req, "unretain")
        return {"group": req.args["group"], "released": self.store.retention.unretain(req.args["group"])}

    def _require_admin(self, conn: Conn, req: Request, what: str) -> None:
        """Admin = the service's uid (or root) AND the admin token from the runtime dir, compared in constant
        time. Same-uid clients without the token are ordinary clients."""
        if conn.peer.uid not in (os.getuid(), 0):
            raise NotAuthorizedError(f"{what} is for the service's own uid")
        if not identity.token_ok(self.admin_token, req.args.get("admin")):
            why = "without" if req.args.get("admin") is None else "with a wrong"
            raise NotAuthorizedError(f"{what} {why} admin token refused (the token is in {self.admin_path})")

    def _op_status(self, conn: Conn, req: Request) -> dict[str, Any]:
        """A bounded summary: counts, states, counters, health, store totals; the lists come from `list`."""
        c = conn.client
        assert c is not None
        if req.args["scope"] == "self":
            snap = self.registry.summary(c.client_id)
            mine = [j for j in self.copies.jobs.values() if j.client_id == c.client_id]
            snap["counts"].update(requests=len(mine), requests_running=sum(not j.terminal for j in mine))
            snap["client"] = c.describe()
            snap["version"] = self.version
            return snap
        self._require_admin(conn, req, "status of all clients")
        snap = self.registry.summary()
        snap["counts"].update(requests=len(self.copies.jobs), requests_running=self.copies.running(),
                              objects=len(self.store.objects))
        snap.update(self.health())
        snap["store"] = self.store.summary()
        snap["disk_reads"] = self.reads.describe() if self.reads is not None else None
        snap["version"] = self.version
        snap["limits"] = {k: getattr(self.opts, k) for k in ("max_regs_per_client", "max_regs", "max_tombstones",
                                                              "max_objects", "max_jobs", "max_connections")}
        return snap

    def _op_list(self, conn: Conn, req: Request) -> dict[str, Any]:
        """One page of one list, in cursor order (ids; release order for `released`; creation order for
        objects). Ordinary clients see only their own items; everything else is an admin op."""
        c = conn.client
        assert c is not None
        a = req.args
        what = a["what"]
        everyone = a["scope"] == "all"
        if everyone or what == "objects":
            self._require_admin(conn, req, f"listing {'all ' if everyone else ''}{what}")

        def own(client_id: int) -> bool:
            return everyone or client_id == c.client_id

        items: list[tuple[int, Any]]  # (cursor, thing), ascending cursor
        if what == "clients":
            items = sorted((k, x) for k, x in self.registry.clients.items() if own(k))
        elif what == "registrations":
            items = sorted((k, x) for k, x in self.registry.regs.items() if own(x.client_id))
        elif what == "released":
            items = [(t.seq, t) for t in self.registry.tombstones.values() if own(t.client_id)]  # bury order
        elif what == "requests":
            items = [(k, j) for k, j in self.copies.jobs.items()
                     if own(j.client_id) and not (a["running"] and j.terminal)]  # ids ascend in insertion order
        else:
            items = sorted(((o.seq, o) for o in self.store.objects.values()), key=lambda t: t[0])
        keys = [k for k, _ in items]
        after = a["after"]
        if a["order"] == "asc":
            start = bisect.bisect_right(keys, after) if after is not None else 0
            todo = items[start:]
        else:
            stop = bisect.bisect_left(keys, after) if after is not None else len(items)
            todo = items[:stop][::-1]
        limit = a["limit"]
        cut_short = False
        if what == "objects" and a["verify"]:
            hashed = 0  # bounded hashing per page: the loop serves everyone else in between
            for i, (_, o) in enumerate(todo[:limit]):
                hashed += o.nbytes
                if hashed > VERIFY_BYTES and i > 0:
                    todo, cut_short = todo[:i], True
                    break
        verify = a["verify"]
        page, nxt = cut_page(((k, (lambda x=x: x.describe(verify) if what == "objects" else x.describe()))
                              for k, x in todo), limit)
        if nxt is None and cut_short and page:
            nxt = todo[len(page) - 1][0]
        return {"items": page, "next": nxt, "version": self.version}

    def health(self) -> dict[str, Any]:
        from kmesh.shm import mapped_shm

        violations = self.registry.violations()
        return {"stats": self.stats, "violations": [clip(v) for v in violations[:16]],  # bounded: first 16
                "violations_count": len(violations), "copies_running":
                self.copies.running(), "reservations": self.copies.reservations.count(),
                "engine_holds": self.copies.live_holds(), "cuda_handles_open": len(self.cuda),
                "memfd_mappings": mapped_shm(), "open_fds": len(os.listdir("/proc/self/fd")),
                "fd_baseline": self._fd_baseline, "connections_open": len(self.conns),
                "stopping": self.stopping, "pid": os.getpid()}

    def _op_shutdown(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        self._require_admin(conn, req, "shutdown")
        self._begin_shutdown(f"requested by client {c.client_id}")
        return {"state": "stopping", "registrations": len(self.registry.regs)}

    def _begin_shutdown(self, why: str) -> None:
        if not self.stopping:
            log.info("shutting down (%s): closing %d registration(s)", why, len(self.registry.regs))
        self.stopping = True
        self.version += 1
        if self.reads is not None:
            self.reads.stop_waiting()  # held reads end now; their parked loads get shutting_down
        for reg in list(self.registry.regs.values()):
            self.registry.close(reg, "service shutdown")

    # -- memory release (the registry's unmap callback) -----------------------------------------------
    def _unmap(self, reg: Registration) -> None:
        mem = reg.memory
        if mem is not None:
            if mem.tensor is not None:
                self.copies.check_released(mem.tensor)  # BufferHeldError while the engine holds any byte
            try:
                mem.close()  # SegmentBusyError / HandleError while views remain
            except (SegmentBusyError, HandleError):
                if not self.copies.recycle_idle():  # see CopyRunner.recycle_idle
                    raise
                mem.close()
        if reg.kind == "memfd" and isinstance(reg.handle, int) and reg.handle >= 0:
            os.close(reg.handle)
            reg.handle = -1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kmesh.service.server", description=__doc__.splitlines()[0])
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
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--fault", action="append", choices=FAULTS, default=[], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, stream=sys.stderr,
                        format="%(asctime)s kmesh-service[%(process)d] %(levelname)s %(message)s")
    if a.device.startswith("cuda"):
        import torch

        torch.cuda.init()
        torch.zeros(1, device=a.device)  # create the context before the first client arrives
    uids = frozenset(a.allow_uid) if a.allow_uid else frozenset({os.getuid()})
    try:
        svc = Service(ServiceOptions(a.runtime_dir, a.device, a.heartbeat_timeout, a.store_bytes, a.chunk_bytes,
                                     a.gate_fd, a.socket_mode, uids, max_regs_per_client=a.max_regs_per_client,
                                     max_regs=a.max_regs, max_tombstones=a.max_tombstones,
                                     max_objects=a.max_objects, max_jobs=a.max_jobs, faults=tuple(a.fault),
                                     disk_dir=a.disk_dir, adopt=not a.no_adopt,
                                     disk_read_threads=a.disk_read_threads, max_disk_reads=a.max_disk_reads,
                                     disk_read_gate_fd=a.disk_read_gate_fd))
        if a.fault:
            log.warning("FAULTS INJECTED (negative control): %s", a.fault)
        svc.bind()
    except (ServiceError, OSError, ValueError) as e:
        print(f"kmesh service: cannot start: {e}", file=sys.stderr)
        return 2
    svc.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
