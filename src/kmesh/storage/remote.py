"""The remote tier: object images on Mooncake Store (FAST'25), shared by every host whose service points at it.

    master = MooncakeMaster.start(workdir)          # the store's own master + HTTP metadata service, on loopback
    client = MooncakeClient(master.spec())          # or RemoteSpec(master="10.0.0.5:50051", metadata="http://...")
    client.publish(key, objfile.encode_image(...))  # the object file's bytes, header and digest as on disk
    image = client.fetch(key)                       # RemoteMissingError / RemoteStoreError; verify before use

Objects live in the memory segments that store clients contribute (`segment_bytes`; every service mounts one,
the way each engine does under LMCache), found through the master. Keys are `kmesh/<hex key>`. What comes back is
raw bytes: the caller checks them with objfile.decode_image (header, key, digest by name) before using any.
The client library is imported lazily: a machine without it (or without libibverbs, which it loads even for TCP)
gets RemoteUnavailableError with the reason, never an ImportError at start-up.

Measured behaviour of mooncake-transfer-engine-non-cuda 0.3.13.post1 this module relies on (loopback, TCP):
a call while the master is down fails at once with -900 (RPC_FAIL); after a master restart the same client
works again, and the restarted master has forgotten every object (its metadata is in memory); `get` answers b""
both for a missing key and a failed call, so presence is asked first (`is_exist`: 1, 0 or a negative code).
"""
from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kmesh.storage.errors import ObjectNotFoundError, StorageError

KEY_PREFIX = "kmesh/"


class RemoteUnavailableError(StorageError):
    """The remote tier cannot be used here: its client library (or a system library it loads) is missing, or
    its master does not answer."""


class RemoteStoreError(StorageError):
    """A call to the store failed (the code is Mooncake's)."""


class RemoteMissingError(ObjectNotFoundError):
    """The store holds no object under this key (never published, evicted, or forgotten by a restarted master)."""


