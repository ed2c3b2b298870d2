"""The cache-service process: one selector loop over a 0600 Unix socket; never dies of a client's mistake.

Everything that changes the registry or the store runs on this one thread, so a request is handled start to
finish without interleaving: validate (protocol), resolve (registry), accept (reservations + engine), reply.
This module is that loop (sockets, frames, timers, connections); what each op does is in ops_registrations,
ops_objects (with the disk tier's parked loads), ops_copies and ops_admin, all on one ServiceState (state.py).
A malformed or unauthorised message gets a typed error reply and changes nothing; a frame that cannot be
trusted (bad magic, oversized, truncated) also ends that connection. An internal error (a bug) in one client's
work is counted and logged and costs at most that piece of work: every part of the loop (each request, each
finished copy's bookkeeping, each client / wait / registration in the tick) runs in its own try.

    python -m kmesh.service.server --runtime-dir DIR [--device cpu|cuda] [--heartbeat-timeout S] ...
(normally started by `kmesh service start` or kmesh.service.process.start()).
"""
from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any, Callable

from kmesh.service import identity, process
from kmesh.service.errors import (AuthError, CapacityError, FrameTooLargeError, HandleError, InternalError,
                                  ReplyTooLargeError, SequenceError, ServiceError, TruncatedFrameError,
                                  UnsupportedVersionError)
from kmesh.service.handles import close_fds, recv_some
from kmesh.service.ops_admin import AdminOps
from kmesh.service.ops_copies import CopyOps
from kmesh.service.ops_objects import ObjectOps
from kmesh.service.ops_registrations import RegistrationOps, release_memory
from kmesh.service.process import PID_NAME, SOCKET_NAME
from kmesh.service.protocol import (VERSION, Frame, Request, error_reply, ok_reply, pack_frame, parse_request,
                                    peek_seq, unpack_body)
from kmesh.service.registry import Client
from kmesh.service.state import FAULTS, MAX_REGS_PER_CLIENT  # noqa: F401  (importable from here, as before)
from kmesh.service.state import DEFERRED, Conn, Replies, ServiceOptions, ServiceState

log = logging.getLogger("kmesh.service")
_READ_ONLY = frozenset({"ping", "heartbeat", "wait", "status", "list"})  # change nothing status/list show
Handler = Callable[[Conn, Client, Request], Any]


