"""Start, find and stop the service process (used by `kmesh service`, stages and tests).

The runtime directory holds the socket (kmesh.sock, 0600), the pid file and the admin token (kmesh.admin,
0600; the capability for shutdown / status of all clients / evict); it defaults to $KMESH_RUNTIME_DIR, else
$XDG_RUNTIME_DIR/kmesh, else /tmp/kmesh-<uid> (created 0700).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kmesh.service import identity
from kmesh.service.client import ServiceClient
from kmesh.service.errors import ServiceError, ServiceUnavailableError
from kmesh.storage.remote import RemoteSpec
from kmesh.zygote import ForkedProcess, ZygoteError, zygote_for

SOCKET_NAME = "kmesh.sock"
PID_NAME = "kmesh.pid"
ADMIN_TOKEN_NAME = "kmesh.admin"
# What a service zygote imports before it forks services (kmesh.zygote): the server and, through it, torch (~1.2 of
# a service start's ~1.3 CPU-s on the 2-core machine; the suite and the stages start ~100 services).
ZYGOTE_PRELOAD = ("kmesh.service.server",)


def default_runtime_dir() -> Path:
    if os.environ.get("KMESH_RUNTIME_DIR"):
        return Path(os.environ["KMESH_RUNTIME_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "kmesh"
    return Path(f"/tmp/kmesh-{os.getuid()}")


def claim_runtime_dir(runtime_dir: Path, socket_mode: int) -> None:
    """The service's side at start (ServiceError otherwise): the runtime dir exists, belongs to us, is no
    wider than the socket mode needs (0711 only for a socket opened to others), and no live service answers
    on its socket (the stale socket of a dead service is removed)."""
    dir_mode = 0o700 if socket_mode & 0o077 == 0 else 0o711
    runtime_dir.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    st = runtime_dir.stat()
    if st.st_uid != os.getuid():
        raise ServiceError(f"runtime dir {runtime_dir} belongs to uid {st.st_uid}, not us ({os.getuid()})")
    os.chmod(runtime_dir, dir_mode)
    socket_path = runtime_dir / SOCKET_NAME
    if socket_path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(socket_path))
            raise ServiceError(f"a service already listens on {socket_path}")
        except (ConnectionRefusedError, FileNotFoundError):
            socket_path.unlink()  # stale socket of a dead service
        finally:
            probe.close()


class ServiceStartError(ServiceError):
    """The service process did not come up (its log tail is in the message)."""

    code = "start"


@dataclass
class ServiceProcess:
    runtime_dir: Path
    proc: subprocess.Popen | ForkedProcess | None = None
    log_path: Path | None = None
    pass_fds: tuple[int, ...] = field(default_factory=tuple)

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / SOCKET_NAME

    @property
    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        try:
            return int((self.runtime_dir / PID_NAME).read_text())
        except (OSError, ValueError):
            return None

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        pid = self.pid
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False

    @property
    def admin_token_path(self) -> Path:
        return self.runtime_dir / ADMIN_TOKEN_NAME

    def admin_token(self) -> bytes:
        """The running service's admin token (NotAuthorizedError if it cannot be read)."""
        return identity.read_admin_token(self.admin_token_path)

    def client(self, instance: int | None = None, name: str = "", heartbeat: bool = True) -> ServiceClient:
        """An ordinary client (anonymous unless instance is given): its own registrations, copies, status."""
        return ServiceClient.connect(self.socket_path, instance=instance, name=name, heartbeat=heartbeat)

    def admin_client(self, instance: int | None = None, name: str = "", heartbeat: bool = True) -> ServiceClient:
        """A client holding the admin token: it may also shut down, evict and see every client's status."""
        return ServiceClient.connect(self.socket_path, instance=instance, name=name, heartbeat=heartbeat,
                                     admin_token=self.admin_token())

    def _signal(self, sig: int) -> None:
        """Our own process through its handle (a forked service's pid is reaped by its zygote, and could be reused
        by then); one found by its pid file by that pid. One that has ended meanwhile is left alone."""
        if self.proc is not None:
            self.proc.send_signal(sig)
            return
        pid = self.pid
        if pid:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 30.0, force: bool = True) -> int | None:
        """Ask for shutdown (registrations close and drain first); SIGKILL after timeout if force."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        try:
            with self.admin_client(name="kmesh-stop", heartbeat=False) as c:  # anonymous: never refused
                c.shutdown()
        except ServiceError:  # unreachable, or no readable admin token: the signal is our uid's other way
            self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive() and force:
            self._signal(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.proc is not None:
            return self.proc.wait(timeout=5)
        return None


def start(runtime_dir: Path | None = None, *, device: str = "cpu", heartbeat_timeout_s: float = 10.0,
          chunk_bytes: int = 1 << 20, gate_fd: int | None = None, store_bytes: int = 1 << 30,
          socket_mode: int = 0o600, allow_uids: list[int] | None = None, log_path: Path | None = None,
          detach: bool = False, ready_timeout: float = 60.0, log_level: str = "INFO",
          faults: list[str] | None = None, max_objects: int | None = None, max_jobs: int | None = None,
          max_regs: int | None = None, max_regs_per_client: int | None = None,
          max_tombstones: int | None = None, disk_dir: Path | None = None, adopt: bool = True,
          disk_read_gate_fd: int | None = None, max_disk_reads: int | None = None,
          eviction: str | None = None, high_watermark: float | None = None,
          low_watermark: float | None = None, remote: RemoteSpec | None = None,
          zygote: bool | None = None) -> ServiceProcess:
    """Spawn `python -m kmesh.service.server` and wait until it answers ping. zygote: fork it instead from this
    process's service zygote (kmesh.zygote: the server's imports done once; None: unless KMESH_SERVICE_ZYGOTE=0;
    never for a detached service, which must outlive its caller's zygote). The max_* limits (None: the
    server's defaults) bound the store, the job history and the registry (tests use small ones). adopt=False:
    start with an empty store although disk_dir holds a previous run's object files. disk_read_gate_fd: a
    ChunkGate read end that holds every disk read-back until the controller grants it (tests). eviction /
    high_watermark / low_watermark: how a full RAM tier makes room (kmesh.service.store; None: the defaults).
    remote: the remote tier's store (kmesh.storage.remote.RemoteSpec; kmesh.service.remotetier)."""
    rd = Path(runtime_dir or default_runtime_dir())
    cmd = [sys.executable, "-m", "kmesh.service.server", "--runtime-dir", str(rd), "--device", device,
           "--heartbeat-timeout", str(heartbeat_timeout_s), "--chunk-bytes", str(chunk_bytes),
           "--store-bytes", str(store_bytes), "--socket-mode", f"{socket_mode:o}", "--log-level", log_level]
    limits = {"--max-objects": max_objects, "--max-jobs": max_jobs, "--max-regs": max_regs,
              "--max-regs-per-client": max_regs_per_client, "--max-tombstones": max_tombstones,
              "--max-disk-reads": max_disk_reads}
    for flag, v in limits.items():
        if v is not None:
            cmd += [flag, str(int(v))]
    for flag, value in {"--eviction": eviction, "--high-watermark": high_watermark,
                        "--low-watermark": low_watermark}.items():
        if value is not None:
            cmd += [flag, str(value)]
    if disk_dir is not None:
        cmd += ["--disk-dir", str(disk_dir)] + ([] if adopt else ["--no-adopt"])
    if remote is not None:
        cmd += ["--remote-master", remote.master, "--remote-metadata", remote.metadata,
                "--remote-hostname", remote.hostname, "--remote-segment-bytes", str(remote.segment_bytes),
                "--remote-call-timeout", str(remote.call_timeout_s)]
        if log_path is not None:   # the agent's log beside the service's (a runtime dir is removed at its end)
            cmd += ["--remote-agent-log", str(Path(log_path).with_name("remote-agent.log"))]
    for uid in allow_uids or ():
        cmd += ["--allow-uid", str(uid)]
    for f in faults or ():
        cmd += ["--fault", f]
    pass_fds: tuple[int, ...] = ()
    if gate_fd is not None:
        cmd += ["--gate-fd", str(gate_fd)]
        pass_fds = (gate_fd,)
    if disk_read_gate_fd is not None:
        cmd += ["--disk-read-gate-fd", str(disk_read_gate_fd)]
        pass_fds += (disk_read_gate_fd,)
    rd.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = log_path or rd / "service.log"
    logf = open(log_path, "ab")
    try:
        proc = _spawn(cmd, logf, pass_fds, detach, zygote)
    finally:
        logf.close()
    sp = ServiceProcess(rd, proc, log_path, pass_fds)
    deadline = time.monotonic() + ready_timeout
    while True:
        if proc.poll() is not None:
            raise ServiceStartError(f"service exited with {proc.returncode} during start:\n{_tail(log_path)}")
        try:
            with ServiceClient.open(sp.socket_path, timeout=5) as c:
                if c.ping()["server_pid"] == proc.pid:
                    return sp
        except (ServiceUnavailableError, OSError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise ServiceStartError(f"service did not answer within {ready_timeout} s:\n{_tail(log_path)}")
        time.sleep(0.02)


def _spawn(cmd: list[str], logf, pass_fds: tuple[int, ...], detach: bool,
           zygote: bool | None) -> subprocess.Popen | ForkedProcess:
    if zygote is None:
        zygote = os.environ.get("KMESH_SERVICE_ZYGOTE", "1") != "0"
    if zygote and not detach:
        env = dict(os.environ)
        try:
            with open(os.devnull, "rb") as devnull:
                return zygote_for(env, ZYGOTE_PRELOAD).spawn("kmesh.service.server:main", env, argv=cmd[3:],
                                                             stdin=devnull.fileno(), stdout=logf.fileno(),
                                                             stderr=logf.fileno(), pass_fds=pass_fds)
        except ZygoteError as e:   # started the ordinary way instead, and said so where its log says the rest
            logf.write(f"[kmesh] service not forked from a zygote: {e}\n".encode())
            logf.flush()
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, pass_fds=pass_fds,
                            start_new_session=detach)


def find(runtime_dir: Path | None = None) -> ServiceProcess:
    """The service of a runtime dir, started elsewhere (by its pid file)."""
    return ServiceProcess(Path(runtime_dir or default_runtime_dir()))


def _tail(p: Path | None, n: int = 20) -> str:
    try:
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p else ""
    except OSError:
        return ""