@dataclass(frozen=True)
class RemoteSpec:
    """Where the store is and what this client contributes; addresses, so the same code runs on many hosts."""

    master: str                       # host:port of mooncake_master's RPC service
    metadata: str                     # the transfer engine's metadata service, e.g. http://host:port/metadata
    hostname: str = "127.0.0.1"       # this client's address as other hosts reach it
    segment_bytes: int = 64 << 20     # memory this client contributes to the store (0: none)
    buffer_bytes: int = 16 << 20      # its local transfer buffer
    protocol: str = "tcp"
    # the longest a service waits for one store call (kmesh.storage.remote_agent): below its clients' own waits,
    # so a hung store costs a load a clear error, never a client's reply
    call_timeout_s: float = 10.0

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def remote_key(key: bytes) -> str:
    return KEY_PREFIX + bytes(key).hex()


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why the Mooncake client cannot load here (None: it can)."""
    # the client logs through glog: INFO lines by the dozen per connect, unless asked for (GLOG_minloglevel=0)
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:   # the package, or libibverbs.so.1 / librdmacm.so.1 it links
        return f"mooncake store client unavailable: {e} (pip: mooncake-transfer-engine-non-cuda; " \
               f"Debian: libibverbs1 librdmacm1)"
    return None


SETUP_ATTEMPTS = 3   # a client's setups, each on a fresh port, while the master answers (MooncakeClient)


def master_answers(master: str, timeout_s: float = 1.0) -> bool:
    """Whether the master's RPC port (host:port) accepts a TCP connection."""
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeClient:
    """One store client. Not thread-safe: one thread makes its calls (kmesh.service.remotetier's)."""

    def __init__(self, spec: RemoteSpec, port: int | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RemoteUnavailableError(reason)
        from mooncake.store import MooncakeDistributedStore

        self.spec = spec
        # The client's name is host:port, and a name another client has registered is refused (code -600,
        # "Failed to register segment descriptor"). The port is only a name (nothing listens on it), so free_port
        # can hand out one that a live client already goes by: it happened once in make test (CI, 60cd9e5). A setup
        # that fails while the master's RPC port accepts is tried again under a fresh port; one against a master
        # that does not answer is the store being down: RemoteUnavailableError at once. (Given no port, the client
        # picks and retries itself, 20 times, each as slow as a setup against a master that is down: far over a
        # call's timeout.)
        rcs: list[int] = []
        for _ in range(SETUP_ATTEMPTS):
            self._store = MooncakeDistributedStore()
            local = f"{spec.hostname}:{port or free_port(spec.hostname)}"
            rc = self._store.setup(local, spec.metadata, spec.segment_bytes, spec.buffer_bytes, spec.protocol, "",
                                   spec.master)
            if rc == 0:
                break
            rcs.append(rc)
            if port is not None or not master_answers(spec.master):
                break
        if rc != 0:
            raise RemoteUnavailableError(f"Mooncake store setup against master {spec.master} failed "
                                         f"(code{'s' if len(rcs) > 1 else ''} {', '.join(map(str, rcs))})")
        self.local = local

    def exists(self, key: bytes) -> bool:
        rc = self._store.is_exist(remote_key(key))
        if rc < 0:
            raise RemoteStoreError(f"asking the store for {remote_key(key)[:80]} failed (code {rc})")
        return rc == 1

    def publish(self, key: bytes, image: Any) -> None:
        """Put an object image under key. The store keeps the first image of a key (originals are immutable and
        content-addressed; a second put of the same key leaves it as it is)."""
        rc = self._store.put(remote_key(key), bytes(image) if not isinstance(image, bytes) else image)
        if rc != 0:
            raise RemoteStoreError(f"publishing {remote_key(key)[:80]} failed (code {rc})")

    def fetch(self, key: bytes) -> bytes:
        """The raw image stored under key (unverified: objfile.decode_image it before use)."""
        if not self.exists(key):
            raise RemoteMissingError(f"the store holds no {remote_key(key)[:80]}")
        size = self._store.get_size(remote_key(key))
        # `get` answers b"" for a transfer that failed as for a missing key; a listed object's transfer failing is
        # retried once (its log names why, e.g. LEASE_EXPIRED: the transfer outlived the master's lease on it)
        for attempt in range(2):
            data = self._store.get(remote_key(key))
            if data and (size < 0 or len(data) == size):
                return data
            if attempt == 0:
                time.sleep(0.05)
        raise RemoteStoreError(f"fetching {remote_key(key)[:80]} failed twice ({len(data)} of {size} bytes came)")

    def remove(self, key: bytes) -> None:
        rc = self._store.remove(remote_key(key))
        if rc != 0:
            raise RemoteStoreError(f"removing {remote_key(key)[:80]} failed (code {rc})")

    def overwrite(self, key: bytes, image: Any) -> None:
        """Replace the bytes under key through the store's own API (upsert): the failure cases' tampering."""
        rc = self._store.upsert(remote_key(key), bytes(image))
        if rc != 0:
            raise RemoteStoreError(f"overwriting {remote_key(key)[:80]} failed (code {rc})")

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()


def master_binary() -> str:
    """mooncake_master from the environment the interpreter runs in (the wheel's console script)."""
    here = Path(sys.executable).parent / "mooncake_master"
    found = str(here) if here.exists() else shutil.which("mooncake_master")
    if not found:
        raise RemoteUnavailableError("mooncake_master not found beside the interpreter or on PATH")
    return found


class MooncakeMaster:
    """The store's master with its HTTP metadata service, a real process on loopback (stage and tests)."""

    def __init__(self, workdir: Path, host: str = "127.0.0.1", lease_ms: int = 2000) -> None:
        self.workdir, self.host, self.lease_ms = Path(workdir), host, lease_ms
        self.rpc_port, self.http_port, self.metrics_port = free_port(host), free_port(host), free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._lock = threading.Lock()

    @classmethod
    def start_new(cls, workdir: Path, **kw: Any) -> MooncakeMaster:
        m = cls(workdir, **kw)
        m.start()
        return m

    def command(self) -> list[str]:
        # the lease a `get` takes on an object: it may not be removed for this long, and the transfer must end
        # within it (LEASE_EXPIRED otherwise). Mooncake's default is 10 s; 2 s keeps the failure cases' removals
        # quick. 50 ms was too short: a 3.7 MB transfer with both cores busy outlived it (a pipeline run's failure).
        return [master_binary(), f"--rpc_address={self.host}", f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={self.http_port}", f"--metrics_host={self.host}",
                f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ms}"]

    def spec(self, segment_bytes: int = 64 << 20, hostname: str | None = None) -> RemoteSpec:
        return RemoteSpec(master=f"{self.host}:{self.rpc_port}",
                          metadata=f"http://{self.host}:{self.http_port}/metadata",
                          hostname=hostname or self.host, segment_bytes=segment_bytes)

    @property
    def log_path(self) -> Path:
        return self.workdir / "mooncake_master.log"

    def start(self, timeout_s: float = 30.0) -> None:
        """Start it (again, on the same ports after stop/kill) and wait until both services answer."""
        with self._lock:
            if self.alive():
                raise RemoteStoreError("the master is already running")
            self.workdir.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            self.starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RemoteUnavailableError(f"mooncake_master exited with {self.proc.returncode}: "
                                             f"{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.1)
        self.kill()
        raise RemoteUnavailableError(f"mooncake_master did not answer in {timeout_s} s: {self.log_tail()}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.rpc_port), timeout=0.5):
                pass
            urllib.request.urlopen(f"http://{self.host}:{self.http_port}/metadata?key=probe", timeout=0.5)
        except urllib.error.HTTPError:
            return True      # the metadata service answered (404: no such key)
        except OSError:
            return False
        return True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash): its objects' metadata is gone with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 8) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
