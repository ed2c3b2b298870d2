"""LMCache's multiprocess (MP) cache server as its users start it, for the peers stage.

    server = LMCacheServer(workdir, {"chunk_size": 256, "l1_size_gb": 0.5, "eviction_policy": "LRU"})
    server.start()                       # python -m lmcache.v1.multiprocess.http_server ... on loopback
    mark = server.mark()
    ... requests through an engine with LMCacheMPConnector (server.kv_transfer()) ...
    server.counted(mark)                 # {"stored": 768, "retrieved": 768}: LMCache's own log lines since mark
    server.status()                      # LMCache's own GET /status (sessions, L1 objects, instances)

The server is LMCache's own CLI module with its own flags; telemetry off (LMCACHE_TRACK_USAGE=false, DO_NOT_TRACK=1),
bound to 127.0.0.1 only. What it reused is read from its own statistics, never assumed: its Prometheus counters on
/metrics (lookup hit tokens, L1 chunks written and read; on by default, reset only by a restart), the per-transfer log
lines its engine-driven transfer module writes at INFO ("Stored N tokens in …", "Retrieved N tokens in …"; a failed
retrieve is logged too), and its /status. Per request, its connector reports `cached_token_stats` in the output's
kv_transfer_params when the request asks for them.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kmesh.errors import KMeshError

MODULE = "lmcache.v1.multiprocess.http_server"
HOST = "127.0.0.1"
# LMCache's own per-transfer log lines (lmcache.v1.multiprocess.modules.engine_driven_transfer, INFO level)
_COUNTED = {"stored": re.compile(r"\bStored (\d+) tokens in "),
            "retrieved": re.compile(r"\bRetrieved (\d+) tokens in ")}
# LMCache's own Prometheus counters on /metrics, by what the stage calls them (summed over their label sets)
METRICS = {"lookup_requested_tokens": "lmcache_mp_lookup_requested_tokens_total",
           "lookup_hit_tokens": "lmcache_mp_lookup_hit_tokens_total",
           "l1_write_chunks": "lmcache_mp_l1_write_chunks_total",
           "l1_read_chunks": "lmcache_mp_l1_read_chunks_total",
           "l1_evicted_chunks": "lmcache_mp_l1_evicted_chunks_total"}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)\s*$")


class PeerServerError(KMeshError):
    """The peer's server did not start, or did not answer its own API."""


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it), so parallel runs never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Mark:
    """A point in the server's log and counters: what it counted after it belongs to the requests made since."""
    offset: int
    generation: int
    metrics: dict[str, float]


def parse_metrics(text: str) -> dict[str, float]:
    """The METRICS counters of a Prometheus text exposition, each summed over its label sets (absent: 0)."""
    wanted = {v: k for k, v in METRICS.items()}
    out = {k: 0.0 for k in METRICS}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and m.group(1) in wanted:
            out[wanted[m.group(1)]] += float(m.group(2))
    return out


