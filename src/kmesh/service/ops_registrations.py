"""Operations on clients and registrations: hello, heartbeat, register, activate, close; and the checks every
copy request makes of the registration it names (work_registration, check_range).

The lifecycle itself (which state may follow which) is the registry's (kmesh.service.registry); these
handlers validate what a client sends, map or unmap its memory, and hand each transition to the registry.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from kmesh.service import descriptor, identity
from kmesh.service.errors import (ClientLostError, HandleError, LayoutMismatchError, RangeError, RegistrationStateError,
                                  SchemaError, SequenceError, ServiceError, ShuttingDownError)
from kmesh.service.handles import MappedMemfd, check_memfd
from kmesh.service.jobs import CopyRunner
from kmesh.service.protocol import VERSION, Request
from kmesh.service.registry import Client, Registration, State
from kmesh.service.state import FAULT_TICK_CLIENT, Conn, Replies, ServiceState
from kmesh.transfer.shm import SegmentBusyError

log = logging.getLogger("kmesh.service")


class RegistrationOps:
    def __init__(self, state: ServiceState, replies: Replies) -> None:
        self.state = state
        self.replies = replies

    def hello(self, conn: Conn, req: Request) -> dict[str, Any]:
        st = self.state
        if conn.client is not None:
            raise SequenceError("hello was already done on this connection")
        if st.stopping:
            raise ShuttingDownError("service is shutting down")
        if identity.exited(conn.peer.pidfd):
            raise ClientLostError("the connecting process has already exited")
        a, now = req.args, time.monotonic()
        if a["takeover"]:
            if a["instance"] is None:
                raise SchemaError("takeover names the instance to take over")
            st.require_admin(conn, req, "taking over a live client's instance")
        if a["instance"] is not None:
            old = st.registry.holder(a["instance"])
            if old is not None:
                self._lose_if_gone(old, now)
        c = st.registry.add_client(a["instance"], a["name"], conn.peer, identity.new_token(), conn.cid, now,
                                   takeover=a["takeover"])
        conn.client = c
        if conn.peer.pidfd >= 0:
            self.replies.watch_exit(conn)
        p = conn.peer
        return {"client": c.client_id, "token": c.token, "heartbeat_s": st.opts.heartbeat_timeout_s,
                "protocol": VERSION, "server_pid": os.getpid(), "device": st.opts.device,
                "peer": {"pid": p.pid, "uid": p.uid, "gid": p.gid, "pidfd": p.pidfd_source}}

    def _lose_if_gone(self, c: Client, now: float) -> None:
        """Declare c lost now if it already is, though its pidfd / heartbeat event has not been handled yet: a
        replacement that claims a dead client's instance must not be refused for the service's lag."""
        st = self.state
        conn = st.conns.get(c.conn_id) if c.conn_id is not None else None
        if conn is not None and identity.exited(conn.peer.pidfd):
            why = "client died"
        elif now - c.last_seen > st.opts.heartbeat_timeout_s:
            why = "heartbeat lost"
        else:
            return
        log.info("client %d: %s (seen at a claim on its instance %s)", c.client_id, why, c.instance)
        st.version += 1
        st.registry.lose_client(c, why)

    def lose_silent_clients(self, now: float) -> None:
        """The tick's heartbeat deadlines: each client in its own try, an internal error in one costs the
        others nothing."""
        st = self.state
        for c in list(st.registry.clients.values()):
            try:
                if "tick_raises" in st.opts.faults and c.live and c.name == FAULT_TICK_CLIENT:
                    raise RuntimeError(f"injected fault tick_raises (client {c.client_id})")
                if c.live and now - c.last_seen > st.opts.heartbeat_timeout_s and not self._owes_load(c):
                    log.info("client %d: heartbeat lost (%.2f s silent)", c.client_id, now - c.last_seen)
                    st.version += 1
                    st.registry.lose_client(c, "heartbeat lost")
            except Exception:
                st.internal("tick: heartbeat", f"client {c.client_id}")

    def _owes_load(self, c: Client) -> bool:
        """A client whose load reply we still owe cannot heartbeat (its one connection waits for us)."""
        conn = self.state.conns.get(c.conn_id) if c.conn_id is not None else None
        return conn is not None and conn.parked_loads > 0

    def settle_closed(self) -> None:
        """The tick's deferred releases: each drained (or closing, idle) registration in its own try."""
        st = self.state
        for reg in [r for r in st.registry.regs.values()
                    if r.state is State.DRAINED or (r.state is State.CLOSING and not r.in_flight)]:
            try:  # also retries a closing registration whose settle was cut short by an error
                st.registry.settle(reg)
            except Exception:
                st.internal("tick: settle", f"registration {reg.reg_id}")

    def heartbeat(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        return {"deadline_s": self.state.opts.heartbeat_timeout_s}

    def register(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        st = self.state
        a = req.args
        if st.stopping:
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
            if not st.opts.device.startswith("cuda"):
                raise HandleError("this service runs without CUDA; register host memory (memfd)")
            handle = a["cuda"]
        reg = st.registry.register(c, a["alloc_id"], a["generation"], a["kind"], a["nbytes"], layout,
                                   descriptor.digest(layout), descriptor.geometry_digest(layout), handle)
        if a["kind"] == "memfd":
            req.fds.remove(handle)  # the registration owns the fd now
        return {"reg": reg.reg_id, "gen": reg.generation, "state": reg.state.value,
                "layout_digest": reg.layout_digest}

    def activate(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        st = self.state
        reg = st.registry.resolve(c, req.args["reg"], req.args["gen"])
        if reg.state is not State.REGISTERED:
            raise RegistrationStateError(f"registration {reg.reg_id} is {reg.state.value}, not registered")
        try:
            if reg.kind == "memfd":
                memory: Any = MappedMemfd(os.dup(reg.handle), reg.nbytes)
                os.close(reg.handle)  # the mapping owns its fd from here on
                reg.handle = -1
            else:
                memory = st.cuda.open(reg.handle, reg.nbytes)
        except ServiceError as e:
            st.registry.close(reg, f"activate failed: {e}")
            raise
        except Exception as e:
            st.registry.close(reg, f"activate failed: {e}")
            raise HandleError(f"cannot map the registered memory: {type(e).__name__}: {e}") from None
        st.registry.activate(reg, memory)
        return {"state": reg.state.value}

    def close(self, conn: Conn, c: Client, req: Request) -> dict[str, Any]:
        reg = self.state.registry.resolve(c, req.args["reg"], req.args["gen"])
        state = self.state.registry.close(reg, "closed by client")
        return {"state": state.value, "in_flight": sorted(reg.in_flight)}


def check_range(reg: Registration, offset: int, nbytes: int) -> None:
    item = reg.itemsize()
    if offset + nbytes > reg.nbytes:
        raise RangeError(f"[{offset}, {offset + nbytes}) outside the {reg.nbytes}-byte registration")
    if offset % item or nbytes % item:
        raise RangeError(f"offset {offset} / size {nbytes} not multiples of the {item}-byte element")


def work_registration(state: ServiceState, c: Client, req: Request) -> Registration:
    """The registration a save/load names: live, active, and described by the same layout the client sent."""
    if state.stopping:
        raise ShuttingDownError("service is shutting down")
    reg = state.registry.resolve(c, req.args["reg"], req.args["gen"])
    state.registry.require_active(reg)
    if req.args["layout_digest"] != reg.layout_digest:
        raise LayoutMismatchError(f"request's layout digest differs from registration {reg.reg_id}'s")
    return reg


def release_memory(copies: CopyRunner, reg: Registration) -> None:
    """The registry's unmap callback: raises (and the registration stays drained, retried) while any view or
    engine hold on its memory remains."""
    mem = reg.memory
    if mem is not None:
        if mem.tensor is not None:
            copies.check_released(mem.tensor)  # BufferHeldError while the engine holds any byte
        try:
            mem.close()  # SegmentBusyError / HandleError while views remain
        except (SegmentBusyError, HandleError):
            if not copies.recycle_idle():  # see CopyRunner.recycle_idle
                raise
            mem.close()
    if reg.kind == "memfd" and isinstance(reg.handle, int) and reg.handle >= 0:
        os.close(reg.handle)
        reg.handle = -1
