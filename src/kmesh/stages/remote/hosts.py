"""Two hosts over one Mooncake Store: the store's master, a store node that lends the store its memory, host A's
service (the leader saves there) and host B's service (the children load there), each a real process with its own
runtime and disk dirs, plus an operator's store client of this process (for the failure cases: remove an object,
overwrite its bytes).

    with TwoHosts(setup, workdir, sec) as hosts:
        hosts.save_leader()                       # A commits every segment; its remote tier publishes them
        hosts.load_child(i, private)              # child i on host B: every segment through B's service
        hosts.forget_on_b()                       # B holds nothing: the next loads fetch from the store
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from kmesh.harness.modelsetup import ModelSetup
from kmesh.harness.service import Harness
from kmesh.harness.service_side import ServiceSide, Staging
from kmesh.kv.sources import ServiceSegments
from kmesh.storage.remote import MooncakeClient, MooncakeMaster
from kmesh.storage.remote_agent import Agent
from kmesh.storage.routes import drop_page_cache


class HostsError(RuntimeError):
    """The two-host setup did not reach the state a case needs (publishes not done, a service gone)."""


class TwoHosts:
    def __init__(self, setup: ModelSetup, workdir: Path, sec: dict[str, Any], children: int) -> None:
        self.setup, self.workdir, self.sec = setup, Path(workdir), sec
        self.stack = contextlib.ExitStack()
        try:
            self._start(setup, sec, children)
        except BaseException:
            self.stack.close()   # what did start stops again: no process outlives a failed setup
            raise

    def _start(self, setup: ModelSetup, sec: dict[str, Any], children: int) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)   # a previous run's disk tiers would be re-adopted
        self.master = self.stack.enter_context(MooncakeMaster(self.workdir / "master"))
        self.master.start()
        # The store's memory is a store node's (an agent process that only lends it), not the hosts': a host's
        # agent is replaced after a hung call, and what it had lent would go with it (objects placed there become
        # unreadable: tests/test_remote_tier.py shows it).
        self.store_node = Agent(self.master.spec(segment_bytes=int(sec["segment_bytes"])),
                                self.workdir / "store-node.log")
        self.stack.callback(self.store_node.close)
        self.mount_store_node()
        spec = dataclasses.replace(self.master.spec(segment_bytes=0), call_timeout_s=float(sec["call_timeout_s"]))
        eq = setup.cfg.section("equivalence")
        self.hosts: dict[str, Harness] = {}
        for name in ("a", "b"):
            disk, logs = self.workdir / f"host-{name}-disk", self.workdir / f"host-{name}-logs"
            logs.mkdir(parents=True, exist_ok=True)
            self.hosts[name] = self.stack.enter_context(Harness(
                device=str(setup.device), heartbeat_timeout_s=float(sec["heartbeat_timeout_s"]),
                chunk_bytes=int(eq["chunk_bytes"]), store_bytes=int(sec["store_bytes"]), disk_dir=disk,
                remote=spec, log_dir=logs))
        self.a, self.b = self.hosts["a"], self.hosts["b"]
        for h in (self.a, self.b):
            h.gate.open()   # pacing is a test control; the hosts copy as soon as they accept
        # the clients (leader, children, their staging registrations) close before the services stop
        self.clients = self.stack.enter_context(contextlib.ExitStack())
        self.leader = self.clients.enter_context(ServiceSide(self.a, setup.export, setup.device))
        self.leader.paced = False
        self.sides = [self.clients.enter_context(ServiceSide(self.b, setup.export, setup.device))
                      for _ in range(children)]
        for side in self.sides:
            side.paced = False
        self.staging: list[Staging] = [self.clients.enter_context(side.staging(f"remote-{i}"))
                                       for i, side in enumerate(self.sides)]
        self.operator = MooncakeClient(self.master.spec(segment_bytes=0))
        self.keys = [e.key for e in setup.export.catalog.entries]
        self.a_digests: dict[bytes, str] = {}     # what A's store committed (set by save_leader)
        self.holdings_at_start = self.leaks()

    # -- host A ---------------------------------------------------------------------------------------
    def save_leader(self, timeout_s: float = 120.0) -> dict[str, Any]:
        t0 = time.monotonic()
        digests = self.a_digests = self.leader.save_leader()
        before = self.remote_counters(self.a)["published"]
        st = self.a.wait_until("every segment published", lambda s: s["remote"]["pending_publishes"] == 0,
                               timeout=timeout_s)
        return {"digests": digests, "seconds": time.monotonic() - t0, "remote": st["remote"],
                "published_before_wait": before}

    # -- host B ---------------------------------------------------------------------------------------
    def source(self, index: int) -> ServiceSegments:
        return ServiceSegments(self.sides[index].client, self.staging[index].reg)

    def load_child(self, index: int, private: torch.Tensor) -> None:
        src, staging = self.source(index), self.staging[index].tensor
        for entry in self.setup.export.catalog.entries:
            src.load(entry, staging)
        private.copy_(staging)

    def forget_on_b(self) -> None:
        """B holds none of the objects (RAM and disk): its next loads fetch them from the store."""
        for key in self.keys:
            if any(o["key"] == key for o in self.b.status()["store"]["objects"]):
                self.b.admin.evict(key, tier="all", force=True)

    def cold_disk_on_b(self) -> None:
        """B holds every object on disk only, out of the page cache: its next loads read them back."""
        self.b.admin.evict(tier="ram", force=True)
        drop_page_cache(sorted((self.workdir / "host-b-disk").glob("*.kmo")))

    def held_by_b(self) -> dict[bytes, dict[str, Any]]:
        return {o["key"]: o for o in self.b.status()["store"]["objects"]}

    @staticmethod
    def remote_counters(h: Harness) -> dict[str, int]:
        return dict(h.status()["remote"]["counters"])

    def leaks(self) -> dict[str, Any]:
        return {name: h.leaks() for name, h in self.hosts.items()}

    def expected_holdings(self) -> dict[str, Any]:
        """What leaks() must read between cases: what both hosts held once the clients were set up (on B the
        children's open staging registrations), nothing more and nothing less."""
        return self.holdings_at_start

    def alive(self) -> bool:
        return all(h.service.alive() for h in self.hosts.values())

    def mount_store_node(self) -> None:
        """(Re)start the store node and have it connect: its segment is mounted when this returns."""
        self.store_node.restart()
        self.store_node.exists(b"kmesh-store-node")

    def restart_master(self) -> None:
        """Start the killed master again (same ports; it has forgotten every object and every segment): the
        store node lends its memory anew; the hosts' agents connect again on their next call; the operator's
        client is made anew."""
        self.master.start()
        self.mount_store_node()
        self.operator.close()
        self.operator = MooncakeClient(self.master.spec(segment_bytes=0))

    def close(self) -> dict[str, Any]:
        """Stop everything; each host's service exit code (0: it stopped cleanly, nothing held)."""
        out: dict[str, Any] = {}
        try:
            self.operator.close()
            self.clients.close()
            for name, h in self.hosts.items():
                out[name] = h.close()["service_exit"]
        finally:
            self.stack.close()    # Harness.close again is harmless: the service is already stopped
        return out

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
