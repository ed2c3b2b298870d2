"""The store client in a process of its own: the cache service talks to Mooncake Store only through this agent.

Why a process: the Mooncake client holds the GIL through some calls (measured, 0.3.13.post1: `setup` against a
master that is down holds it 4.3 s, a 16 MiB `get` for the whole 17 ms), so inside the service it would stall the
loop that answers every client; and a crash in it must not take the service with it. The agent serves one request
at a time over its stdin/stdout: frames of a 4-byte little-endian length + msgpack.

    agent = Agent.start(spec)                    # python -m kmesh.storage.remote_agent '<spec json>'
    agent.publish(key, image); agent.fetch(key)  # the MooncakeClient calls, errors re-raised by type
    agent.close()

A reply that does not come within `timeout_s` (the spec's call_timeout_s), or an agent that died, costs that call
RemoteStoreError; the agent is killed and a new one started at once (`starts` counts them). Its stderr (the
client's glog lines) goes to a log file.
"""
from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgpack

from kmesh.storage.remote import (MooncakeClient, RemoteMissingError, RemoteSpec, RemoteStoreError,
                                  RemoteUnavailableError)

_LEN = struct.Struct("<I")
ERRORS = {c.__name__: c for c in (RemoteMissingError, RemoteStoreError, RemoteUnavailableError)}
MAX_FRAME = 1 << 31


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no reply within the call's timeout ({len(out)} of {n} bytes came)")
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError("the other end closed")
        out += chunk
    return bytes(out)


def _write_frame(fd: int, body: dict[str, Any]) -> None:
    data = msgpack.packb(body, use_bin_type=True)
    view = memoryview(_LEN.pack(len(data)) + data)
    while view.nbytes:
        view = view[os.write(fd, view):]


def _read_frame(fd: int, deadline: float | None = None) -> dict[str, Any]:
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    if n > MAX_FRAME:
        raise RemoteStoreError(f"a frame of {n} bytes")
    return msgpack.unpackb(_read_exact(fd, n, deadline), raw=False)


# -- the agent process ------------------------------------------------------------------------------------------
def serve(spec: RemoteSpec, fd_in: int = 0, fd_out: int = 1) -> int:
    client: MooncakeClient | None = None
    while True:
        try:
            req = _read_frame(fd_in)
        except EOFError:
            break
        op = req.get("op")
        try:
            if op == "ping":
                result: Any = {"pid": os.getpid(), "connected": client is not None}
            else:
                if client is None:
                    client = MooncakeClient(spec)
                if op == "publish":
                    client.publish(req["key"], req["image"])
                    result = None
                elif op == "fetch":
                    result = client.fetch(req["key"])
                elif op == "exists":
                    result = client.exists(req["key"])
                elif op == "remove":
                    client.remove(req["key"])
                    result = None
                elif op == "overwrite":
                    client.overwrite(req["key"], req["image"])
                    result = None
                else:
                    raise RemoteStoreError(f"unknown op {op!r}")
            reply = {"ok": True, "result": result}
        except Exception as e:   # every failure is this request's answer, never the agent's end
            if isinstance(e, RemoteStoreError) and client is not None:
                client.close()     # connect anew for the next request
                client = None
            reply = {"ok": False, "type": type(e).__name__, "message": str(e)[:2000]}
        _write_frame(fd_out, reply)
    if client is not None:
        client.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = RemoteSpec(**json.loads(args[0]))
    # stdout carries frames only: anything a library prints goes to stderr (the agent's log) instead
    out = os.dup(1)
    os.dup2(2, 1)
    return serve(spec, 0, out)


# -- the service's side -----------------------------------------------------------------------------------------
class Agent:
    """A running agent and the calls to it (one caller thread at a time)."""

    def __init__(self, spec: RemoteSpec, log_path: Path | None = None, timeout_s: float | None = None) -> None:
        self.spec, self.log_path = spec, log_path
        self.timeout_s = spec.call_timeout_s if timeout_s is None else timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @classmethod
    def start(cls, spec: RemoteSpec, log_path: Path | None = None, timeout_s: float | None = None) -> Agent:
        a = cls(spec, log_path, timeout_s)
        a._spawn()
        return a

    def _spawn(self) -> None:
        log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        try:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            env.setdefault("GLOG_minloglevel", "1")   # the client's INFO lines are many; warnings and errors stay
            self.proc = subprocess.Popen([sys.executable, "-m", "kmesh.storage.remote_agent",
                                          json.dumps(asdict(self.spec))], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, close_fds=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self.starts += 1

    def call(self, op: str, **args: Any) -> Any:
        if self.proc is None or self.proc.poll() is not None:
            self._spawn()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            _write_frame(self.proc.stdin.fileno(), {"op": op, **args})
            reply = _read_frame(self.proc.stdout.fileno(), time.monotonic() + self.timeout_s)
        except (OSError, EOFError, TimeoutError) as e:
            rc = self.proc.poll()
            self.kill()
            self._spawn()   # a fresh agent for the next call (it connects then): the tier always has one
            raise RemoteStoreError(f"the store agent {'exited with ' + str(rc) if rc is not None else 'hung'} "
                                   f"during {op}: {type(e).__name__}: {e}") from e
        if reply["ok"]:
            return reply["result"]
        raise ERRORS.get(reply["type"], RemoteStoreError)(f"{reply['message']}")

    def restart(self) -> None:
        """A new agent in place of this one (its client connects on the next call)."""
        self.kill()
        self._spawn()

    def exists(self, key: bytes) -> bool:
        return bool(self.call("exists", key=bytes(key)))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # the MooncakeClient interface
    def publish(self, key: bytes, image: Any) -> None:
        self.call("publish", key=bytes(key), image=bytes(image))

    def fetch(self, key: bytes) -> bytes:
        return self.call("fetch", key=bytes(key))

    def remove(self, key: bytes) -> None:
        self.call("remove", key=bytes(key))

    def overwrite(self, key: bytes, image: Any) -> None:
        self.call("overwrite", key=bytes(key), image=bytes(image))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._close_pipes()

    def close(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()   # EOF: the agent closes its client and exits
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.proc is not None:
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None and not f.closed:
                    f.close()


if __name__ == "__main__":
    sys.exit(main())
