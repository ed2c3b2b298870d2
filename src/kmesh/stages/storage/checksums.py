"""Checksum arms of the storage stage (issue 11 items 5 and 6): how each restored object is verified, and
whether that check overlaps the reads.

Every arm reads the same objects through the same host route (staging on CUDA, O_DIRECT on CPU) into a host
landing slot, copies the whole padded object into a device landing slot (kmesh.transfer ticket T1, which the
copy engine orders after the read: a read returns only when its I/O completed), verifies it there, and copies
its payload device-to-device into the child's private buffer (ticket T2) before restore + repair.

    arm                 objects       verification
    cpu-sha256          sha256        download device -> host, hashlib (the write-up's way)
    cpu-blake3          blake3        download device -> host, the blake3 package (all cores)
    gpu-sha256          sha256        whole-object SHA-256 on the GPU, one concurrent call (one thread per object)
    gpu-sha256-tree     sha256-tree   chunked SHA-256 tree on the GPU (chunk size in the object header)
    gpu-blake3          blake3        standard BLAKE3 on the GPU
    <arm>-overlap       as <arm>      each object hashed as soon as its copy reached device memory, while the
                                      next object is read: the hash waits for T1's event (CUDA: on a hash
                                      stream; CPU: a hasher thread waits for T1), T2 waits for the hash, so the
                                      device slot stays held (kmesh.transfer holds) until both its consumers —
                                      the hash and the payload copy — are done

The cpu profile runs cpu-sha256 vs cpu-blake3 and cpu-blake3 vs cpu-blake3-overlap: the same code path with
the "device" a second host buffer. Timed parts, nested: read ⊂ restore ⊂ outer and verify ⊂ restore (verify is
the hashing the reads did not hide: the whole check in the plain arms, the wait for the last digests with
overlap). Every run is compared with the in-process reference bit for bit; a corrupted object is refused.
"""
from __future__ import annotations

import contextlib
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch

from kmesh import integrity
from kmesh.bench import Intervals, run_pairs
from kmesh.harness.child import ChildContext, ChildOutcome, new_cache, outcome_of, prefill_and_decode, restore_child
from kmesh.harness.workload import Child
from kmesh.model.quality import compare_states, identical
from kmesh.stages.storage.child import release_checked
from kmesh.stages.storage.objects import ObjectSet, save_objects
from kmesh.storage import routes
from kmesh.storage.errors import ObjectAlgorithmError, ObjectCorruptError


@dataclass(frozen=True)
class ChecksumArm:
    name: str
    algorithm: str
    where: str          # "host": download to host, hash on the CPU | "gpu": hash the device slot on the GPU
    overlap: bool = False


ARMS = {a.name: a for a in (
    ChecksumArm("cpu-sha256", "sha256", "host"),
    ChecksumArm("cpu-blake3", "blake3", "host"),
    ChecksumArm("cpu-blake3-overlap", "blake3", "host", True),
    ChecksumArm("gpu-sha256", "sha256", "gpu"),
    ChecksumArm("gpu-sha256-tree", "sha256-tree", "gpu"),
    ChecksumArm("gpu-blake3", "blake3", "gpu"),
    ChecksumArm("gpu-blake3-overlap", "blake3", "gpu", True),
    ChecksumArm("gpu-sha256-tree-overlap", "sha256-tree", "gpu", True),
)}


class ChecksumArmError(ValueError):
    """A checksum arm that does not exist or cannot run on this device."""


def arm_named(name: str, device: torch.device) -> ChecksumArm:
    try:
        found = ARMS[name]
    except KeyError:
        raise ChecksumArmError(f"unknown checksum arm {name!r} (known: {', '.join(ARMS)})") from None
    if found.where == "gpu" and device.type != "cuda":
        raise ChecksumArmError(f"checksum arm {name!r} hashes on the GPU; this stage runs on {device}")
    if found.where == "host" and found.overlap and device.type == "cuda":
        # on CUDA the overlapped check is the GPU one; a host hash would need its own download per object
        raise ChecksumArmError(f"checksum arm {name!r} is the cpu profile's overlap arm; on CUDA use gpu-*-overlap")
    return found


def _part(iv: Intervals | None, name: str) -> ContextManager[Any]:
    return iv.part(name) if iv is not None else contextlib.nullcontext()


class Buffers:
    """The landing buffers every checksum arm shares: host landing (the route's), device landing, host download."""

    def __init__(self, route: routes.Route, total: int, catalog_nbytes: int, device: torch.device) -> None:
        self.route = route
        self.host = route.landing(total)
        self.dev = torch.empty(total, dtype=torch.uint8, device=device)
        self.down = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.private = torch.empty(catalog_nbytes, dtype=torch.uint8, device=device)
        self.device = device
        self.hash_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kmesh-hash")    # host-hashing overlap arms

    def poison(self) -> None:
        self.host.fill_(0xA5)
        self.dev.fill_(0xC3)
        self.down.fill_(0x3C)
        self.private.fill_(0x5A)

    def close(self) -> None:
        self.pool.shutdown()


