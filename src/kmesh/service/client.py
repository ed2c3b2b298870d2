"""The one client of the cache service. Stages, workers and tests all talk to the service through this.

    with ServiceClient.connect(socket_path) as svc:   # anonymous; instance=N claims a unique instance number
        buf = HostBuffer(descriptor.nbytes(layout))      # a KVLayout.to_dict() descriptor
        reg = svc.register_host(buf, alloc_id=buf.address, generation=1, layout=layout)
        req = svc.save(reg, b"prefix-0", offset=0, nbytes=4096)
        svc.wait(req)                       # the copy has physically finished
        svc.close(reg)                      # closing -> drained -> released on the service

Requests are synchronous (one in flight per connection); a heartbeat thread keeps the client alive on the
service while the caller computes. Error replies raise the typed ServiceError subclass of their code.
Admin ops (shutdown, evict, retain/unretain, status("all"), listing all clients' items or the store) need
`admin_token=` (read from the runtime dir by kmesh.service.process); without it they raise NotAuthorizedError. Every
reply fits in one frame: status() assembles its lists from pages (`list` op), so it works however large the store grows.
Host-memory use does not import torch; CUDA registrations do. Layouts are KVLayout.to_dict() descriptors;
the service validates them (kmesh.service.descriptor), so a client need not import kmesh.kv.layout.
"""
from __future__ import annotations

import itertools
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kmesh.service.errors import ConnectionLostError, ServiceUnavailableError, WaitTimeoutError, error_from_reply
from kmesh.service.handles import HostBuffer, export_cuda, send_frame
from kmesh.service.protocol import HEADER, MAGIC, VERSION, pack_frame, unpack_body


@dataclass(frozen=True)
class RegRef:
    """What a client needs to name one of its registrations."""

    reg: int
    gen: int
    layout_digest: bytes
    kind: str
    nbytes: int
    device: int | None = None  # CUDA device of a cuda_ipc registration


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """Blocking read of one frame: (version, payload). ConnectionLostError on EOF."""
    head = _read_exact(sock, HEADER.size)
    magic, version, _nfds, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise ConnectionLostError(f"service sent a frame with bad magic {magic!r}")
    return version, _read_exact(sock, length)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionLostError("the service closed the connection")
        buf += chunk
    return bytes(buf)


