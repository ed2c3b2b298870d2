"""The end-to-end arm's data path (service load, private copy) against the same bytes moved without them.

A RAG child's segments loaded through a real cache service, then copied private. Issue 22's H200 run at ddc4636
measured, for the 16k RAG child (60 segments, 189 MB), a service load of 17.6 ms (10.7 GB/s) and private copies of
8.0 ms, more than the repair itself. This diagnostic takes the equivalence stage's
setup (`--profile`, default cuda) and its RAG workload (`equivalence.rag.workload`; the 16k variant with `--set
equivalence.rag.workload.chunks=60 --set equivalence.rag.workload.prompt_tokens=16384`), exports the leader, saves
its segments into a real cache service (kmesh.harness.service_side.ServiceSide, its gate opened for good as the
end-to-end arm's) and registers one child staging buffer. Arms, every round each, the order reversed from round to round
(kmesh.bench.rotate), warm-up rounds discarded; host wall-clock from a synchronised start to the end of the call
(a child waits on the host for these anyway):

  load-many        ServiceSegments.prefetch + load_entry of every segment: the end-to-end arm's `load`
                   (one load_many request whose reply comes once every copy ended)
  load-accept      the same request with wait_s=0 (the reply once the service accepted every copy), then one wait
                   for the last: `accept_ms` is the first part alone
  host-floor       the same objects' bytes, in pinned host tensors of this process, copied into the staging spans
                   on one side stream, one synchronise (what the copies cost without the service)
  private-each     kmesh.kv.load.copy_private_each staging -> private (the segments submitted as one batch, the
                   adjacent ones joined into one copy and ticket; one drain): the end-to-end arm's `private-copy`
  private-one-by-one  the same copies submitted one by one (engine.submit per segment, one drain): the path
                   before copy_private_each batched its submits (TransferEngine.submit_many)
  private-floor    the catalog's span of staging copied into private in one device copy

After every load arm the staging spans are compared with the leader's export (a wrong byte stops the run); after
every private arm, private with staging. Output (JSON, --out): per arm the median and quartiles of its times, the
median per-round ratio to its floor, GB/s; with --py-spy S (py-spy installed) a sampling profile of the service
process and of this one during S seconds of extra rounds of load-many + private-each (py-spy's raw format: one
line per stack, thread first, its sample count last), summarised as the top self and inclusive frames per thread.
"""
from __future__ import annotations

import collections
import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kmesh.bench import rotate
from kmesh.diagnostics import DiagnosticError
from kmesh.diagnostics._common import load, parser, write_json
from kmesh.harness.leader import Export
from kmesh.harness.modelsetup import equivalence_setup
from kmesh.harness.service_side import ServiceSide
from kmesh.harness.workload import RagSpec, build_rag
from kmesh.kv.load import copy_private_each, load_entry
from kmesh.kv.sources import ServiceSegments
from kmesh.transfer import TransferEngine

ARMS = ("load-many", "load-accept", "host-floor", "private-each", "private-one-by-one", "private-floor")
FLOOR_OF = {"load-many": "host-floor", "load-accept": "host-floor", "private-each": "private-floor",
            "private-one-by-one": "private-floor"}
TOP_FRAMES = 25