class Service:
    def __init__(self, opts: ServiceOptions) -> None:
        opts.check()
        self.opts = opts
        self.sel = selectors.DefaultSelector()
        self.state = ServiceState.open(opts, release_memory)
        self.socket_path = opts.runtime_dir / SOCKET_NAME
        self.pid_path = opts.runtime_dir / PID_NAME
        # The state's own objects, never rebound: the loop (and in-process tests) use them by these names.
        self.registry, self.reads, self.copies = self.state.registry, self.state.reads, self.state.copies
        self.conns, self.stats = self.state.conns, self.state.stats
        self._next_cid = 1
        self.listener: socket.socket | None = None
        replies = Replies(self._send, self._fail, self._watch_exit)
        regs = self.registrations = RegistrationOps(self.state, replies)
        copies = self.copy_ops = CopyOps(self.state, replies)
        objects = self.objects = ObjectOps(self.state, replies, copies)
        self.admin = AdminOps(self.state)
        self._ops: dict[str, Handler] = {  # a live client's ops (hello, status and list are dispatched before)
            "heartbeat": regs.heartbeat, "register": regs.register, "activate": regs.activate, "close": regs.close,
            "save": objects.save, "load": objects.load, "load_many": objects.load_many, "evict": objects.evict,
            "retain": objects.retain, "unretain": objects.unretain, "wait": copies.wait, "cancel": copies.cancel,
            "shutdown": self.admin.shutdown}

    @property
    def admin_token(self) -> bytes | None:
        """Set by bind(); None refuses every admin op."""
        return self.state.admin_token

    @admin_token.setter
    def admin_token(self, token: bytes | None) -> None:
        self.state.admin_token = token

    # -- setup --------------------------------------------------------------------------------------
    def bind(self) -> None:
        process.claim_runtime_dir(self.opts.runtime_dir, self.opts.socket_mode)
        # Before the socket exists: whoever sees the service answer can also find its admin token.
        self.admin_token = identity.create_admin_token(self.state.admin_path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        old = os.umask(0o777 & ~self.opts.socket_mode)  # no window where the socket is wider than asked
        try:
            s.bind(str(self.socket_path))
        except BaseException:
            s.close()
            self.state.admin_path.unlink(missing_ok=True)
            raise
        finally:
            os.umask(old)
        os.chmod(self.socket_path, self.opts.socket_mode)
        s.listen(64)
        self.listener = s
        self.sel.register(s, selectors.EVENT_READ, ("listen", None))
        for fd, kind in self.state.wake_fds():
            self.sel.register(fd, selectors.EVENT_READ, (kind, None))
        self.pid_path.write_text(f"{os.getpid()}\n")
        self.state.fd_baseline = len(os.listdir("/proc/self/fd"))

    def serve(self) -> None:
        """Run until a shutdown request (or SIGTERM) and every registration has been released."""
        signal.signal(signal.SIGTERM, lambda *_: self.admin.begin_shutdown("SIGTERM"))
        signal.signal(signal.SIGINT, lambda *_: self.admin.begin_shutdown("SIGINT"))
        log.info("kmesh service pid %d on %s (device %s)", os.getpid(), self.socket_path, self.opts.device)
        self.objects.log_disk_tier()
        try:
            while not (self.state.stopping and not self.registry.regs and not self.state.helpers_busy()):
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
        for p in (self.socket_path, self.pid_path, self.state.admin_path):
            p.unlink(missing_ok=True)
        self.state.close_helpers()
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
                    self.copy_ops.collect()
                elif kind == "diskread":
                    self.objects.collect_reads()
                elif kind == "remote":
                    self.objects.collect_remote()
            except Exception:  # a bug must cost one connection at most, never the service
                self.state.internal(f"handling {kind}")
                if kind == "conn" and obj.cid in self.conns:
                    self._drop_conn(obj)
        try:
            self._tick(time.monotonic())
        except Exception:  # _tick guards each of its parts; this is the last line
            self.state.internal("tick")

    def _timeout(self, now: float) -> float:
        t = 0.2
        for c in self.registry.clients.values():
            if c.live:
                t = min(t, c.last_seen + self.opts.heartbeat_timeout_s - now)
        for conn in self.conns.values():
            for _, deadline in conn.parked.values():
                t = min(t, deadline - now)
            for _, _, deadline, _ in conn.parked_batches:
                t = min(t, deadline - now)
        return max(t, 0.005)  # a deadline whose handling keeps failing must not make the loop spin

    def _tick(self, now: float) -> None:
        """Heartbeat deadlines, parked-wait deadlines, deferred releases. Each client / wait / registration
        is handled in its own try: an internal error in one is counted and costs the others nothing."""
        released = self.registry.counters["released"]
        self.registrations.lose_silent_clients(now)
        self.copy_ops.expire_waits(now)
        self.registrations.settle_closed()
        if self.registry.counters["released"] != released:
            self.state.version += 1

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
                with contextlib.suppress(OSError):
                    sock.send(pack_frame(error_reply(None, e) | {"fatal": True}))
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
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.sock.close()
        close_fds(conn.asm.fds)
        conn.parked.clear()
        conn.parked_batches.clear()
        if conn.client is not None:
            self.state.version += 1
            self._forget_pidfd(conn)
            self.registry.detach_connection(conn.client)
        elif conn.peer.pidfd >= 0:
            os.close(conn.peer.pidfd)

    def _watch_exit(self, conn: Conn) -> None:
        self.sel.register(conn.peer.pidfd, selectors.EVENT_READ, ("pidfd", conn))

    def _forget_pidfd(self, conn: Conn) -> None:
        if conn.peer.pidfd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn.peer.pidfd)
            os.close(conn.peer.pidfd)
            conn.peer = identity.Peer(conn.peer.pid, conn.peer.uid, conn.peer.gid, -1, conn.peer.pidfd_source)

    def _client_died(self, conn: Conn) -> None:
        c = conn.client
        log.info("client %s (pid %d) exited", c.client_id if c else "?", conn.peer.pid)
        if c is not None and c.live:
            self.state.version += 1
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
            if result is not DEFERRED:
                self._send(conn, ok_reply(seq, result))
        except ServiceError as e:
            self._fail(conn, seq, e)
        except Exception as e:
            self.state.internal("a request", f"conn {conn.cid}")
            self._fail(conn, seq, InternalError(f"{type(e).__name__}: {e}"))
        finally:
            close_fds(frame.fds)  # handlers take the fds they keep out of this list
            if mutating:  # refused requests change nothing by design; counting them too is merely cautious
                self.state.version += 1

    def _dispatch(self, conn: Conn, req: Request) -> Any:
        if req.op == "ping":
            return {"pong": True, "protocol": VERSION, "server_pid": os.getpid()}
        if req.op == "hello":
            return self.registrations.hello(conn, req)
        c = conn.client
        if c is None:
            raise SequenceError(f"op {req.op!r} before hello")
        if not identity.token_ok(c.token, req.token):
            raise AuthError("token does not match this connection's client")
        c.last_seen = time.monotonic()
        if req.op == "status":
            return self.admin.status(conn, req)
        if req.op == "list":  # like status: a lost client may still look at what it had
            return self.admin.list(conn, req)
        self.registry.require_live(c)
        return self._ops[req.op](conn, c, req)

    def _op_hello(self, conn: Conn, req: Request) -> dict[str, Any]:
        """hello by its old name (in-process tests drive it without a selector run)."""
        return self.registrations.hello(conn, req)


def main(argv: list[str] | None = None) -> int:
    opts, log_level = ServiceOptions.from_argv(argv, "python -m kmesh.service.server", __doc__.splitlines()[0])
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s kmesh-service[%(process)d] %(levelname)s %(message)s")
    if opts.device.startswith("cuda"):
        import torch

        torch.cuda.init()
        torch.zeros(1, device=opts.device)  # create the context before the first client arrives
    try:
        svc = Service(opts)
        if opts.faults:
            log.warning("FAULTS INJECTED (negative control): %s", list(opts.faults))
        svc.bind()
    except (ServiceError, OSError, ValueError) as e:
        print(f"kmesh service: cannot start: {e}", file=sys.stderr)
        return 2
    svc.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
