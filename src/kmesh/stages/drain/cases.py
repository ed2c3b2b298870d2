"""The drain stage's cases: one of {d2h, h2d} x {success, error_completable, refused_then_ok} through the copier
process, and the copier killed with SIGKILL mid-copy (what each checks: kmesh.stages.drain.stage)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kmesh.result import Case
from kmesh.stages.drain.copier import CopierProcess
from kmesh.stages.drain.owner import SENTINEL, Buffer, Reuser, expected_pattern, leak_counts, owner_world, wait_until
from kmesh.stages.drain.protocol import POISON
from kmesh.transfer import HolderAliveError, SharedLedger
from kmesh.transfer.ledger import exited


@dataclass
class Setting:
    """What every case runs with (kmesh.stages.drain.stage.setting reads it from the config)."""

    device: str
    nbytes: int
    chunk_bytes: int
    drain_timeout_s: float
    wait_s: float
    bench_reps: int
    bench_warmup: int
    producer_cycles: int
    log_dir: Path


def run_transfer_case(case: Case, setting: Setting, copier: CopierProcess, direction: str, mode: str, seed: int,
                      prefix: str, ignore_holds: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One of the six cases; returns its timings."""
    timings: dict[str, Any] = {}
    before = leak_counts(prefix)
    gpu = setting.device == "cuda"
    expected = expected_pattern(setting.nbytes, seed)
    src, dst = ("dev", "host") if direction == "d2h" else ("host", "dev")
    names = ["host"] if gpu else ["host", "dev"]
    faults = {"chunk_bytes": setting.chunk_bytes, "fail_after_submit": int(mode == "error_completable"),
              "refuse_first_drain": int(mode == "refused_then_ok")}
    with owner_world(prefix, names, setting.nbytes) as (ledger, bufs):
        # Owner-side fills: host source gets the pattern, host destination the poison.
        if "host" in bufs:
            bufs["host"].payload().copy_(torch.from_numpy(expected) if src == "host" else
                                         torch.full((setting.nbytes,), POISON, dtype=torch.uint8))
        spec = {n: {"seg": bufs[n].seg.name if n in bufs else None, "nbytes": setting.nbytes,
                    "fill": ("pattern" if n == src else "poison") if n == "dev" else None,
                    "seed": seed, "producer_cycles": setting.producer_cycles} for n in ("host", "dev")}
        reuser = Reuser(ledger, ignore_holds)
        during = leak_counts(prefix)
        case.check("leak_counter_sees_segments", len(during["dev_shm"]) == len(bufs) + 1, during["dev_shm"])
        try:
            setup = copier.setup(buffers=spec, ledger=ledger.name, faults=faults)
            case.record("copier_pid", setup["pid"])
            case.check("separate_processes", setup["pid"] != os.getpid(), setup["pid"])
            if gpu:
                case.check("host_pinned", setup["pinned"]["host"] is True, setup["pinned"])
            sub = copier.call("submit", src=src, dst=dst)
            timings["submit_s"] = sub["submit_s"]
            tid, total = sub["ticket"], sub["chunks_total"]
            if mode == "error_completable":
                case.check("submit_raised_typed_error_with_pending",
                           sub["error"] == "SubmitError" and sub["pending"] == [tid], sub)
            else:
                case.check("submit_ok", sub["error"] is None, sub)

            # Let exactly one chunk through: the copy is now physically mid-flight.
            copier.gate.allow(1)
            wait_until(lambda: copier.call("progress", ticket=tid)["chunks_done"] >= 1, setting.wait_s, "first chunk")
            prog = copier.call("progress", ticket=tid)
            case.check("mid_flight", prog["chunks_done"] == 1 and total > 1 and prog["state"] == "pending", prog)
            if not gpu or dst == "host":
                landed = _observe_dst(bufs[dst], expected, setting.chunk_bytes, wait_s=setting.wait_s)
                case.check("dst_partly_written", landed == (True, False), landed)
            _check_reuse_refused(case, "pending", reuser, bufs, ledger, copier, src, dst)

            if mode == "refused_then_ok":
                r1 = copier.call("drain", tickets=[tid], timeout=None)
                case.check("first_drain_refused", r1["error"] == "DrainRefusedError" and r1["pending"] == [tid], r1)
                _check_reuse_refused(case, "after_refusal", reuser, bufs, ledger, copier, src, dst)
                r2 = copier.call("drain", tickets=[tid], timeout=setting.drain_timeout_s)
                case.check("second_drain_timed_out", r2["error"] == "DrainTimeoutError" and r2["pending"] == [tid], r2)
                prog2 = copier.call("progress", ticket=tid)
                case.check("no_resubmit_no_progress_while_gated", prog2["chunks_done"] == 1, prog2)
                _check_reuse_refused(case, "after_timeout", reuser, bufs, ledger, copier, src, dst)
                timings["refused_drain_s"] = r1["drain_s"]
                timings["timed_out_drain_s"] = r2["drain_s"]

            copier.gate.open()
            final = copier.call("drain", tickets=sub["pending"] if mode == "error_completable" else [tid], timeout=None)
            timings["final_drain_s"] = final["drain_s"]
            case.check("final_drain_done", final["error"] is None and final["done"] == [tid], final)
            holds = copier.call("holds")
            case.check("no_holds_after_drain", holds["live"] == 0 and holds["pending"] == [] and ledger.live() == 0,
                       {**holds, "ledger": ledger.live()})

            # Data where the copy succeeded: compare with the independent reference.
            _check_data(case, "data_correct", copier, bufs, dst, expected)
            if mode == "success" and setting.bench_reps:
                bm = copier.call("bench", src=src, dst=dst, reps=setting.bench_reps, warmup=setting.bench_warmup)
                med = statistics.median(bm["seconds"])
                timings["copy_round_trip_s"] = {"median": med, "all": bm["seconds"],
                                                "gbps": bm["nbytes"] / med / 1e9, "nbytes": bm["nbytes"],
                                                "warmup_excluded": setting.bench_warmup}
                _check_data(case, "data_correct_after_bench", copier, bufs, dst, expected)

            # Reuse is allowed now; then the copier's engine shuts down; sentinels must survive that.
            for name, buf in bufs.items():
                case.check(f"reclaim_allowed_after_drain:{name}", reuser.try_reclaim(name, buf), None)
            if gpu:
                ru = copier.call("reuse_device", name="dev", sentinel=SENTINEL)
                case.check("device_reuse_after_drain", ru["release_raised"] is None and ru["sentinel_intact"], ru)
            closed = copier.end_case()
        except BaseException:
            copier.close_gate()  # a failing case must not leave the copier blocked on the gate...
            with contextlib.suppress(Exception):
                copier.end_case()  # ...nor its engine open for the next case
            raise
        case.check("copier_case_closed_clean", closed["live_holds"] == 0 and closed["live_segments"] == 0
                   and closed["mapped_shm"] == 0 and closed["fds"] == closed["idle_fds"], closed)
        intact = reuser.sentinels_intact()
        case.check("sentinels_intact_after_copier_stopped", all(intact.values()) and len(intact) == len(bufs), intact)
        attempts = 1 + 2 * (mode == "refused_then_ok")
        case.check("reuser_refused_while_pending", reuser.refused == len(bufs) * attempts,
                   {"refused": reuser.refused, "expected": len(bufs) * attempts})
        case.check("canaries_intact", all(b.canaries_intact() for b in bufs.values()), None)
    after = leak_counts(prefix)
    case.check("no_leaks", after == before, {"before": before, "after": after})
    return timings