def _params(objs: ObjectSet) -> dict[str, Any]:
    return dict(objs.headers[0].params)


def _mismatch(objs: ObjectSet, index: int, algorithm: str, got: bytes) -> ObjectCorruptError:
    return ObjectCorruptError(f"{objs.paths[index]}: {algorithm} digest mismatch (recorded "
                              f"{objs.headers[index].digest.hex()[:16]}…, computed {got.hex()[:16]}…)")


def _read_and_copy(ctx: ChildContext, objs: ObjectSet, index: int, bufs: Buffers, arm: ChecksumArm, owner: str,
                   iv: Intervals | None) -> tuple[torch.Tensor, Any]:
    """Object `index`: header checked (algorithm as the arm expects), read into its host slot, device copy submitted
    after the read returned (T1). Returns the device slot and T1."""
    with bufs.route.open(objs.paths[index]) as file:
        header = file.header
        if header.algorithm != arm.algorithm:
            raise ObjectAlgorithmError(f"{objs.paths[index]} is checked with {header.algorithm}, arm {arm.name} "
                                       f"expects {arm.algorithm}")
        span = slice(objs.slots[index], objs.slots[index] + header.padded_nbytes)
        with _part(iv, "read"):
            bufs.route.read(file, bufs.host[span])
        file.check_unchanged()
    return bufs.dev[span], ctx.engine.submit(bufs.host[span], bufs.dev[span], owner=owner)


def _verify_all(objs: ObjectSet, bufs: Buffers, arm: ChecksumArm, slots: list[torch.Tensor]) -> None:
    """Plain arms: every device slot checked after all copies are done."""
    if arm.where == "host":
        bufs.down[:objs.total_padded].copy_(bufs.dev[:objs.total_padded])     # the download (synchronous)
        for index, header in enumerate(objs.headers):
            downloaded = bufs.down[objs.slots[index]:objs.slots[index] + header.padded_nbytes]
            header.verify(memoryview(downloaded.numpy()), str(objs.paths[index]))
        return
    from kmesh.integrity import gpu

    got = gpu.hash_buffers(arm.algorithm, slots, **_params(objs))
    for index, (header, digest) in enumerate(zip(objs.headers, got)):
        if digest != header.digest:
            raise _mismatch(objs, index, arm.algorithm, digest)


def _hash_after(t1: Any, slot: torch.Tensor, arm: ChecksumArm, params: dict[str, Any],
                done: threading.Event) -> bytes:
    """CPU overlap: wait until T1 has copied the object, hash the 'device' slot, then let T2 go."""
    try:
        t1.issued()
        return integrity.get(arm.algorithm).digest(slot.numpy(), **params)
    finally:
        done.set()


def checksum_restore(ctx: ChildContext, child: Child, objs: ObjectSet, bufs: Buffers, arm: ChecksumArm,
                     cache: Any, owner: str, iv: Intervals | None = None) -> torch.Tensor | None:
    """Read, copy to the device landing, verify and copy into bufs.private every object; restore into cache
    (None: stop after the copies). Raises StorageError (nothing pending) for a bad object."""
    entries = objs.catalog.entries
    try:
        with _part(iv, "restore"):
            slots: list[torch.Tensor] = []
            pending: list[tuple[int, Any]] = []
            params = _params(objs)
            for entry in entries:
                dev_slot, t1 = _read_and_copy(ctx, objs, entry.index, bufs, arm, owner, iv)
                slots.append(dev_slot)
                if not arm.overlap:
                    continue
                if arm.where == "gpu":
                    from kmesh.integrity import gpu
                    assert bufs.hash_stream is not None
                    bufs.hash_stream.wait_event(t1.issued())     # device visibility: the hash waits for the copy
                    pending_digest: Any = gpu.hash_async(arm.algorithm, [dev_slot], stream=bufs.hash_stream, **params)
                    done: Any = torch.cuda.Event()
                    done.record(bufs.hash_stream)
                else:
                    done = threading.Event()
                    pending_digest = bufs.pool.submit(_hash_after, t1, dev_slot, arm, params, done)
                pending.append((entry.index, pending_digest))
                # T2 starts after the hash: the device slot is held until both its consumers are done
                ctx.engine.submit(dev_slot[:entry.nbytes], bufs.private[entry.offset:entry.offset + entry.nbytes],
                                  owner=owner, after=done)
            if arm.overlap:
                with _part(iv, "verify"):
                    for index, pending_digest in pending:
                        digest = pending_digest.result()[0] if arm.where == "gpu" else pending_digest.result()
                        if digest != objs.headers[index].digest:
                            raise _mismatch(objs, index, arm.algorithm, digest)
            else:
                ctx.engine.drain(owner=owner)           # every T1 physically done
                with _part(iv, "verify"):
                    _verify_all(objs, bufs, arm, slots)
                for entry, slot in zip(entries, slots):
                    ctx.engine.submit(slot[:entry.nbytes], bufs.private[entry.offset:entry.offset + entry.nbytes],
                                      owner=owner)
            ctx.engine.drain(owner=owner)
            if cache is None:
                return None
            return restore_child(cache, ctx.catalog, bufs.private, child, ctx.runner, ctx.restore_backend)
    finally:
        if ctx.engine.pending(owner):        # a bad object: what was accepted finishes before the error leaves
            ctx.engine.drain(owner=owner)
        if bufs.hash_stream is not None:
            bufs.hash_stream.synchronize()