class LMCacheServer:
    def __init__(self, workdir: Path, settings: dict[str, Any]) -> None:
        self.workdir = workdir
        self.settings = dict(settings)
        self.port = free_port()
        self.http_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.generation = 0          # one per start: a restart begins a new log
        self.starts: list[float] = []

    @property
    def log_path(self) -> Path:
        return self.workdir / f"lmcache-server-{self.generation}.log"

    def command(self) -> list[str]:
        s = self.settings
        return [sys.executable, "-m", MODULE, "--host", HOST, "--port", str(self.port),
                "--http-host", HOST, "--http-port", str(self.http_port),
                "--supported-transfer-mode", str(s["transfer_mode"]), "--chunk-size", str(int(s["chunk_size"])),
                "--l1-size-gb", str(float(s["l1_size_gb"])), "--eviction-policy", str(s["eviction_policy"]),
                "--worker-reap-timeout-seconds", str(float(s["worker_reap_timeout_s"])),
                *(["--engine-type", str(s["engine_type"])] if s.get("engine_type") else [])]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        return env

    def kv_transfer(self) -> dict[str, Any]:
        """The engine's kv_transfer_config for LMCache's MP connector (its own keys), pointed at this server."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": self.port,
                                              **dict(self.settings.get("engine_extra", {}))}}

    def start(self, timeout_s: float = 120.0) -> float:
        if self.proc is not None and self.proc.poll() is None:
            raise PeerServerError("LMCache server already running")
        self.generation += 1
        self.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                         start_new_session=True)
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerServerError(f"LMCache server exited with {self.proc.returncode} at start:\n{self.tail()}")
            try:
                if self._get("/healthcheck", timeout_s=2.0).get("status") == "healthy":
                    self.starts.append(time.monotonic() - t0)
                    return self.starts[-1]
            except (OSError, PeerServerError):
                pass
            time.sleep(0.2)
        self.kill()
        raise PeerServerError(f"LMCache server not healthy after {timeout_s:g} s:\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> int | None:
        """SIGKILL, as a crash ends it (its process group: nothing of it outlives the kill)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM (its own shutdown), SIGKILL if it does not end in time."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def restart(self) -> float:
        self.kill()
        return self.start()

    def _get(self, path: str, timeout_s: float = 10.0) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.http_port}{path}", timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise PeerServerError(f"LMCache GET {path}: HTTP {e.code}") from e

    def raw_status(self) -> dict[str, Any]:
        """LMCache's own /status, whole (its engine type and every module's report)."""
        return self._get("/status")

    def status(self) -> dict[str, Any]:
        """LMCache's own /status, reduced to what the stage reads: sessions, engine instances, L1 objects/bytes."""
        st = self._get("/status")
        l1 = st.get("storage_manager", {}).get("l1_manager", {})
        return {"active_sessions": st.get("active_sessions"),
                "instances": list(st.get("registered_non_cuda_instance_ids", [])),
                "l1_objects": l1.get("total_object_count"), "l1_bytes": l1.get("memory_used_bytes"),
                "l1_locked": (l1.get("write_locked_count") or 0) + (l1.get("read_locked_count") or 0),
                "healthy": st.get("is_healthy"), "chunk_size": st.get("chunk_size")}

    def metrics(self) -> dict[str, float]:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.http_port}/metrics", timeout=10) as r:
                return parse_metrics(r.read().decode())
        except (OSError, urllib.error.HTTPError) as e:
            raise PeerServerError(f"LMCache GET /metrics: {e}") from e

    def mark(self) -> Mark:
        return Mark(self.log_path.stat().st_size if self.log_path.exists() else 0, self.generation,
                    self.metrics() if self.alive() else {k: 0.0 for k in METRICS})

    def counted(self, since: Mark, settle_s: float = 5.0, quiet_s: float = 1.0) -> dict[str, int]:
        """What LMCache says it did since `since`: tokens stored and retrieved (its log lines) and its counters'
        increase (lookup hit tokens, L1 chunks written/read), this server generation only (a restart starts both
        anew; a dead server's counters are gone, its log lines are not).

        Its store completes, and its counters are updated (by an event-bus thread), after the engine's request
        returned: read until nothing changed for quiet_s, or settle_s passed."""
        last, stable_since, deadline = None, time.monotonic(), time.monotonic() + settle_s
        while True:
            now = self._count(since)
            if now != last:
                last, stable_since = now, time.monotonic()
            elif time.monotonic() - stable_since >= quiet_s or time.monotonic() > deadline:
                return now
            time.sleep(0.05)

    def _count(self, since: Mark) -> dict[str, int]:
        same = since.generation == self.generation
        out: dict[str, int] = {}
        if self.log_path.exists():
            with open(self.log_path, "rb") as f:
                f.seek(since.offset if same else 0)
                text = f.read().decode(errors="replace")
            out = {f"{k}_tokens_logged": sum(int(m) for m in rx.findall(text)) for k, rx in _COUNTED.items()}
        if self.alive():
            now, base = self.metrics(), (since.metrics if same else {k: 0.0 for k in METRICS})
            out.update({k: int(now[k] - base[k]) for k in METRICS})
        return out

    def tail(self, n: int = 15) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def version(self) -> str:
        from importlib.metadata import version

        return version("lmcache")