def _check_data(case: Case, name: str, copier: CopierProcess, bufs: dict[str, Buffer], dst: str,
                expected: np.ndarray) -> None:
    if dst in bufs:
        got = bufs[dst].payload().numpy()
        case.check(name, bool(np.array_equal(got, expected)), int((got != expected).sum()))
    else:
        want = hashlib.sha256(expected.tobytes()).hexdigest()
        got_d = copier.call("digest", name=dst)["sha256"]
        case.check(name, got_d == want, got_d)


def _observe_dst(buf: Buffer, expected: np.ndarray, chunk: int, wait_s: float) -> tuple[bool, bool]:
    """(first chunk equals the reference, rest equals the reference): the copy's footprint in the owner's view."""
    view = buf.payload().numpy()
    wait_until(lambda: np.array_equal(view[:chunk], expected[:chunk]), wait_s, "first chunk visible to the owner")
    return bool(np.array_equal(view[:chunk], expected[:chunk])), bool(np.array_equal(view[chunk:], expected[chunk:]))


def _check_reuse_refused(case: Case, when: str, reuser: Reuser, bufs: dict[str, Buffer], ledger: SharedLedger,
                         copier: CopierProcess, src: str, dst: str) -> None:
    took = {n: reuser.try_reclaim(n, b) for n, b in bufs.items()}
    case.check(f"owner_reuse_refused_{when}", not any(took.values()),
               {"reclaimed": took, "ledger_holds": len(ledger.holds(pid=copier.pid))})
    rel = copier.call("release", names=[src, dst])["raised"]
    case.check(f"copier_release_raises_{when}", all(v == "BufferHeldError" for v in rel.values()), rel)