def timed_checksum_child(ctx: ChildContext, child: Child, objs: ObjectSet, bufs: Buffers, arm: ChecksumArm,
                         iv: Intervals) -> ChildOutcome:
    owner = f"checksum-{arm.name}-{child.name}"
    bufs.poison()     # untimed: a route or copy that delivered nothing cannot pass on earlier bytes
    with iv.part("outer"):
        cache = new_cache(ctx, child)
        restored = checksum_restore(ctx, child, objs, bufs, arm, cache, owner, iv)
        blended, tokens = prefill_and_decode(ctx, child, cache, restored, "repair")
        out = outcome_of(ctx, child, f"storage:{arm.name}", "repair", cache, restored, blended, tokens, None,
                         ["restored", "repaired"])
        release_checked(ctx, owner, bufs.host, bufs.dev, bufs.private)
    return out


def save_sets(export: Any, root: Path, algorithms: list[str], pad_to: int | None,
              tree_chunk_bytes: int) -> dict[str, ObjectSet]:
    """One object set per algorithm (each header records its algorithm and params)."""
    out = {}
    for algo in algorithms:
        directory = root / algo
        shutil.rmtree(directory, ignore_errors=True)
        params = {"chunk_bytes": tree_chunk_bytes} if algo == "sha256-tree" else None
        out[algo] = save_objects(export, directory, algo, pad_to, params=params)
    return out


def corrupt_copy(objs: ObjectSet, export: Any, directory: Path, pad_to: int | None, index: int = 1) -> ObjectSet:
    """A copy of the set whose object `index` has one payload byte flipped (its header unchanged)."""
    from kmesh.storage.objfile import HEADER_BYTES

    shutil.rmtree(directory, ignore_errors=True)
    first = objs.headers[0]
    bad = save_objects(export, directory, first.algorithm, pad_to, params=dict(first.params) or None)
    raw = bytearray(bad.paths[index].read_bytes())
    raw[HEADER_BYTES + 100] ^= 0x01
    bad.paths[index].write_bytes(bytes(raw))
    return bad


@dataclass
class PairRun:
    """Matched pairs of two checksum arms over all children, every run compared with the reference."""

    ctx: ChildContext
    sets: dict[str, ObjectSet]
    bufs: Buffers
    refs: dict[str, ChildOutcome]
    device: torch.device
    compared: int = 0
    identical_runs: int = 0

    def _one(self, arm: ChecksumArm, child: Child, iv: Intervals) -> None:
        out = timed_checksum_child(self.ctx, child, self.sets[arm.algorithm], self.bufs, arm, iv)
        self.compared += 1
        self.identical_runs += identical(compare_states(self.refs[child.name], out))

    def warm(self, names: list[str], child: Child) -> None:
        """One untimed run per arm (compared with the reference like every other run)."""
        dev = "cuda" if self.device.type == "cuda" else "cpu"
        for name in names:
            iv = Intervals(dev)
            self._one(arm_named(name, self.device), child, iv)
            iv.seconds()

    def __call__(self, a_name: str, b_name: str, children: list[Child], pairs: int, warmup: int) -> Any:
        arms = {n: arm_named(n, self.device) for n in (a_name, b_name)}

        def run_arm(name: str, child: Child, iv: Intervals) -> None:
            self._one(arms[name], child, iv)

        paths = [p for objs in self.sets.values() for p in objs.paths]
        return run_pairs(run_arm, (a_name, b_name), children, pairs=pairs, warmup=warmup,
                         device="cuda" if self.device.type == "cuda" else "cpu",
                         between=lambda: routes.drop_page_cache(paths), progress=False)


def refused(ctx: ChildContext, child: Child, bad: ObjectSet, bufs: Buffers, arm: ChecksumArm) -> str | None:
    """Run the arm over a corrupted set: the error's text if it was refused (nothing pending), else None."""
    owner = f"checksum-bad-{arm.name}"
    bufs.poison()
    try:
        checksum_restore(ctx, child, bad, bufs, arm, None, owner)
    except ObjectCorruptError as e:
        release_checked(ctx, owner, bufs.host, bufs.dev, bufs.private)
        return f"{type(e).__name__}: {e}"
    return None
