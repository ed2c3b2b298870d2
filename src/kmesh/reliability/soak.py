"""Soak under memory pressure (issue 26 item 1): N client processes against one real service for T seconds.

    figures = run_soak(SoakSpec(clients=8, seconds=60), workdir)

The service runs with a RAM tier smaller than the working set and a disk tier under it (LRU spill, kmesh.service.store).
Each client is its own process (`python -m kmesh.reliability.soak CLIENT-ARGS`): it registers one memfd buffer
and, until its time is up, picks an object of the shared working set at random — object i holds `pattern(seed, i)`,
its key is the sha256 of those bytes, so any loader can verify what it got without trusting anyone — and loads it;
a missing object (never saved, or forgotten) is saved from the client's own copy of its bytes, as a cache fills a miss.
Some loads are cancelled right after they are accepted (the copy runs out; the client waits for it before reusing its
buffer). Every loaded byte is checked against the key. Refusals are counted by error type.

The controller measures the service process around the run: resident memory (VmRSS) before the clients start and
after they are gone, its open fds and memfd mappings (back to the baseline once every client closed), registrations
left (0), the store's counters (spills, read-backs, refusals), and whether the service is still alive.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kmesh.errors import StageError


class SoakError(StageError):
    """The soak could not run as specified (a client process failed outside the protocol, the service died)."""


@dataclass(frozen=True)
class SoakSpec:
    clients: int = 8
    seconds: float = 60.0
    object_bytes: int = 65536
    working_set: int = 96            # objects in the shared universe
    ram_objects: int = 24            # RAM tier capacity, in objects (< working_set: pressure)
    cancel_fraction: float = 0.1
    rate_ops_per_s: float = 0.0      # per client; 0 = as fast as it can (a paced soak holds the load for its
                                     # whole duration at a fraction of the CPU: the CI form)
    seed: int = 26


def content(seed: int, index: int, nbytes: int) -> bytes:
    """Object `index` of the working set (deterministic, independent of any KMesh code path)."""
    return hashlib.shake_128(b"kmesh-soak-%d-%d" % (seed, index)).digest(nbytes)


def key_of(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# ------------------------------------------------------------------------------------------------ client process
def client_main(socket_path: str, index: int, spec: SoakSpec) -> dict[str, Any]:
    """One client's loop (in its own process); returns its counters."""
    from kmesh.service import descriptor
    from kmesh.service.client import ServiceClient
    from kmesh.service.errors import CapacityError, ObjectExistsError, ObjectMissingError, ServiceError
    from kmesh.service.handles import HostBuffer

    rng = random.Random(spec.seed * 1000 + index)
    layout = descriptor.example(num_blocks=max(1, spec.object_bytes // descriptor.nbytes(descriptor.example(1))))
    n = descriptor.nbytes(layout)
    stats: Counter[str] = Counter()
    with ServiceClient.connect(socket_path, name=f"soak-{index}") as c:
        buf = HostBuffer(n, name=f"kmesh-soak-{index}")   # read and written through its own calls: no torch here
        ref = c.register_host(buf, alloc_id=1, generation=1, layout=layout)
        start = time.monotonic()
        deadline = start + spec.seconds
        while time.monotonic() < deadline:
            if spec.rate_ops_per_s > 0:   # paced: op k not before start + k / rate
                ahead = start + stats["ops"] / spec.rate_ops_per_s - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            i = rng.randrange(spec.working_set)
            data = content(spec.seed, i, n)
            key = key_of(data)
            buf.write(0, b"\xa5" * n)                  # poison: a load that wrote nothing cannot verify
            try:
                req = c.load(ref, key, 0)
            except ObjectMissingError:
                stats["load_missing"] += 1
                buf.write(0, data)
                try:
                    r = c.wait(c.save(ref, key, 0, n), timeout=60.0)
                    stats["save_" + r["state"]] += 1
                except ObjectExistsError:
                    stats["save_exists"] += 1                # another client filled the same miss first
                except CapacityError as e:
                    stats["save_refused_capacity"] += 1
                    stats["refusal:" + str(e)[:80]] += 1
                stats["ops"] += 1
                continue
            stats["ops"] += 1
            if rng.random() < spec.cancel_fraction:
                try:
                    c.cancel(req)
                    stats["cancel_sent"] += 1
                except ServiceError as e:              # it finished first
                    stats["cancel_late:" + type(e).__name__] += 1
            r = c.wait(req, timeout=60.0)
            stats["load_" + r["state"]] += 1
            if r["state"] == "done":
                if key_of(buf.read(0, n)) == key:
                    stats["verified"] += 1
                else:
                    stats["mismatch"] += 1
        c.close(ref)
        buf.close()
    return dict(stats)


# ------------------------------------------------------------------------------------------------ controller
def _half_median(samples: list[tuple[float, int]], half: int) -> int | None:
    values = [kib for _, kib in samples]
    part = values[: len(values) // 2] if half == 0 else values[len(values) // 2:]
    return int(statistics.median(part)) if part else None


def _hex(key: Any) -> str:
    return key.hex() if isinstance(key, (bytes, bytearray)) else str(key)


def proc_figures(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    maps = sum(1 for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "memfd:" in line)
    return {"rss_kib": rss, "fds": fds, "memfd_mappings": maps}


def _settled_figures(pid: int, timeout_s: float = 5.0) -> dict[str, Any]:
    """proc_figures once the fd count has held still for half a second: a connection the service is still
    closing (the start-up probe, the last client's) is no leak. Adds the fds' targets."""
    last, same, deadline = None, 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fig = proc_figures(pid)
        same = same + 1 if last is not None and fig["fds"] == last["fds"] else 0
        last = fig
        if same >= 5:
            break
        time.sleep(0.1)
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return {**last, "fd_targets": sorted(t.split("[")[0] + "[…]" if "[" in t else t for t in targets)}


def run_soak(spec: SoakSpec, workdir: Path) -> dict[str, Any]:
    """Start the service, run the clients, measure; returns the figures (see the module doc)."""
    from kmesh.service import descriptor, process

    layout = descriptor.example(num_blocks=max(1, spec.object_bytes // descriptor.nbytes(descriptor.example(1))))
    n = descriptor.nbytes(layout)
    workdir.mkdir(parents=True, exist_ok=True)
    sp = process.start(workdir / "rt", store_bytes=spec.ram_objects * n, disk_dir=workdir / "disk",
                       heartbeat_timeout_s=30.0, eviction="lru")
    try:
        pid = sp.pid
        before = _settled_figures(pid)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        cmd = [sys.executable, "-m", "kmesh.reliability.soak", str(sp.socket_path), json.dumps(asdict(spec))]
        t0 = time.monotonic()
        procs = [subprocess.Popen([*cmd, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
                 for i in range(spec.clients)]
        samples: list[tuple[float, int]] = []    # (s since start, VmRSS KiB) while the clients run
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.5):
                try:
                    samples.append((time.monotonic() - t0, proc_figures(pid)["rss_kib"]))
                except (OSError, StopIteration):
                    return
        sampler = threading.Thread(target=sample, name="soak-rss", daemon=True)
        sampler.start()
        per_client, failures = [], []
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=spec.seconds + 120)
            if p.returncode != 0:
                failures.append({"client": i, "rc": p.returncode, "stderr": err.decode(errors="replace")[-2000:]})
            else:
                per_client.append(json.loads(out.decode().strip().splitlines()[-1]))
        wall = time.monotonic() - t0
        done.set()
        sampler.join()
        alive = sp.alive()
        if not alive:
            raise SoakError(f"the service died during the soak (rc {sp.proc.returncode})")
        with sp.admin_client(name="soak-admin") as adm:
            st = adm.status("all", verify=True)
        after = _settled_figures(pid)
    finally:
        sp.stop()
    totals: Counter[str] = Counter()
    for c in per_client:
        totals.update(c)
    store = st.get("store", {})
    objects = store.get("objects", [])
    # content-addressed: an original's key is the sha256 of its bytes, and a RAM copy re-hashed now must still be it
    objects_wrong = [o["key"].hex() if isinstance(o["key"], bytes) else o["key"] for o in objects
                     if (o.get("sha256") != _hex(o["key"])) or ("sha256_now" in o and o["sha256_now"] != o["sha256"])]
    return {
        "spec": asdict(spec), "object_bytes": n, "wall_s": wall, "client_failures": failures,
        "ops": totals["ops"], "verified_loads": totals["verified"], "mismatches": totals["mismatch"],
        "loads": {k[5:]: v for k, v in totals.items() if k.startswith("load_")},
        "saves": {k[5:]: v for k, v in totals.items() if k.startswith("save_")},
        "cancels_sent": totals["cancel_sent"],
        "refusals": {k[8:]: v for k, v in totals.items() if k.startswith("refusal:")},
        "service_before": before, "service_after": after,
        "rss_growth_kib": after["rss_kib"] - before["rss_kib"],
        # a leak grows with the ops: the second half of the run against the first (median of each half's samples)
        "rss_kib_first_half_median": _half_median(samples, 0), "rss_kib_second_half_median": _half_median(samples, 1),
        "rss_samples": len(samples),
        "registrations_left": len(st.get("registrations") or []),
        "clients_left": [c.get("name") for c in st.get("clients") or [] if c.get("name") != "soak-admin"],
        "objects": len(objects), "objects_in_ram": sum(bool(o.get("in_ram")) for o in objects),
        "objects_rehashed": sum("sha256_now" in o for o in objects), "objects_wrong": objects_wrong,
        "pins_left": sum(int(o.get("pins", 0)) for o in objects),
        "store_counters": store.get("counters"), "store_used_bytes": store.get("used_bytes"),
        "store_capacity_bytes": store.get("capacity_bytes"), "status_consistent": st.get("consistent"),
        "service_alive": alive, "internal_errors": (st.get("stats") or {}).get("internal_errors"),
    }


if __name__ == "__main__":   # a client process: SOCKET SPEC-JSON INDEX; prints its counters as one JSON line
    sock, spec_json, idx = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(client_main(sock, idx, SoakSpec(**json.loads(spec_json)))), flush=True)