class ServiceClient:
    def __init__(self, sock: socket.socket, timeout: float = 30.0) -> None:
        self.sock = sock
        self.timeout = timeout
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self.token: bytes | None = None
        self.admin_token: bytes | None = None  # the admin capability, sent only with admin ops
        self.client_id: int | None = None
        self.heartbeat_s = 10.0
        self.server_pid: int | None = None
        self._hb_stop = threading.Event()
        self._hb_paused = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self.heartbeat_errors: list[str] = []

    # -- connection ------------------------------------------------------------------------------------
    @classmethod
    def open(cls, socket_path: str | Path, timeout: float = 30.0) -> "ServiceClient":
        """Connect without hello (ping, or a raw protocol session)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(timeout)
        try:
            s.connect(str(socket_path))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            s.close()
            raise ServiceUnavailableError(f"no kmesh service at {socket_path}: {e.strerror}") from None
        return cls(s, timeout)

    @classmethod
    def connect(cls, socket_path: str | Path, instance: int | None = None, name: str = "", heartbeat: bool = True,
                timeout: float = 30.0, admin_token: bytes | None = None, takeover: bool = False) -> "ServiceClient":
        """Connect and say hello: the service binds this connection to our kernel credentials and issues a
        token that every later request carries. instance: None = anonymous (never collides); a number is
        refused (InstanceInUseError) while a live client holds it, unless takeover=True with admin_token (the
        old client's registrations then close and drain). admin_token: the service's admin capability (see
        kmesh.service.process.ServiceProcess.admin_token), for shutdown / evict / status("all") / takeover."""
        c = cls.open(socket_path, timeout)
        c.admin_token = admin_token
        hello: dict[str, Any] = {"name": name}
        if instance is not None:
            hello["instance"] = instance
        if takeover:
            hello.update(takeover=True, **c._admin())
        try:
            r = c.call("hello", **hello)
        except BaseException:
            c.sock.close()
            raise
        c.token, c.client_id, c.heartbeat_s = r["token"], r["client"], r["heartbeat_s"]
        c.server_pid = r["server_pid"]
        if heartbeat:
            c._hb_thread = threading.Thread(target=c._heartbeats, name="kmesh-heartbeat", daemon=True)
            c._hb_thread.start()
        return c

    def _heartbeats(self) -> None:
        while not self._hb_stop.wait(self.heartbeat_s / 4):
            if self._hb_paused.is_set():
                continue
            try:
                self.call("heartbeat")
            except Exception as e:  # the next real call reports the problem; keep a trace for tests
                self.heartbeat_errors.append(f"{type(e).__name__}: {e}")
                return

    def pause_heartbeats(self) -> None:
        """Stop sending heartbeats (tests: make the service see this client go silent)."""
        self._hb_paused.set()

    def resume_heartbeats(self) -> None:
        self._hb_paused.clear()

    def close_connection(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
            self._hb_thread.join(timeout=2)
        self.sock.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_connection()

    # -- calls -----------------------------------------------------------------------------------------
    def call(self, op: str, _fds: list[int] = (), _timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """One request/reply. Raises the typed ServiceError of an error reply."""
        body = {"op": op, "seq": 0, **fields}
        if self.token is not None and op not in ("hello", "ping"):
            body.setdefault("token", self.token)
        reply = self.raw(body, _fds, timeout=_timeout)
        if reply.get("ok") is True:
            return reply["result"]
        err = reply.get("error") or {}
        raise error_from_reply(err.get("code"), err.get("message"))

    def raw(self, body: dict[str, Any], fds: list[int] = (), version: int = VERSION,
            timeout: float | None = None) -> dict[str, Any]:
        """Send one message (any body: tests use this for malformed ones) and return the decoded reply."""
        with self._lock:
            seq = next(self._seq) & 0xFFFFFFFF
            ours = body.get("seq") == 0
            if ours:
                body = {**body, "seq": seq}
            self.sock.settimeout(timeout or self.timeout)
            try:
                send_frame(self.sock, pack_frame(body, nfds=len(fds), version=version), list(fds))
                _, payload = read_frame(self.sock)
            except (BrokenPipeError, ConnectionResetError) as e:
                raise ConnectionLostError(f"connection to the service lost: {e}") from None
            except socket.timeout:
                raise ConnectionLostError(f"no reply from the service within {timeout or self.timeout} s") from None
            reply = unpack_body(payload)
            if ours and reply.get("seq") not in (seq, None):
                raise ConnectionLostError(f"reply for seq {reply.get('seq')} while waiting for {seq}")
            return reply

    # -- operations ------------------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return self.call("ping")

    def heartbeat(self) -> dict[str, Any]:
        return self.call("heartbeat")

    def register_host(self, buf: HostBuffer, alloc_id: int, generation: int, layout: dict[str, Any],
                      activate: bool = True) -> RegRef:
        r = self.call("register", _fds=[buf.fd], alloc_id=alloc_id, generation=generation, kind="memfd",
                      nbytes=buf.nbytes, layout=layout)
        ref = RegRef(r["reg"], r["gen"], r["layout_digest"], "memfd", buf.nbytes)
        if activate:
            self.activate(ref)
        return ref

    def register_cuda(self, tensor: Any, alloc_id: int, generation: int, layout: dict[str, Any],
                      activate: bool = True) -> RegRef:
        nbytes = tensor.numel() * tensor.element_size()
        h = export_cuda(tensor)
        r = self.call("register", alloc_id=alloc_id, generation=generation, kind="cuda_ipc", nbytes=nbytes,
                      layout=layout, cuda=h)
        ref = RegRef(r["reg"], r["gen"], r["layout_digest"], "cuda_ipc", nbytes, device=h["device"])
        if activate:
            self.activate(ref)
        return ref

    def activate(self, ref: RegRef) -> str:
        return self.call("activate", reg=ref.reg, gen=ref.gen)["state"]

    def close(self, ref: RegRef) -> dict[str, Any]:
        return self.call("close", reg=ref.reg, gen=ref.gen)

    def save(self, ref: RegRef, key: bytes, offset: int, nbytes: int) -> int:
        """Copy bytes of our registered memory into a new immutable original `key`; returns the request id."""
        if ref.kind == "cuda_ipc":
            import torch

            torch.cuda.synchronize(ref.device)  # our writes must be complete before the service reads
        return self.call("save", reg=ref.reg, gen=ref.gen, layout_digest=ref.layout_digest, key=key,
                         offset=offset, nbytes=nbytes)["req"]

    def load(self, ref: RegRef, key: bytes, offset: int) -> int:
        """Copy original `key` into our registered memory at offset (a private copy); returns the request id.
        If the original's RAM copy was evicted, the reply comes once the service has read it back from its disk
        tier (one read shared by every load of it meanwhile; a failed read raises DiskReadError)."""
        return self.call("load", reg=ref.reg, gen=ref.gen, layout_digest=ref.layout_digest, key=key,
                         offset=offset)["req"]

    def load_many(self, ref: RegRef, items: list[tuple[bytes, int]], wait_s: float = 0.0) -> dict[str, Any]:
        """load() of each (key, offset) in order, in one request; with wait_s > 0 the reply also waits (up to
        wait_s, at most a quarter of the heartbeat interval: the connection carries our heartbeats too) until
        every accepted copy is terminal. Returns {"reqs", "stopped_at", "error", "jobs"}: the batch stops at the
        first item load() would refuse ("error": the reply's code and message; error_from_reply types it) or
        would park behind a read-back or fetch ("error" None: load it and the rest one by one)."""
        wait_s = max(0.0, min(wait_s, self.heartbeat_s / 4, 30.0))
        return self.call("load_many", reg=ref.reg, gen=ref.gen, layout_digest=ref.layout_digest,
                         items=[{"key": k, "offset": o} for k, o in items], timeout_s=wait_s,
                         _timeout=wait_s + self.timeout)

    def poll(self, req: int) -> dict[str, Any]:
        return self.call("wait", req=req, timeout_s=0.0)

    def wait(self, req: int, timeout: float = 30.0) -> dict[str, Any]:
        """Until the request's copy has physically finished (done/failed/cancelled). WaitTimeoutError if it
        is still running after `timeout` (it keeps running)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            slice_s = max(0.0, min(left, self.heartbeat_s / 4, 30.0))
            r = self.call("wait", req=req, timeout_s=slice_s, _timeout=slice_s + self.timeout)
            if r["state"] != "running":
                return r
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"request {req} still running after {timeout} s "
                                       f"({r['chunks_done']}/{r['chunks_total']} chunks)")

    def cancel(self, req: int) -> dict[str, Any]:
        return self.call("cancel", req=req)

    def _admin(self) -> dict[str, Any]:
        return {"admin": self.admin_token} if self.admin_token is not None else {}

    def evict(self, key: bytes | None = None, tier: str = "all", force: bool = False) -> dict[str, Any]:
        """Admin: drop unpinned originals (all, or `key`). tier="ram": only the RAM copies of objects the disk
        tier holds (the next load reads the file back); force=True also drops group-retained ones."""
        extra = {"tier": tier} if tier != "all" else {}
        if force:
            extra["force"] = True
        return self.call("evict", **({"key": key} if key is not None else {}), **extra, **self._admin())

    def retain(self, group: str, key: bytes) -> dict[str, Any]:
        """Admin: keep `key` in RAM across the children of `group` (ordinary eviction leaves it)."""
        return self.call("retain", group=group, key=key, **self._admin())

    def unretain(self, group: str) -> dict[str, Any]:
        return self.call("unretain", group=group, **self._admin())

    def summary(self, scope: str = "self") -> dict[str, Any]:
        """The service's bounded status reply: counts, by_state, counters (+ health and store totals for
        "all", admin only). One frame however large the registry and the store are."""
        return self.call("status", scope=scope, **(self._admin() if scope == "all" else {}))

    def list_page(self, what: str, scope: str = "self", after: int | None = None, limit: int = 1024,
                  order: str = "asc", running: bool = False, verify: bool = False) -> dict[str, Any]:
        """One page of a list: {"items": [...], "next": cursor or None}."""
        fields: dict[str, Any] = {"what": what, "scope": scope, "limit": limit, "order": order}
        if after is not None:
            fields["after"] = after
        if running:
            fields["running"] = True
        if verify:
            fields["verify"] = True
        if scope == "all" or what == "objects":
            fields.update(self._admin())
        return self.call("list", **fields)

    def pages(self, what: str, scope: str = "self", **opts: Any) -> Iterator[dict[str, Any]]:
        """The pages of a list, first to last (a caller may stop early)."""
        after = None
        while True:
            page = self.list_page(what, scope, after=after, **opts)
            yield page
            if page["next"] is None:
                return
            after = page["next"]

    def list_all(self, what: str, scope: str = "self", **opts: Any) -> list[dict[str, Any]]:
        """Every item of a list, page after page (items added or removed meanwhile may or may not show)."""
        return [item for page in self.pages(what, scope, **opts) for item in page["items"]]

    def status(self, scope: str = "self", verify: bool = False, attempts: int = 20) -> dict[str, Any]:
        """Own registrations and requests ("self"), or everything ("all": admin only), assembled from the
        summary and the paged lists: clients, registrations, released (the latest 64), requests (self) or
        requests_running (all), store.objects (all; verify=True re-hashes every original, page by page:
        the immutability check). Every reply carries the service's state version; the assembly is retried
        until all its parts saw the same version (one consistent state; `consistent` says whether that was
        reached within `attempts`)."""
        for _ in range(attempts):
            st = self.summary(scope)
            seen = {st["version"]}

            def pages(what: str, first_only: bool = False, **opts: Any) -> list[dict[str, Any]]:
                out: list[dict[str, Any]] = []
                for page in self.pages(what, scope, **opts):
                    seen.add(page["version"])
                    out += page["items"]
                    if first_only or len(seen) > 1:  # changed meanwhile: this attempt starts over
                        break
                return out

            st["clients"] = pages("clients")
            st["registrations"] = pages("registrations")
            st["released"] = pages("released", first_only=True, order="desc", limit=64)[::-1]
            if scope == "self":
                st["requests"] = pages("requests")
            else:
                st["requests_running"] = pages("requests", running=True)
                st["store"]["objects"] = pages("objects", verify=verify)
            st["consistent"] = len(seen) == 1
            if st["consistent"]:
                return st
        return st

    def shutdown(self) -> dict[str, Any]:
        """Admin: close every registration, drain, exit."""
        return self.call("shutdown", **self._admin())
