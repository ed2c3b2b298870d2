"""A scriptable service client in its own process, and the remote control that drives it.

The ownership stage and the tests need real client processes they can steer step by step (register, start a
copy, go silent, be SIGKILLed, have its instance number claimed or taken over). A Worker is such
a process (`python -m kmesh.harness.worker`); it speaks length-prefixed msgpack on stdin/stdout with its
controller and uses the ordinary ServiceClient toward the service.

    w = Worker.spawn(socket_path)
    w.call("connect", instance=3)
    w.call("alloc", name="kv", nbytes=n, seed=7)           # memfd (or device="cuda") filled from seed 7
    ref = w.call("register", name="kv", alloc_id=1, generation=1, layout=layout)
    req = w.call("load", reg=ref["reg"], key=b"obj", offset=0)
    w.kill()                                               # SIGKILL, like a crashed serving worker

Contents are deterministic (`pattern(seed, n)`), so a controller can check what a buffer must hold without
trusting the worker's own bookkeeping.
"""
from __future__ import annotations

import hashlib
import os
import signal
import struct
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import msgpack

from kmesh.errors import KMeshError
from kmesh.service.errors import ServiceError, error_from_reply

_LEN = struct.Struct(">I")


def pattern(seed: int, n: int) -> bytes:
    """Deterministic bytes for seed (independent of any KMesh code path)."""
    return hashlib.shake_128(b"kmesh-pattern-%d" % seed).digest(n)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class WorkerError(KMeshError):
    """The worker process failed outside the service protocol (or died)."""


def _send(f: Any, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _recv(f: Any) -> Any:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    (n,) = _LEN.unpack(head)
    return msgpack.unpackb(f.read(n), raw=False)


# -- the process side -------------------------------------------------------------------------------------
class _Session:
    def __init__(self, socket_path: str) -> None:
        from kmesh.service.client import RegRef, ServiceClient

        self.socket_path = socket_path
        self.client: ServiceClient | None = None
        self.buffers: dict[str, Any] = {}
        self.refs: dict[int, RegRef] = {}
        self._RegRef = RegRef
        self._Client = ServiceClient

    def _c(self) -> Any:
        if self.client is None:
            raise WorkerError("not connected")
        return self.client

    def _ref(self, a: dict[str, Any]) -> Any:
        """Our own registration by id, or (to try a foreign/stale one) a ref built from explicit fields."""
        if "as_ref" in a:
            r = a["as_ref"]
            return self._RegRef(r["reg"], r["gen"], r["layout_digest"], "memfd", 0)
        return self.refs[a["reg"]]

    def do(self, cmd: str, a: dict[str, Any]) -> Any:
        if cmd == "connect":
            self.client = self._Client.connect(self.socket_path, instance=a.get("instance"),
                                               name=a.get("name", ""), heartbeat=a.get("heartbeat", True),
                                               admin_token=a.get("admin"), takeover=a.get("takeover", False))
            return {"client": self.client.client_id, "pid": os.getpid(), "token": self.client.token}
        if cmd == "alloc":
            return self._alloc(a)
        if cmd == "fill":
            self._write(a["name"], a.get("offset", 0), pattern(a["seed"], a["n"]))
            return None
        if cmd == "free":
            buf = self.buffers.pop(a["name"])
            if hasattr(buf, "close"):
                buf.close()
            return None
        if cmd == "digest":
            return sha(self._read(a["name"], a.get("offset", 0), a.get("n")))
        if cmd == "read":
            return self._read(a["name"], a.get("offset", 0), a.get("n"))
        if cmd == "register":
            buf = self.buffers[a["name"]]
            c = self._c()
            if isinstance(buf, _CudaBuf):
                ref = c.register_cuda(buf.t, a["alloc_id"], a["generation"], a["layout"], a.get("activate", True))
            else:
                ref = c.register_host(buf, a["alloc_id"], a["generation"], a["layout"], a.get("activate", True))
            self.refs[ref.reg] = ref
            return {"reg": ref.reg, "gen": ref.gen, "layout_digest": ref.layout_digest}
        if cmd == "activate":
            return self._c().activate(self._ref(a))
        if cmd == "close":
            return self._c().close(self._ref(a))
        if cmd == "save":
            return self._c().save(self._ref(a), a["key"], a["offset"], a["nbytes"])
        if cmd == "load":
            return self._c().load(self._ref(a), a["key"], a["offset"])
        if cmd == "wait":
            return self._c().wait(a["req"], a.get("timeout", 30.0))
        if cmd == "poll":
            return self._c().poll(a["req"])
        if cmd == "cancel":
            return self._c().cancel(a["req"])
        if cmd == "evict":
            return self._c().evict(a.get("key"))
        if cmd == "status":
            return self._c().status(a.get("scope", "self"))
        if cmd == "pause_heartbeats":
            self._c().pause_heartbeats()
            return None
        if cmd == "resume_heartbeats":
            self._c().resume_heartbeats()
            return None
        if cmd == "call":  # any op, with an optional token override (foreign-token cases)
            c = self._c()
            fields = dict(a.get("fields", {}))
            if "token" in a:
                fields["token"] = a["token"]
            return c.call(a["op"], **fields)
        if cmd == "fork_holder":  # a child that keeps our service socket open after we die (it only sleeps)
            import warnings

            with warnings.catch_warnings():  # the child only sleeps: the multi-threaded-fork caveat does not apply
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                while True:
                    signal.pause()
            return pid
        if cmd == "disconnect":
            self._c().close_connection()
            self.client = None
            return None
        raise WorkerError(f"unknown worker command {cmd!r}")

    def _alloc(self, a: dict[str, Any]) -> dict[str, Any]:
        n, name = a["nbytes"], a["name"]
        if name in self.buffers:
            raise WorkerError(f"buffer {name!r} exists")
        if a.get("device", "cpu") == "cuda":
            buf: Any = _CudaBuf(n)
        else:
            from kmesh.service.handles import HostBuffer

            buf = HostBuffer(n, name=f"kmesh-{name}", address=a.get("address"))
        self.buffers[name] = buf
        if a.get("seed") is not None:
            self._write(name, 0, pattern(a["seed"], n))
        return {"address": buf.address, "nbytes": n}

    def _write(self, name: str, offset: int, data: bytes) -> None:
        self.buffers[name].write(offset, data)

    def _read(self, name: str, offset: int, n: int | None) -> bytes:
        return self.buffers[name].read(offset, n)


class _CudaBuf:
    """A CUDA tensor owned by torch's caching allocator, like a serving engine's KV cache."""

    def __init__(self, n: int) -> None:
        import torch

        self.t = torch.empty(n, dtype=torch.uint8, device="cuda")
        self.address = self.t.data_ptr()
        self.nbytes = n

    def write(self, offset: int, data: bytes) -> None:
        import torch

        self.t[offset:offset + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        torch.cuda.synchronize()

    def read(self, offset: int = 0, n: int | None = None) -> bytes:
        import torch

        torch.cuda.synchronize()
        end = self.nbytes if n is None else offset + n
        return self.t[offset:end].cpu().numpy().tobytes()

    def close(self) -> None:
        del self.t


def main() -> int:
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] != "--cuda"):
        print("usage: python -m kmesh.harness.worker SOCKET_PATH [--cuda]", file=sys.stderr)
        return 2
    if "--cuda" in sys.argv:
        # Import torch and create the CUDA context BEFORE connecting: both hold the GIL for seconds, and a
        # client whose heartbeat thread cannot run looks dead to the service.
        import torch

        torch.empty(1, device="cuda")
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the reply pipe
    s = _Session(sys.argv[1])
    while True:
        try:
            msg = _recv(inp)
        except EOFError:
            return 0
        cmd, args = msg["cmd"], msg.get("args", {})
        if cmd == "exit":
            _send(out, {"ok": True, "result": None})
            return 0
        try:
            _send(out, {"ok": True, "result": s.do(cmd, args)})
        except ServiceError as e:
            _send(out, {"ok": False, "error": {"code": e.code, "type": type(e).__name__, "message": str(e)}})
        except Exception as e:
            _send(out, {"ok": False, "error": {"code": None, "type": type(e).__name__,
                                               "message": f"{e}\n{traceback.format_exc()[-1500:]}"}})