class DataMismatchError(DiagnosticError):
    """A load or copy arm left bytes other than the leader's in its destination."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spans_equal(a: torch.Tensor, b: torch.Tensor, export: Export) -> bool:
    return all(torch.equal(a[e.offset:e.offset + e.nbytes], b[e.offset:e.offset + e.nbytes])
               for e in export.catalog.entries)


def _py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                             "--rate", "2000", "--threads", "--nonblocking", "--format", "raw",
                             "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarise_raw(text: str, top: int = TOP_FRAMES) -> dict[str, Any]:
    """py-spy's raw output (`frame;frame;... count` per line, the thread's name first) summarised per thread: its
    samples, and the frames with the most samples at the top of the stack (self) and anywhere in it (inclusive)."""
    threads: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        n = int(count)
        t = threads.setdefault(frames[0], {"samples": 0, "self": collections.Counter(),
                                           "inclusive": collections.Counter()})
        t["samples"] += n
        t["self"][frames[-1]] += n
        for f in set(frames[1:]):
            t["inclusive"][f] += n
    return {name: {"samples": t["samples"], "self": t["self"].most_common(top),
                   "inclusive": t["inclusive"].most_common(top)}
            for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"])}


def main(argv: list[str] | None = None) -> int:
    p = parser("service_load", __doc__, config=True, out=True)
    p.add_argument("--rounds", type=int, default=15, help="kept rounds (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="discarded rounds first (default 3)")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="S",
                   help="seconds of py-spy sampling of the service and this process (0: none)")
    args = p.parse_args(argv)
    cfg = load(args)
    setup = equivalence_setup(cfg)
    device = setup.device
    workload = build_rag(setup.tok, cfg.seed, RagSpec(**setup.sec["rag"]["workload"]))
    export = setup.export_leader(workload, b"kmesh-diag/service-load")
    entries = list(export.catalog.entries)
    nbytes = sum(e.nbytes for e in entries)
    span = slice(entries[0].offset, entries[-1].offset + entries[-1].nbytes)
    host = [export.raw[e.offset:e.offset + e.nbytes].cpu().pin_memory() if device.type == "cuda"
            else export.raw[e.offset:e.offset + e.nbytes].clone() for e in entries]
    side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    engine = TransferEngine(str(device))
    private = torch.empty(export.catalog.nbytes, dtype=torch.uint8, device=device)
    accept_s: list[float] = []
    sec = setup.sec
    with ServiceSide.start(export, device, float(sec["heartbeat_timeout_s"]), int(sec["chunk_bytes"])) as svc:
        svc.save_leader()
        svc.unpace()
        with svc.staging("diag-load") as staging:
            dst = staging.tensor

            def load_many() -> None:
                source = ServiceSegments(svc.client, staging.reg)
                source.prefetch(entries)
                for e in entries:
                    load_entry(source, dst, e)

            def load_accept() -> None:
                t0 = time.perf_counter()
                r = svc.client.load_many(staging.reg, [(e.key, e.offset) for e in entries], wait_s=0.0)
                accept_s.append(time.perf_counter() - t0)
                if r["stopped_at"] is not None:
                    raise DiagnosticError(f"load_many stopped at item {r['stopped_at']}: {r['error']}")
                for req in r["reqs"]:
                    got = svc.client.wait(req, timeout=60.0)
                    if got["state"] != "done":
                        raise DiagnosticError(f"load {req} ended {got['state']}: {got.get('error')}")

            def host_floor() -> None:
                ctx = torch.cuda.stream(side_stream) if side_stream is not None else contextlib.nullcontext()
                with ctx:
                    for e, h in zip(entries, host):
                        dst[e.offset:e.offset + e.nbytes].copy_(h, non_blocking=side_stream is not None)

            def private_each() -> None:
                copy_private_each(engine, dst, private, entries, "diag-private")

            def private_one_by_one() -> None:
                for e in entries:
                    engine.submit(dst[e.offset:e.offset + e.nbytes], private[e.offset:e.offset + e.nbytes],
                                  owner="diag-private")
                engine.drain(owner="diag-private")

            def private_floor() -> None:
                private[span].copy_(dst[span])

            calls: dict[str, Callable[[], None]] = {"load-many": load_many, "load-accept": load_accept,
                                                    "host-floor": host_floor, "private-each": private_each,
                                                    "private-one-by-one": private_one_by_one,
                                                    "private-floor": private_floor}

            def run_arm(arm: str, _round: int) -> dict[str, list[float]]:
                if arm.startswith("private"):
                    private.fill_(0x5A)
                else:
                    dst.fill_(0xA5)
                _sync(device)
                t0 = time.perf_counter()
                calls[arm]()
                _sync(device)
                seconds = time.perf_counter() - t0
                want = export.raw if not arm.startswith("private") else dst
                got = dst if not arm.startswith("private") else private
                if not _spans_equal(got, want, export):
                    raise DataMismatchError(f"arm {arm}: its destination differs from the leader's bytes")
                return {"total": [seconds]}

            rounds = rotate(ARMS, args.rounds, args.warmup, run_arm, progress=True, label="service load")
            profile: dict[str, Any] = {}
            if args.py_spy > 0:
                profile = _profile(svc.h.service.pid, args.py_spy, load_many, private_each, device)
    engine.close()
    out = {"model": setup.what, "device": str(device), "segments": len(entries), "bytes": nbytes,
           "rounds": args.rounds, "warmup": args.warmup, "arms": _summary(rounds, nbytes),
           "accept_ms_median": statistics.median(accept_s[args.warmup:]) * 1e3 if accept_s else None,
           "profile": profile}
    write_json(args.out, out, cfg)
    return 0


def _summary(rounds: Any, nbytes: int) -> dict[str, Any]:
    per_arm: dict[str, list[float]] = {arm: [r[arm]["total"][0] for r in rounds.records] for arm in ARMS}
    out: dict[str, Any] = {}
    for arm, xs in per_arm.items():
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        row: dict[str, Any] = {"median_ms": statistics.median(xs) * 1e3, "q1_ms": q[0] * 1e3, "q3_ms": q[2] * 1e3,
                               "gb_per_s": nbytes / statistics.median(xs) / 1e9}
        floor = FLOOR_OF.get(arm)
        if floor is not None:
            ratios = [a / b for a, b in zip(xs, per_arm[floor])]
            row[f"ratio_to_{floor}_median"] = statistics.median(ratios)
        out[arm] = row
    return out


def _profile(service_pid: int, seconds: float, load_many: Callable[[], None], private_each: Callable[[], None],
             device: torch.device) -> dict[str, Any]:
    """py-spy of the service and of this process while the two child arms run back to back for `seconds`."""
    if shutil.which("py-spy") is None:
        return {"skipped": "py-spy is not installed"}
    tmp = Path(tempfile.mkdtemp(prefix="kmesh-pyspy-"))
    procs = {"service": (_py_spy(service_pid, seconds, tmp / "service.txt"), tmp / "service.txt"),
             "client": (_py_spy(os.getpid(), seconds, tmp / "client.txt"), tmp / "client.txt")}
    time.sleep(0.5)          # py-spy attaches before the rounds start
    end, rounds = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        load_many()
        private_each()
        _sync(device)
        rounds += 1
    out: dict[str, Any] = {"rounds": rounds, "seconds": seconds}
    for name, (proc, path) in procs.items():
        assert proc is not None
        _, err = proc.communicate(timeout=seconds + 60)
        if proc.returncode != 0 or not path.exists():
            out[name] = {"error": f"py-spy exited {proc.returncode}: {err.decode(errors='replace')[-400:]}"}
        else:
            out[name] = summarise_raw(path.read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    return out
