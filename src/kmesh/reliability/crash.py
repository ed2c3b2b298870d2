"""Service crash consistency (issue 26 item 3): SIGKILL the service at random points of its work, restart it on
the same disk dir with adoption, and check what survived.

    figures = run_crash(CrashSpec(kills=200), workdir)

Durable means: a save whose reply reached the client as `done`. The store writes the object file through at commit
(kmesh.storage.objfile: temp file, fsync, rename, fsync of the directory) before the object becomes visible, so the
`done` reply comes after the fsyncs (docs/service.md, "Disk tier"). Per round:
  1. start the service over the disk dir (adopt=True); every object acknowledged durable in any earlier round must
     be there, and every object the service adopted — acknowledged or not (a save whose reply the kill cut off may
     have committed) — must load back with the bytes its key names (keys are the sha256 of the content); no temp file
     of an interrupted write may remain (the restart removes them, counted in `disk_temp_removed`);
  2. a client saves new objects and loads old ones (the RAM tier holds a few objects: loads read back from disk and
     saves spill), while the controller SIGKILLs the service after a random delay — during a save, a spill or a
     disk read, wherever it happens to be.
"""
from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kmesh.errors import StageError


class CrashError(StageError):
    """The crash rounds could not run (the service would not start over its disk dir)."""


@dataclass(frozen=True)
class CrashSpec:
    kills: int = 200
    object_bytes: int = 65536
    ram_objects: int = 4
    max_delay_s: float = 0.4
    resample: int = 16        # objects verified in an earlier round, loaded again after each restart
    seed: int = 26


def _content(seed: int, index: int, nbytes: int) -> bytes:
    return hashlib.shake_128(b"kmesh-crash-%d-%d" % (seed, index)).digest(nbytes)


def _temp_files(disk: Path) -> list[str]:
    return sorted(p.name for p in disk.iterdir() if ".tmp-" in p.name) if disk.exists() else []


