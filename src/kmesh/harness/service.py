"""A service process under a controller's thumb: the ownership stage and the service tests run on this.

It starts a real service process whose copies are paced by a kmesh.transfer ChunkGate (every copy chunk
needs a token from the controller), so "a copy is in flight" is a fact the controller creates, not a race it
hopes to win. It spawns worker processes (kmesh.harness.worker), watches the service through an admin
connection, and checks for leaks from the outside: registrations, mappings, fds, CUDA handles, pins.

Token accounting: each accepted copy consumes exactly ceil(nbytes / chunk_bytes) tokens, so the controller
knows how many are owed (`owed`) and can let chosen copies go part-way (`grant`) or all the way (`finish`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from kmesh.errors import KMeshError
from kmesh.harness.worker import Worker
from kmesh.service import process
from kmesh.transfer.faults import ChunkGate


class HarnessError(KMeshError):
    """The controlled service did not reach an expected state in time."""


class Harness:
    def __init__(self, *, device: str = "cpu", heartbeat_timeout_s: float = 0.5, chunk_bytes: int = 16384,
                 log_dir: Path | None = None, store_bytes: int = 1 << 30, socket_mode: int = 0o600,
                 allow_uids: list[int] | None = None, faults: list[str] | None = None,
                 limits: dict[str, int] | None = None, disk_dir: Path | None = None, adopt: bool = True,
                 disk_read_gate: bool = False, remote: Any = None) -> None:
        self.device, self.chunk_bytes, self.heartbeat_timeout_s = device, chunk_bytes, heartbeat_timeout_s
        self.service_disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="kmesh-svc-"))  # short: socket paths max 107 bytes
        self.log_dir = log_dir or self.runtime_dir
        self.gate = ChunkGate()
        # disk_read_gate: every read-back of an evicted original waits for a token (`allow_disk_reads`), so a
        # test can hold a read open while it checks what else the service answers
        self.disk_gate = ChunkGate() if disk_read_gate else None
        self.service = process.start(self.runtime_dir / "rt", device=device, heartbeat_timeout_s=heartbeat_timeout_s,
                                     chunk_bytes=chunk_bytes, gate_fd=self.gate.read_fd, store_bytes=store_bytes,
                                     socket_mode=socket_mode, allow_uids=allow_uids,
                                     log_path=self.log_dir / "service.log", faults=faults, disk_dir=disk_dir,
                                     adopt=adopt, disk_read_gate_fd=self.disk_gate.read_fd if self.disk_gate else None,
                                     remote=remote, **(limits or {}))
        for g in (self.gate, self.disk_gate):
            if g is not None:
                os.close(g.read_fd)  # the service holds the read end; ours would only keep EOF away
                g.read_fd = None  # type: ignore[assignment]
        if device.startswith("cuda"):
            import torch

            torch.cuda.mem_get_info()  # our own CUDA context now, not mid-run (it holds the GIL for a while)
        self.owed = 0      # tokens all accepted copies will consume
        self.granted = 0   # tokens written
        # the controller is the service's administrator: it holds the admin token (workers do not)
        self.admin = self.service.admin_client(name="harness-admin")  # anonymous: collides with no worker
        self.workers: list[Worker] = []
        self._worker_log = open(self.log_dir / "workers.log", "ab")

    @property
    def socket_path(self) -> Path:
        return self.service.socket_path

    # -- workers ------------------------------------------------------------------------------------
    def spawn(self, cuda: bool = False) -> Worker:
        """A client process that has not connected yet (its "connect" may be refused); killed at close()."""
        w = Worker.spawn(self.socket_path, cuda=cuda, log=self._worker_log)
        self.workers.append(w)
        return w

    def worker(self, instance: int | None = None, heartbeat: bool = True, name: str = "", cuda: bool = False,
               takeover: bool = False) -> Worker:
        """A client process, connected as `instance` (None: anonymous; cuda: CUDA initialised before it
        connects). takeover: claim a live client's instance with the admin token (handed to this worker)."""
        w = self.spawn(cuda)
        extra = {"takeover": True, "admin": self.service.admin_token()} if takeover else {}
        w.info = w.call("connect", instance=instance, heartbeat=heartbeat, name=name, **extra)
        return w

    def worker_with_original(self, instance: int | None, key: bytes, layout: dict[str, Any], nbytes: int, seed: int,
                             name: str = "") -> tuple[Worker, dict[str, Any]]:
        """A client process that registered memfd memory and saved it as the shared original `key` (copy
        drained). Returns the worker and its registration ref."""
        w = self.worker(instance=instance, name=name)
        w.call("alloc", name="kv", nbytes=nbytes, seed=seed)
        ref = w.call("register", name="kv", alloc_id=1, generation=1, layout=layout)
        req = w.call("save", reg=ref["reg"], key=key, offset=0, nbytes=nbytes)
        self.accepted(nbytes)
        self.finish()
        state = w.call("wait", req=req)["state"]
        if state != "done":
            raise HarnessError(f"saving original {key!r} ended {state!r}, not 'done'")
        return w, ref

    # -- the gate -------------------------------------------------------------------------------------
    def chunks(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.chunk_bytes))

    def accepted(self, nbytes: int) -> None:
        """Record that a copy of nbytes was accepted (it will take chunks(nbytes) tokens)."""
        self.owed += self.chunks(nbytes)

    def grant(self, n: int) -> None:
        """Let n more chunks through (FIFO over all accepted copies)."""
        n = min(n, self.owed - self.granted)
        if n > 0:
            self.gate.allow(n)
            self.granted += n

    def finish(self) -> None:
        """Let every accepted copy run to its end."""
        self.grant(self.owed - self.granted)

    def allow_disk_reads(self, n: int = 1) -> None:
        """Let n more disk read-backs run (disk_read_gate=True)."""
        if self.disk_gate is None:
            raise HarnessError("this harness has no disk read gate (disk_read_gate=True)")
        self.disk_gate.allow(n)

    # -- observation ------------------------------------------------------------------------------------
    def status(self, verify: bool = False) -> dict[str, Any]:
        return self.admin.status("all", verify=verify)

    def reg(self, reg_id: int, st: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The registration as the service lists it, or its released record (state "released")."""
        st = st or self.status()
        for r in st["registrations"]:
            if r["reg"] == reg_id:
                return r
        for r in st["released"]:
            if r["reg"] == reg_id:
                return r
        return None

    def request(self, req_id: int, st: dict[str, Any] | None = None) -> dict[str, Any] | None:
        st = st or self.status()
        return next((j for j in st["requests_running"] if j["req"] == req_id), None)

    def wait_until(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise HarnessError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.01)

    def wait_chunks(self, req_id: int, n: int, timeout: float = 10.0) -> dict[str, Any]:
        """Until request req_id has copied at least n chunks (it is then provably mid-copy if n < total)."""
        st = self.wait_until(f"request {req_id} to copy {n} chunks",
                             lambda s: (self.request(req_id, s) or {}).get("chunks_done", 0) >= n, timeout)
        return self.request(req_id, st)  # type: ignore[return-value]

    def wait_released(self, reg_id: int, timeout: float = 10.0) -> dict[str, Any]:
        return self.wait_until(f"registration {reg_id} released",
                               lambda s: (self.reg(reg_id, s) or {}).get("state") == "released", timeout)

    def leaks(self, st: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the service still holds beyond its own connections; all zero when nothing leaked."""
        st = st or self.status()
        return {"registrations": len(st["registrations"]), "memfd_mappings": st["memfd_mappings"],
                "cuda_handles_open": st["cuda_handles_open"], "engine_holds": st["engine_holds"],
                "reservations": st["reservations"], "copies_running": st["copies_running"],
                "store_pins": st["store"]["pins"], "stale_uses": st["stats"]["stale_uses"],
                "disk_reads_in_flight": (st.get("disk_reads") or {}).get("in_flight", 0),
                "extra_fds": st["open_fds"] - st["fd_baseline"] - 2 * st["connections_open"],
                "violations": st["violations_count"]}

    def no_leaks(self, st: dict[str, Any] | None = None) -> bool:
        return all(v == 0 for v in self.leaks(st).values())

    # -- teardown -------------------------------------------------------------------------------------
    def close(self) -> dict[str, Any]:
        """Kill leftover workers, let every copy finish, stop the service; returns its exit code and log tail."""
        for w in self.workers:
            if w.proc.poll() is None:
                w.kill()
        self.gate.open()  # EOF: every remaining chunk passes
        if self.disk_gate is not None:
            self.disk_gate.open()
        try:
            self.admin.close_connection()
        except OSError:
            pass
        rc = self.service.stop(timeout=30)
        self._worker_log.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return {"service_exit": rc}

    def __enter__(self) -> "Harness":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
