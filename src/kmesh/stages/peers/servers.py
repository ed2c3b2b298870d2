"""The two cache servers the peers stage puts side by side, behind one interface, so every case and fault scenario
runs the same steps against both: LMCache's MP server (lmcache_server.LMCacheServer) and KMesh's cache service
(kmesh.service.process).

    peer.start() / peer.kill() / peer.alive()  # kill(): SIGKILL, then its evidence (exit status, address closed)
    peer.engine(tag)                      # a vLLM engine process with this peer's connector (kmesh.vllm.engine)
    peer.params()                         # per-request kv_transfer_params asking the peer for its own statistics
    peer.reused(output)                   # tokens the peer reports it supplied for that request (its own count)
    peer.holdings(pids)                   # what the server holds now, by its own status API
"""
from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

from kmesh.service import process
from kmesh.stages.peers.lmcache_server import LMCacheServer
from kmesh.vllm.engine import WORKAROUNDS, EngineProcess, llm_kwargs


def accepts(family: int, address: Any, timeout_s: float = 1.0) -> bool:
    """Does anything accept a connection at `address` now (a TCP (host, port) or a Unix socket path)?"""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(address)
            return True
        except OSError:
            return False


def kill_evidence(returncode: int | None, addresses: dict[str, bool]) -> dict[str, Any]:
    """What shows a SIGKILL ended the server: its exit status (-9) and none of its addresses still accepting. (Not
    that the kill came during a load: that needs the loads' own counters.)"""
    return {"exit_status": returncode, "killed_by_sigkill": returncode == -signal.SIGKILL,
            "still_accepting": {name: up for name, up in addresses.items() if up},
            "server_gone": returncode == -signal.SIGKILL and not any(addresses.values())}


class Peer:
    name = ""

    def __init__(self, model_dir: Path, workdir: Path, common: dict[str, Any]) -> None:
        self.model_dir = model_dir
        self.workdir = workdir
        self.common = common            # the engine settings every arm shares (dtype, thread binding)
        self.engines = 0

    def _log(self, tag: str) -> Path:
        self.engines += 1
        return self.workdir / f"engine-{self.name}-{tag}-{self.engines}.log"


class LMCachePeer(Peer):
    """LMCache 0.5.6's MP server + LMCacheMPConnector in the engine (its CPU path: engine-driven transfer)."""
    name = "lmcache"
    workarounds = ("vllm_dispatcher_vars_nondict",)
    # LMCache's telemetry off in its engines; every arm's engine_env sets the same, so the arms' environments stay
    # one and their engines fork from one zygote
    engine_env = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}

    def __init__(self, model_dir: Path, workdir: Path, common: dict[str, Any], settings: dict[str, Any]) -> None:
        super().__init__(model_dir, workdir, common)
        self.server = LMCacheServer(workdir, settings)
        # the same failure policy as KMesh's arm (kmesh.vllm.engine.CONNECTOR): a failed load is recomputed
        self.failure_policy = "recompute"

    def describe(self) -> dict[str, Any]:
        return {"server_command": self.server.command()[1:], "engine_kv_transfer": self._kv_transfer(),
                "workarounds": {w: WORKAROUNDS[w] for w in self.workarounds}, "lmcache": self.server.version()}

    def start(self) -> float:
        return self.server.start()

    def kill(self) -> dict[str, Any]:
        rc = self.server.kill()
        return kill_evidence(rc, {f"tcp:{port}": accepts(socket.AF_INET, ("127.0.0.1", port))
                                  for port in (self.server.port, self.server.http_port)})

    def stop(self) -> None:
        self.server.stop()

    def alive(self) -> bool:
        return self.server.alive()

    def _kv_transfer(self) -> dict[str, Any]:
        return {**self.server.kv_transfer(), "kv_load_failure_policy": self.failure_policy}

    def engine_spec(self) -> dict[str, Any]:
        """What engine() passes to vLLM's LLM(...) (kmesh.vllm.engine.llm_kwargs), without starting anything."""
        return llm_kwargs(str(self.model_dir), None, self.common["dtype"], kv_transfer=self._kv_transfer())

    def engine(self, tag: str, wait: bool = True) -> EngineProcess:
        return EngineProcess(self.model_dir, None, kv_transfer=self._kv_transfer(), workarounds=self.workarounds,
                             log_path=self._log(tag), wait=wait, env=self.engine_env, **self.common)

    def params(self) -> dict[str, Any]:
        return {"cached_token_stats": True}

    def reused(self, out: dict[str, Any]) -> int | None:
        stats = (out.get("peer") or {}).get("cached_token_stats")
        return None if stats is None else int(stats["num_lmcache_cached_tokens"])

    def holdings(self, pids: dict[str, int]) -> dict[str, Any]:
        if not self.alive():
            return {"server": "down"}
        return self.server.status()

    def liveness(self) -> float:
        return float(self.server.settings["worker_reap_timeout_s"])

    def engines_registered(self, holds: dict[str, Any], pid: int) -> int:
        """Engine registrations the server lists (LMCache names instances by its own ids, not by pid)."""
        return len(holds.get("instances", []))