def _client_loop(sp: Any, spec: CrashSpec, rng: random.Random, start_index: int, durable: dict[bytes, int],
                 stop: threading.Event, stats: Counter) -> None:
    """Save new objects and load acknowledged ones until the service dies (or `stop`)."""
    from kmesh.service import descriptor
    from kmesh.service.errors import ServiceError
    from kmesh.service.handles import HostBuffer

    layout = descriptor.example(num_blocks=max(1, spec.object_bytes // descriptor.nbytes(descriptor.example(1))))
    n = descriptor.nbytes(layout)
    index = start_index
    try:
        with sp.client(name="crash-client", heartbeat=False) as c:
            buf = HostBuffer(n, name="kmesh-crash")
            try:
                ref = c.register_host(buf, alloc_id=1, generation=1, layout=layout)
                while not stop.is_set():
                    if durable and rng.random() < 0.5:
                        key = rng.choice(list(durable))
                        stats["load_sent"] += 1
                        r = c.wait(c.load(ref, key, 0), timeout=30)
                        if r["state"] == "done":
                            ok = hashlib.sha256(buf.read(0, n)).digest() == key
                            stats["load_verified" if ok else "load_mismatch"] += 1
                    else:
                        data = _content(spec.seed, index, n)
                        key = hashlib.sha256(data).digest()
                        buf.write(0, data)
                        stats["save_sent"] += 1
                        r = c.wait(c.save(ref, key, 0, n), timeout=30)
                        if r["state"] == "done":     # the reply that means durable
                            durable[key] = index
                            stats["save_durable"] += 1
                        index += 1
            finally:
                buf.close()
    except (ServiceError, OSError, EOFError) as e:   # the kill cut the connection: expected
        stats["client_cut:" + type(e).__name__] += 1


def run_crash(spec: CrashSpec, workdir: Path) -> dict[str, Any]:
    from kmesh.service import descriptor, process

    n = descriptor.nbytes(descriptor.example(num_blocks=max(1, spec.object_bytes //
                                                                 descriptor.nbytes(descriptor.example(1)))))
    disk = workdir / "disk"
    rng = random.Random(spec.seed)
    durable: dict[bytes, int] = {}
    verified: set[bytes] = set()
    stats: Counter[str] = Counter()
    problems: list[dict[str, Any]] = []
    next_index = 0
    for round_index in range(spec.kills + 1):
        sp = process.start(workdir / "rt", store_bytes=spec.ram_objects * n, disk_dir=disk, adopt=True,
                           heartbeat_timeout_s=30.0, eviction="lru")
        try:
            leftovers = _temp_files(disk)
            with sp.admin_client(name="crash-admin") as adm:
                st = adm.status("all")
                objects = {o["key"]: o for o in st["store"].get("objects", [])}
                counters = st["store"]["counters"]
            missing = [k.hex()[:16] for k in durable if k not in objects]
            if missing:
                problems.append({"round": round_index, "durable_missing": missing})
            stats["adopted"] += counters["adopted"]
            stats["temp_removed"] += counters["disk_temp_removed"]
            stats["disk_rejected"] += counters["disk_rejected"] - counters["disk_temp_removed"]
            if leftovers:
                problems.append({"round": round_index, "temp_files_left": leftovers})
            # every object adopted for the first time, acknowledged or not, must load back as the bytes its key
            # names; of those verified in earlier rounds, a sample (a restart re-reads every header, not payloads)
            fresh = [k for k in objects if k not in verified]
            older = [k for k in objects if k in verified]
            sample = fresh + rng.sample(older, min(len(older), spec.resample))
            unverified = _verify_all(sp, sample, n)
            verified.update(k for k in fresh)
            stats["adopted_verified"] += len(sample) - len(unverified)
            if unverified:
                problems.append({"round": round_index, "adopted_wrong": unverified})
            for k in objects:   # committed though its reply was cut off: durable from now on
                if k not in durable:
                    durable[k] = -1
                    stats["committed_unacknowledged"] += 1
            if round_index == spec.kills:
                break
            stop = threading.Event()
            worker = threading.Thread(target=_client_loop, args=(sp, spec, rng, next_index, durable, stop, stats),
                                      name="crash-client", daemon=True)
            worker.start()
            time.sleep(rng.uniform(0.02, spec.max_delay_s))
            stats["internal_errors"] += _internal_errors(sp)   # this instance's, before the kill takes them along
            os.kill(sp.pid, signal.SIGKILL)
            stats["kills"] += 1
            worker.join(timeout=30)
            stop.set()
            next_index = max([i for i in durable.values()] + [next_index]) + 1000
        finally:
            sp.stop()
    return {"spec": asdict(spec), "kills": stats["kills"], "durable_objects": len(durable),
            "saves_acknowledged": stats["save_durable"], "committed_unacknowledged": stats["committed_unacknowledged"],
            "adopted_total": stats["adopted"], "loads_after_restart_verified": stats["adopted_verified"],
            "temp_files_removed": stats["temp_removed"], "files_rejected": stats["disk_rejected"],
            "loads_verified": stats["load_verified"], "load_mismatches": stats["load_mismatch"],
            "internal_errors": stats["internal_errors"], "problems": problems, "counters": dict(stats)}


def _internal_errors(sp: Any) -> int:
    """The service's own count of internal errors (a bug it caught and survived), asked by an admin client."""
    from kmesh.service.errors import ServiceError

    try:
        with sp.admin_client(name="crash-internal") as adm:
            return int(adm.summary("all")["stats"]["internal_errors"])
    except ServiceError:   # it could not answer: a kill racing this question is not an internal error
        return 0


def _verify_all(sp: Any, keys: list[bytes], n: int) -> list[str]:
    """Load every key into a fresh buffer; the hex prefixes of those whose bytes are not what the key names."""
    from kmesh.service import descriptor
    from kmesh.service.errors import ServiceError
    from kmesh.service.handles import HostBuffer

    layout = descriptor.example(num_blocks=n // descriptor.nbytes(descriptor.example(1)))
    bad = []
    with sp.client(name="crash-verify") as c:
        buf = HostBuffer(n, name="kmesh-crash-verify")
        try:
            ref = c.register_host(buf, alloc_id=1, generation=1, layout=layout)
            for key in keys:
                buf.write(0, b"\x5a" * n)
                try:
                    r = c.wait(c.load(ref, key, 0), timeout=60)
                except ServiceError as e:     # listed but not loadable: as wrong as wrong bytes
                    bad.append(f"{key.hex()[:16]}: {type(e).__name__}")
                    continue
                if r["state"] != "done" or hashlib.sha256(buf.read(0, n)).digest() != key:
                    bad.append(key.hex()[:16])
            c.close(ref)
        finally:
            buf.close()
    return bad