def run_kill_case(case: Case, setting: Setting, seed: int, prefix: str, k_chunks: int = 2) -> dict[str, Any]:
    """Copier killed mid-copy (a d2h copy k chunks in, and a queued h2d copy): reclaim only after exit."""
    timings: dict[str, Any] = {}
    before = leak_counts(prefix)
    gpu = setting.device == "cuda"
    expected = expected_pattern(setting.nbytes, seed)
    names = ["host_a", "host_b"] + ([] if gpu else ["dev_a", "dev_b"])
    with owner_world(prefix, names, setting.nbytes) as (ledger, bufs):
        bufs["host_a"].payload().fill_(POISON)
        bufs["host_b"].payload().copy_(torch.from_numpy(expected))
        spec = {n: {"seg": bufs[n].seg.name if n in bufs else None, "nbytes": setting.nbytes,
                    "fill": {"dev_a": "pattern", "dev_b": "poison"}.get(n), "seed": seed,
                    "producer_cycles": setting.producer_cycles} for n in ("host_a", "host_b", "dev_a", "dev_b")}
        reuser = Reuser(ledger)
        copier = CopierProcess(setting.device, setting.log_dir / "copier-sigkill.log")
        try:
            copier.setup(buffers=spec, ledger=ledger.name, faults={"chunk_bytes": setting.chunk_bytes})
            d2h = copier.call("submit", src="dev_a", dst="host_a")
            h2d = copier.call("submit", src="host_b", dst="dev_b")
            copier.gate.allow(k_chunks)
            wait_until(lambda: copier.call("progress", ticket=d2h["ticket"])["chunks_done"] >= k_chunks, setting.wait_s,
                       f"{k_chunks} chunks issued")
            cut = k_chunks * setting.chunk_bytes
            landed = bufs["host_a"].payload().numpy()
            wait_until(lambda: np.array_equal(landed[:cut], expected[:cut]),  # noqa: F821 - runs before `del landed`
                       setting.wait_s, "k chunks visible")
            held = ledger.holds(pid=copier.pid)
            case.check("holds_visible_in_ledger", len(held) == (2 if gpu else 4), [h.__dict__ for h in held])
            refusal: HolderAliveError | None = None
            try:
                ledger.reap(copier.pid, copier.pidfd)
            except HolderAliveError as e:
                refusal = e
            case.check("reap_refused_while_alive", refusal is not None,
                       str(refusal) if refusal is not None else "reaped a live process")

            t_kill = time.perf_counter()
            os.kill(copier.pid, signal.SIGKILL)
            took = {n: reuser.try_reclaim(n, bufs[n]) for n in bufs}
            dead_now = exited(copier.pidfd)
            case.check("reclaim_refused_until_exit_observed", not any(took.values()),
                       {"reclaimed": took, "pidfd_readable_at_attempt": dead_now})
            case.check("pidfd_reports_exit", exited(copier.pidfd, timeout=setting.wait_s), None)
            timings["kill_to_exit_s"] = time.perf_counter() - t_kill
            rc = copier.proc.wait(timeout=setting.wait_s)
            case.check("killed_by_sigkill", rc == -signal.SIGKILL, rc)
            reaped = ledger.reap(copier.pid, copier.pidfd)
            case.check("holds_reaped_after_exit", reaped == len(held) and ledger.live() == 0,
                       {"reaped": reaped, "left": ledger.live()})
            # Physically complete = stopped: exactly the gated chunks landed, the rest is untouched poison.
            case.check("copy_stopped_where_gated",
                       bool(np.array_equal(landed[:cut], expected[:cut]) and (landed[cut:] == POISON).all()),
                       {"chunks_landed": k_chunks, "bytes": cut})
            case.check("queued_copy_source_untouched", bool(np.array_equal(bufs["host_b"].payload().numpy(),
                                                                        expected)), None)
            for name, buf in bufs.items():
                case.check(f"reclaim_allowed_after_reap:{name}", reuser.try_reclaim(name, buf), None)
            case.check("no_process_left", not Path(f"/proc/{copier.pid}").exists(), copier.pid)
            del landed  # a view into the segment: the segment cannot be unmapped while it lives
        finally:
            rc = copier.finish(setting.wait_s)
        intact = reuser.sentinels_intact()
        case.check("sentinels_intact", all(intact.values()) and len(intact) == len(bufs), intact)
        case.check("canaries_intact", all(b.canaries_intact() for b in bufs.values()), None)
        case.record("submitted", {"d2h": d2h["ticket"], "h2d": h2d["ticket"]})
    after = leak_counts(prefix)
    case.check("no_leaks", after == before, {"before": before, "after": after})
    return timings


