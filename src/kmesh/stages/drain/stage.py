"""Stage `drain` (write-up §23): no memory is reused before accepted copies physically complete.

This process is the memory OWNER and would-be REUSER; a separate OS process (kmesh.stages.drain.client, started
by kmesh.stages.drain.copier) does the copying. Shared buffers are POSIX shm segments with 4 KiB canaries on both
sides (kmesh.stages.drain.owner). The copy is gated chunk by chunk (ChunkGate), so "still in flight" is a state the
stage creates on purpose, not a timing hope.

Six cases {d2h, h2d} × {success, error_completable, refused_then_ok}, each checking:
- the copy is provably mid-flight (1 of N chunks landed) when reuse is attempted, and the reuser is refused
  (owner side: the SharedLedger shows the copier's holds; copier side: engine.release raises BufferHeldError);
- data correct after the final drain, compared with an independent int64 reference;
- after the final drain no holds remain (engine and ledger); the reuser then writes sentinels, the copier's
  engine is closed, and the sentinels are intact (nothing wrote after the reclaim); canaries intact;
- nothing leaks: /dev/shm entries, open fds and mapped segments of this process return to their start values.
A seventh case kills the copier with SIGKILL mid-copy: reclaim is refused until the pidfd reports the exit;
then the copy is seen stopped exactly where the gate held it, holds are reaped, nothing leaks.
CPU profile: the "device" is a second shm segment written by the copier's worker thread.
cuda profile: device buffers are GPU memory of the copier; host segments are page-locked (cudaHostRegister).
"""
from __future__ import annotations

import os

import torch

from kmesh.config import Config
from kmesh.errors import StageError
from kmesh.result import Result
from kmesh.stages.drain.cases import Setting, run_kill_case, run_transfer_case
from kmesh.stages.drain.copier import CopierProcess
from kmesh.stages.drain.protocol import CANARY
from kmesh.transfer import shm

DIRECTIONS = ("d2h", "h2d")
MODES = ("success", "error_completable", "refused_then_ok")


def setting(cfg: Config) -> Setting:
    sec = cfg.section("drain")
    device = sec.get("device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise StageError("drain.device is cuda but no CUDA device is available")
    nbytes, chunk = int(sec.get("nbytes", 4 << 20)), int(sec.get("chunk_bytes", 256 << 10))
    if nbytes % chunk or nbytes // chunk < 4 or nbytes % 4:
        raise StageError(f"drain.nbytes ({nbytes}) must be a multiple of drain.chunk_bytes ({chunk}) "
                         f"with at least 4 chunks")
    need = 2 * (nbytes + 2 * CANARY) + (2 if device == "cpu" else 0) * (nbytes + 2 * CANARY) + (1 << 20)
    fs = os.statvfs(shm.SHM_DIR)
    if fs.f_bavail * fs.f_frsize < need:
        raise StageError(f"/dev/shm has {fs.f_bavail * fs.f_frsize} bytes free, the drain stage needs {need} "
                         f"(lower drain.nbytes or enlarge /dev/shm)")
    log_dir = cfg.stage_dir("drain")
    return Setting(device, nbytes, chunk, float(sec.get("drain_timeout_s", 0.2)), float(sec.get("wait_s", 60)),
                   int(sec.get("bench_reps", 7)), int(cfg.data["timing"]["warmup"]),
                   int(sec.get("producer_cycles", 50_000_000)), log_dir)


def run(cfg: Config) -> Result:
    settings = setting(cfg)
    res = Result.begin("drain", cfg)
    res.extra["device"] = settings.device
    res.extra["nbytes"] = settings.nbytes
    res.extra["chunk_bytes"] = settings.chunk_bytes
    sizes = {"device": settings.device, "nbytes": settings.nbytes, "chunk_bytes": settings.chunk_bytes}
    base = f"kmesh-drain-{os.getpid()}"
    index = 0
    copier = CopierProcess(settings.device, settings.log_dir / "copier.log")
    try:
        for direction in DIRECTIONS:
            for mode in MODES:
                case_id = f"{direction}-{mode}"
                with res.case(case_id, {"direction": direction, "mode": mode, **sizes,
                                        "copier_pid": copier.pid}) as case:
                    res.timings[case_id] = run_transfer_case(case, settings, copier, direction, mode,
                                                             cfg.seed + index, f"{base}-{index}")
                index += 1
    finally:
        res.extra["copier_exit"] = copier.finish(settings.wait_s)
    with res.case("client-sigkill", {**sizes, "gated_chunks": 2}) as case:
        res.timings["client-sigkill"] = run_kill_case(case, settings, cfg.seed + index, f"{base}-{index}")
    for case in res.cases:
        res.timings.setdefault(case.id, {})["case_s"] = case.seconds
    return res