class KMeshPeer(Peer):
    """KMesh's cache service + KMeshConnector in the engine."""
    name = "kmesh"

    def __init__(self, model_dir: Path, workdir: Path, common: dict[str, Any], settings: dict[str, Any]) -> None:
        super().__init__(model_dir, workdir, common)
        self.settings = dict(settings)
        self.liveness_s = float(settings["heartbeat_timeout_s"])
        self.service: process.ServiceProcess | None = None
        self.runtime = workdir / "svc"
        self.starts: list[float] = []

    def describe(self) -> dict[str, Any]:
        return {"service": {"store_bytes": int(self.settings["store_bytes"]), "heartbeat_timeout_s": self.liveness_s},
                "engine_extra": self._extra() if self.service is not None else None, "workarounds": {}}

    def start(self) -> float:
        t0 = time.monotonic()
        self.service = process.start(self.runtime, store_bytes=int(self.settings["store_bytes"]),
                                     heartbeat_timeout_s=self.liveness_s)
        self.starts.append(time.monotonic() - t0)
        return self.starts[-1]

    def kill(self) -> dict[str, Any]:
        if self.service is None:
            return kill_evidence(None, {})
        if self.service.proc.poll() is None:
            self.service.proc.kill()
        rc = self.service.proc.wait(timeout=30)
        path = str(self.service.socket_path)
        return kill_evidence(rc, {f"unix:{path}": accepts(socket.AF_UNIX, path)})

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()

    def alive(self) -> bool:
        return self.service is not None and self.service.proc.poll() is None

    def _extra(self) -> dict[str, Any]:
        if self.service is None:
            raise RuntimeError("start the KMesh service before its engines")
        return {"socket": str(self.service.socket_path),
                "staging_blocks": int(self.settings["staging_blocks"]), "retry_s": float(self.settings["retry_s"]),
                "repair": dict(self.settings["repair"]), "repair_model": str(self.model_dir)}

    def engine_spec(self) -> dict[str, Any]:
        extra = self._extra() if self.service is not None else {"socket": "(the service's socket)"}
        return llm_kwargs(str(self.model_dir), extra, self.common["dtype"])

    def engine(self, tag: str, wait: bool = True) -> EngineProcess:
        return EngineProcess(self.model_dir, self._extra(), log_path=self._log(tag), wait=wait, **self.common)

    def params(self) -> dict[str, Any] | None:
        return None

    def liveness(self) -> float:
        return self.liveness_s

    def engines_registered(self, holds: dict[str, Any], pid: int) -> int:
        return int(holds.get("engines_with_registrations", 0))

    def reused(self, out: dict[str, Any]) -> int | None:
        report = out.get("kmesh")
        return None if report is None else int(report["tokens_supplied"])

    def copies_of(self, pid: int) -> dict[str, int]:
        """The copies the service itself completed for the engine process `pid` (summed over its clients): loads and
        load bytes (the records it read and the payloads it restored), saves and save bytes."""
        with self.service.admin_client(name="kmesh-peers-stage") as admin:
            st = admin.status("all")
        out = {"loads": 0, "load_bytes": 0, "saves": 0, "save_bytes": 0}
        for c in st["clients"]:
            if c.get("pid") == pid:
                for k in out:
                    out[k] += int(c.get("copies_done", {}).get(k, 0))
        return out

    def holdings(self, pids: dict[str, int]) -> dict[str, Any]:
        if not self.alive():
            return {"server": "down"}
        with self.service.admin_client(name="kmesh-peers-stage") as admin:
            st = admin.status("all")
        mine = {c["client"]: c.get("pid") for c in st["clients"]}
        by_engine = {tag: sorted({r["client"] for r in st["registrations"] if mine.get(r["client"]) == pid})
                     for tag, pid in pids.items()}
        return {"clients_live": st["counts"]["clients_live"], "registrations": st["counts"]["registrations"],
                "engines_with_registrations": len({mine.get(r["client"]) for r in st["registrations"]} - {None}),
                "objects": st["store"]["nobjects"], "requests_running": st["counts"]["requests_running"],
                "clients_with_registrations_by_engine": by_engine, "consistent": st["consistent"]}