# -- the controller side ------------------------------------------------------------------------------
class Worker:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.info: dict[str, Any] = {}  # what "connect" answered (client id, pid, token)
        self._pending = ""              # the command `send` started

    @classmethod
    def spawn(cls, socket_path: str | Path, cuda: bool = False, log: Any = None,
              env: dict[str, str] | None = None) -> "Worker":
        argv = [sys.executable, "-m", "kmesh.harness.worker", str(socket_path)] + (["--cuda"] if cuda else [])
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log or subprocess.DEVNULL, env=env)
        return cls(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, cmd: str, **args: Any) -> Any:
        """Run one command in the worker; a service error re-raises as its typed ServiceError."""
        self.send(cmd, **args)
        return self.result()

    def send(self, cmd: str, **args: Any) -> None:
        """Start one command without waiting for it (several workers then act at once); `result()` collects it."""
        if self.proc.poll() is not None:
            raise WorkerError(f"worker {self.pid} has exited ({self.proc.returncode})")
        try:
            _send(self.proc.stdin, {"cmd": cmd, "args": args})
        except BrokenPipeError:
            raise WorkerError(f"worker {self.pid} died before {cmd!r}") from None
        self._pending = cmd

    def result(self) -> Any:
        """The reply to the command `send` started (typed ServiceError re-raised)."""
        cmd = self._pending
        try:
            reply = _recv(self.proc.stdout)
        except EOFError:
            raise WorkerError(f"worker {self.pid} died during {cmd!r}") from None
        if reply["ok"]:
            return reply["result"]
        err = reply["error"]
        if err["code"] is not None:
            raise error_from_reply(err["code"], err["message"])
        raise WorkerError(f"{cmd}: {err['type']}: {err['message']}")

    def kill(self) -> None:
        """SIGKILL (no goodbye to the service, no cleanup), then reap."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._close_pipes()

    def exit(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            try:
                self.call("exit")
            except WorkerError:
                pass
        rc = self.proc.wait(timeout=timeout)
        self._close_pipes()
        return rc

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


if __name__ == "__main__":
    raise SystemExit(main())
