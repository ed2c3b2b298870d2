"""The drain stage's handle on its copier: a kmesh.stages.drain.client subprocess, started as
`python -m kmesh.stages.drain.client`, with a control socket (JSON lines, descriptors by SCM_RIGHTS) and a pidfd;
each case gets a fresh ChunkGate whose read end travels to the copier with `setup`."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from kmesh.errors import StageError
from kmesh.transfer import ChunkGate
from kmesh.transfer.ledger import exited

CLIENT_MODULE = "kmesh.stages.drain.client"


class CopierProcess:
    """A copier subprocess with a control socket and a pidfd; each case gets a fresh ChunkGate."""

    def __init__(self, device: str, log: Path) -> None:
        mine, theirs = socket.socketpair()
        self._log = open(log, "ab")
        cmd = [sys.executable, "-m", CLIENT_MODULE, "--ctl", str(theirs.fileno()), "--device", device]
        self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdout=self._log, stderr=subprocess.STDOUT)
        self.pidfd = os.pidfd_open(self.proc.pid)  # opened while the child surely exists: no pid reuse race
        theirs.close()
        self.sock = mine
        self._f = mine.makefile("rwb", buffering=0)
        self.gate: ChunkGate | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, op: str, fds: tuple[int, ...] = (), **kw: Any) -> dict[str, Any]:
        msg = {"op": op, **kw, **({"nfds": len(fds)} if fds else {})}
        self._f.write((json.dumps(msg) + "\n").encode())
        if fds:
            socket.send_fds(self.sock, [b"F"], list(fds))
        line = self._f.readline()
        if not line:
            raise StageError(f"copier process {self.pid} closed its control socket during {op!r} "
                             f"(exit {self.proc.poll()})")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise StageError(f"copier {op!r} failed: {reply['exc']}: {reply['message']}")
        return reply

    def setup(self, **kw: Any) -> dict[str, Any]:
        """Start a case in the copier with a fresh gate (its read end travels by SCM_RIGHTS)."""
        self.gate = ChunkGate()
        try:
            return self.call("setup", fds=(self.gate.read_fd,), **kw)
        finally:
            os.close(self.gate.read_fd)  # only the copier reads tokens
            self.gate.read_fd = None  # type: ignore[assignment]

    def end_case(self) -> dict[str, Any]:
        try:
            return self.call("end_case")
        finally:
            self.close_gate()

    def close_gate(self) -> None:
        if self.gate is not None:
            self.gate.open()
            self.gate = None

    def finish(self, timeout: float) -> int:
        """Ask it to exit (if alive), wait, and release every fd this side holds."""
        try:
            if self.proc.poll() is None and not exited(self.pidfd):
                with contextlib.suppress(OSError, StageError):
                    self.call("exit")
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.close_gate()
            self._f.close()
            self.sock.close()
            os.close(self.pidfd)
            self._log.close()
        return rc


