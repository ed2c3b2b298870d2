"""Stage `drain` (write-up §23): no memory is reused before accepted copies physically complete.

This process is the memory OWNER and would-be REUSER; a separate OS process (kmesh.stages.drain_client)
does the copying. Shared buffers are POSIX shm segments with 4 KiB canaries on both sides. The copy is gated
chunk by chunk (ChunkGate), so "still in flight" is a state the stage creates on purpose, not a timing hope.

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

import contextlib
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from kmesh import shm
from kmesh.config import Config
from kmesh.errors import StageError
from kmesh.result import Case, Result
from kmesh.stages.drain_client import CANARY, POISON
from kmesh.transfer import ChunkGate, HolderAliveError, SharedLedger
from kmesh.transfer.ledger import exited

CANARY_BYTE = 0xC3
SENTINEL = 0x5A  # written by the would-be reuser into memory it reclaimed
DIRECTIONS = ("d2h", "h2d")
MODES = ("success", "error_completable", "refused_then_ok")


def expected_pattern(n_bytes: int, seed: int) -> np.ndarray:
    """Independent reference of drain_client.pattern (numpy uint64 math), as bytes."""
    i = np.arange(n_bytes // 4, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed)) & np.uint64(0x7FFFFFFF)).astype("<i4").view(np.uint8)


# -- the copier process -------------------------------------------------------------------------------
class CopierProcess:
    """A drain_client subprocess with a control socket and a pidfd; each case gets a fresh ChunkGate."""

    def __init__(self, device: str, log: Path) -> None:
        mine, theirs = socket.socketpair()
        self._log = open(log, "ab")
        cmd = [sys.executable, "-m", "kmesh.stages.drain_client", "--ctl", str(theirs.fileno()), "--device", device]
        self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdout=self._log, stderr=subprocess.STDOUT)
        self.pidfd = os.pidfd_open(self.proc.pid)  # opened while the child surely exists: no pid reuse race
        theirs.close()
        self.sock = mine
        self._f = mine.makefile("rwb", buffering=0)
        self.gate: ChunkGate | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, op: str, fds: tuple[int, ...] = (), **kw: Any) -> dict[str, Any]:
        msg = {"op": op, **kw, **({"nfds": len(fds)} if fds else {})}
        self._f.write((json.dumps(msg) + "\n").encode())
        if fds:
            socket.send_fds(self.sock, [b"F"], list(fds))
        line = self._f.readline()
        if not line:
            raise StageError(f"copier process {self.pid} closed its control socket during {op!r} "
                             f"(exit {self.proc.poll()})")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise StageError(f"copier {op!r} failed: {reply['exc']}: {reply['message']}")
        return reply

    def setup(self, **kw: Any) -> dict[str, Any]:
        """Start a case in the copier with a fresh gate (its read end travels by SCM_RIGHTS)."""
        self.gate = ChunkGate()
        try:
            return self.call("setup", fds=(self.gate.read_fd,), **kw)
        finally:
            os.close(self.gate.read_fd)  # only the copier reads tokens
            self.gate.read_fd = None  # type: ignore[assignment]

    def end_case(self) -> dict[str, Any]:
        try:
            return self.call("end_case")
        finally:
            self.close_gate()

    def close_gate(self) -> None:
        if self.gate is not None:
            self.gate.open()
            self.gate = None

    def finish(self, timeout: float) -> int:
        """Ask it to exit (if alive), wait, and release every fd this side holds."""
        try:
            if self.proc.poll() is None and not exited(self.pidfd):
                with contextlib.suppress(OSError, StageError):
                    self.call("exit")
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.close_gate()
            self._f.close()
            self.sock.close()
            os.close(self.pidfd)
            self._log.close()
        return rc


# -- owner-side buffers and the would-be reuser ----------------------------------------------------------
@dataclass
class Buffer:
    """A payload inside a named segment, surrounded by canaries."""

    seg: shm.Segment
    nbytes: int

    @classmethod
    def create(cls, name: str, nbytes: int) -> "Buffer":
        seg = shm.Segment.create(nbytes + 2 * CANARY, name=name)
        seg.tensor().fill_(CANARY_BYTE)
        return cls(seg, nbytes)

    def payload(self) -> torch.Tensor:
        return self.seg.tensor(torch.uint8, (self.nbytes,), CANARY)

    def canaries_intact(self) -> bool:
        whole = self.seg.tensor()
        return bool((whole[:CANARY] == CANARY_BYTE).all() and (whole[CANARY + self.nbytes:] == CANARY_BYTE).all())


@dataclass
class Reuser:
    """Wants the memory back as early as possible; takes it only when the ledger shows no holds on it.

    ignore_holds names buffers it takes regardless: the negative control proving the sentinel check (early reuse
    of a destination) and the data check (early reuse of a source) do catch reuse while a copy is pending.
    """

    ledger: SharedLedger
    ignore_holds: frozenset[str] = frozenset()
    refused: int = 0
    reclaimed: dict[str, Buffer] = field(default_factory=dict)

    def try_reclaim(self, name: str, buf: Buffer) -> bool:
        if name in self.reclaimed:
            return True
        if self.ledger.holds(buf.seg.tag, CANARY, CANARY + buf.nbytes) and name not in self.ignore_holds:
            self.refused += 1
            return False
        buf.payload().fill_(SENTINEL)  # the next request's state
        self.reclaimed[name] = buf
        return True

    def sentinels_intact(self) -> dict[str, bool]:
        return {n: bool((b.payload() == SENTINEL).all()) for n, b in self.reclaimed.items()}


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll an observable condition until true; fails loudly (never passes) when the deadline passes."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise StageError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.001)
    return time.monotonic() - t0


def leak_counts(prefix: str) -> dict[str, Any]:
    return {"dev_shm": shm.dev_shm_entries(prefix), "fds": shm.open_fds(), "live_segments": shm.live_segments(),
            "mapped_shm": shm.mapped_shm(prefix=prefix)}


# -- one case -------------------------------------------------------------------------------------------
@dataclass
class Setting:
    device: str
    nbytes: int
    chunk_bytes: int
    drain_timeout_s: float
    wait_s: float
    bench_reps: int
    bench_warmup: int
    producer_cycles: int
    log_dir: Path


@contextlib.contextmanager
def owner_world(prefix: str, names: list[str], nbytes: int) -> Iterator[tuple[SharedLedger, dict[str, Buffer]]]:
    """The owner's ledger and named buffers for one case; all closed and unlinked afterwards."""
    ledger = SharedLedger.create(f"{prefix}-ledger", slots=64)
    bufs: dict[str, Buffer] = {}
    try:
        for n in names:
            bufs[n] = Buffer.create(f"{prefix}-{n}", nbytes)
        yield ledger, bufs
    finally:
        # A failing case's traceback can still hold views; then a mapping stays (and no_leaks says so).
        for b in bufs.values():
            b.seg.unlink()
            with contextlib.suppress(shm.SegmentBusyError):
                b.seg.close()
        ledger.unlink()
        with contextlib.suppress(shm.SegmentBusyError):
            ledger.close()


def run_transfer_case(c: Case, s: Setting, cp: CopierProcess, direction: str, mode: str, seed: int,
                      prefix: str, ignore_holds: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One of the six cases; returns its timings."""
    timings: dict[str, Any] = {}
    before = leak_counts(prefix)
    gpu = s.device == "cuda"
    expected = expected_pattern(s.nbytes, seed)
    src, dst = ("dev", "host") if direction == "d2h" else ("host", "dev")
    names = ["host"] if gpu else ["host", "dev"]
    faults = {"chunk_bytes": s.chunk_bytes, "fail_after_submit": int(mode == "error_completable"),
              "refuse_first_drain": int(mode == "refused_then_ok")}
    with owner_world(prefix, names, s.nbytes) as (ledger, bufs):
        # Owner-side fills: host source gets the pattern, host destination the poison.
        if "host" in bufs:
            bufs["host"].payload().copy_(torch.from_numpy(expected) if src == "host" else
                                         torch.full((s.nbytes,), POISON, dtype=torch.uint8))
        spec = {n: {"seg": bufs[n].seg.name if n in bufs else None, "nbytes": s.nbytes,
                    "fill": ("pattern" if n == src else "poison") if n == "dev" else None,
                    "seed": seed, "producer_cycles": s.producer_cycles} for n in ("host", "dev")}
        reuser = Reuser(ledger, ignore_holds)
        during = leak_counts(prefix)
        c.check("leak_counter_sees_segments", len(during["dev_shm"]) == len(bufs) + 1, during["dev_shm"])
        try:
            setup = cp.setup(buffers=spec, ledger=ledger.name, faults=faults)
            c.record("copier_pid", setup["pid"])
            c.check("separate_processes", setup["pid"] != os.getpid(), setup["pid"])
            if gpu:
                c.check("host_pinned", setup["pinned"]["host"] is True, setup["pinned"])
            sub = cp.call("submit", src=src, dst=dst)
            timings["submit_s"] = sub["submit_s"]
            tid, total = sub["ticket"], sub["chunks_total"]
            if mode == "error_completable":
                c.check("submit_raised_typed_error_with_pending",
                        sub["error"] == "SubmitError" and sub["pending"] == [tid], sub)
            else:
                c.check("submit_ok", sub["error"] is None, sub)

            # Let exactly one chunk through: the copy is now physically mid-flight.
            cp.gate.allow(1)
            wait_until(lambda: cp.call("progress", ticket=tid)["chunks_done"] >= 1, s.wait_s, "first chunk")
            prog = cp.call("progress", ticket=tid)
            c.check("mid_flight", prog["chunks_done"] == 1 and total > 1 and prog["state"] == "pending", prog)
            if not gpu or dst == "host":
                landed = _observe_dst(bufs[dst], expected, s.chunk_bytes, wait_s=s.wait_s)
                c.check("dst_partly_written", landed == (True, False), landed)
            _check_reuse_refused(c, "pending", reuser, bufs, ledger, cp, src, dst)

            if mode == "refused_then_ok":
                r1 = cp.call("drain", tickets=[tid], timeout=None)
                c.check("first_drain_refused", r1["error"] == "DrainRefusedError" and r1["pending"] == [tid], r1)
                _check_reuse_refused(c, "after_refusal", reuser, bufs, ledger, cp, src, dst)
                r2 = cp.call("drain", tickets=[tid], timeout=s.drain_timeout_s)
                c.check("second_drain_timed_out", r2["error"] == "DrainTimeoutError" and r2["pending"] == [tid], r2)
                prog2 = cp.call("progress", ticket=tid)
                c.check("no_resubmit_no_progress_while_gated", prog2["chunks_done"] == 1, prog2)
                _check_reuse_refused(c, "after_timeout", reuser, bufs, ledger, cp, src, dst)
                timings["refused_drain_s"] = r1["drain_s"]
                timings["timed_out_drain_s"] = r2["drain_s"]

            cp.gate.open()
            final = cp.call("drain", tickets=sub["pending"] if mode == "error_completable" else [tid], timeout=None)
            timings["final_drain_s"] = final["drain_s"]
            c.check("final_drain_done", final["error"] is None and final["done"] == [tid], final)
            h = cp.call("holds")
            c.check("no_holds_after_drain", h["live"] == 0 and h["pending"] == [] and ledger.live() == 0,
                    {**h, "ledger": ledger.live()})

            # Data where the copy succeeded: compare with the independent reference.
            _check_data(c, "data_correct", cp, bufs, dst, expected)
            if mode == "success" and s.bench_reps:
                bm = cp.call("bench", src=src, dst=dst, reps=s.bench_reps, warmup=s.bench_warmup)
                med = statistics.median(bm["seconds"])
                timings["copy_round_trip_s"] = {"median": med, "all": bm["seconds"],
                                                "gbps": bm["nbytes"] / med / 1e9, "nbytes": bm["nbytes"],
                                                "warmup_excluded": s.bench_warmup}
                _check_data(c, "data_correct_after_bench", cp, bufs, dst, expected)

            # Reuse is allowed now; then the copier's engine shuts down; sentinels must survive that.
            for n, buf in bufs.items():
                c.check(f"reclaim_allowed_after_drain:{n}", reuser.try_reclaim(n, buf), None)
            if gpu:
                ru = cp.call("reuse_device", name="dev", sentinel=SENTINEL)
                c.check("device_reuse_after_drain", ru["release_raised"] is None and ru["sentinel_intact"], ru)
            closed = cp.end_case()
        except BaseException:
            cp.close_gate()  # a failing case must not leave the copier blocked on the gate...
            with contextlib.suppress(Exception):
                cp.end_case()  # ...nor its engine open for the next case
            raise
        c.check("copier_case_closed_clean", closed["live_holds"] == 0 and closed["live_segments"] == 0
                and closed["mapped_shm"] == 0 and closed["fds"] == closed["idle_fds"], closed)
        intact = reuser.sentinels_intact()
        c.check("sentinels_intact_after_copier_stopped", all(intact.values()) and len(intact) == len(bufs), intact)
        attempts = 1 + 2 * (mode == "refused_then_ok")
        c.check("reuser_refused_while_pending", reuser.refused == len(bufs) * attempts,
                {"refused": reuser.refused, "expected": len(bufs) * attempts})
        c.check("canaries_intact", all(b.canaries_intact() for b in bufs.values()), None)
    after = leak_counts(prefix)
    c.check("no_leaks", after == before, {"before": before, "after": after})
    return timings


def _check_data(c: Case, name: str, cp: CopierProcess, bufs: dict[str, Buffer], dst: str,
                expected: np.ndarray) -> None:
    if dst in bufs:
        got = bufs[dst].payload().numpy()
        c.check(name, bool(np.array_equal(got, expected)), int((got != expected).sum()))
    else:
        want = hashlib.sha256(expected.tobytes()).hexdigest()
        got_d = cp.call("digest", name=dst)["sha256"]
        c.check(name, got_d == want, got_d)


def _observe_dst(buf: Buffer, expected: np.ndarray, chunk: int, wait_s: float) -> tuple[bool, bool]:
    """(first chunk equals the reference, rest equals the reference): the copy's footprint in the owner's view."""
    p = buf.payload().numpy()
    wait_until(lambda: np.array_equal(p[:chunk], expected[:chunk]), wait_s, "first chunk visible to the owner")
    return bool(np.array_equal(p[:chunk], expected[:chunk])), bool(np.array_equal(p[chunk:], expected[chunk:]))


def _check_reuse_refused(c: Case, when: str, reuser: Reuser, bufs: dict[str, Buffer], ledger: SharedLedger,
                         cp: CopierProcess, src: str, dst: str) -> None:
    took = {n: reuser.try_reclaim(n, b) for n, b in bufs.items()}
    c.check(f"owner_reuse_refused_{when}", not any(took.values()),
            {"reclaimed": took, "ledger_holds": len(ledger.holds(pid=cp.pid))})
    rel = cp.call("release", names=[src, dst])["raised"]
    c.check(f"copier_release_raises_{when}", all(v == "BufferHeldError" for v in rel.values()), rel)


# -- the SIGKILL case ---------------------------------------------------------------------------------------
def run_kill_case(c: Case, s: Setting, seed: int, prefix: str, k_chunks: int = 2) -> dict[str, Any]:
    """Copier killed mid-copy (a d2h copy k chunks in, and a queued h2d copy): reclaim only after exit."""
    timings: dict[str, Any] = {}
    before = leak_counts(prefix)
    gpu = s.device == "cuda"
    expected = expected_pattern(s.nbytes, seed)
    names = ["host_a", "host_b"] + ([] if gpu else ["dev_a", "dev_b"])
    with owner_world(prefix, names, s.nbytes) as (ledger, bufs):
        bufs["host_a"].payload().fill_(POISON)
        bufs["host_b"].payload().copy_(torch.from_numpy(expected))
        spec = {n: {"seg": bufs[n].seg.name if n in bufs else None, "nbytes": s.nbytes,
                    "fill": {"dev_a": "pattern", "dev_b": "poison"}.get(n), "seed": seed,
                    "producer_cycles": s.producer_cycles} for n in ("host_a", "host_b", "dev_a", "dev_b")}
        reuser = Reuser(ledger)
        cp = CopierProcess(s.device, s.log_dir / "copier-sigkill.log")
        try:
            cp.setup(buffers=spec, ledger=ledger.name, faults={"chunk_bytes": s.chunk_bytes})
            a = cp.call("submit", src="dev_a", dst="host_a")
            b = cp.call("submit", src="host_b", dst="dev_b")
            cp.gate.allow(k_chunks)
            wait_until(lambda: cp.call("progress", ticket=a["ticket"])["chunks_done"] >= k_chunks, s.wait_s,
                       f"{k_chunks} chunks issued")
            cut = k_chunks * s.chunk_bytes
            p = bufs["host_a"].payload().numpy()
            wait_until(lambda: np.array_equal(p[:cut], expected[:cut]), s.wait_s, "k chunks visible")
            held = ledger.holds(pid=cp.pid)
            c.check("holds_visible_in_ledger", len(held) == (2 if gpu else 4), [h.__dict__ for h in held])
            try:
                ledger.reap(cp.pid, cp.pidfd)
                c.check("reap_refused_while_alive", False, "reaped a live process")
            except HolderAliveError as e:
                c.check("reap_refused_while_alive", True, str(e))

            t_kill = time.perf_counter()
            os.kill(cp.pid, signal.SIGKILL)
            took = {n: reuser.try_reclaim(n, bufs[n]) for n in bufs}
            dead_now = exited(cp.pidfd)
            c.check("reclaim_refused_until_exit_observed", not any(took.values()),
                    {"reclaimed": took, "pidfd_readable_at_attempt": dead_now})
            c.check("pidfd_reports_exit", exited(cp.pidfd, timeout=s.wait_s), None)
            timings["kill_to_exit_s"] = time.perf_counter() - t_kill
            rc = cp.proc.wait(timeout=s.wait_s)
            c.check("killed_by_sigkill", rc == -signal.SIGKILL, rc)
            reaped = ledger.reap(cp.pid, cp.pidfd)
            c.check("holds_reaped_after_exit", reaped == len(held) and ledger.live() == 0,
                    {"reaped": reaped, "left": ledger.live()})
            # Physically complete = stopped: exactly the gated chunks landed, the rest is untouched poison.
            c.check("copy_stopped_where_gated",
                    bool(np.array_equal(p[:cut], expected[:cut]) and (p[cut:] == POISON).all()),
                    {"chunks_landed": k_chunks, "bytes": cut})
            c.check("queued_copy_source_untouched", bool(np.array_equal(bufs["host_b"].payload().numpy(),
                                                                        expected)), None)
            for n, buf in bufs.items():
                c.check(f"reclaim_allowed_after_reap:{n}", reuser.try_reclaim(n, buf), None)
            c.check("no_process_left", not Path(f"/proc/{cp.pid}").exists(), cp.pid)
            del p  # a view into the segment: the segment cannot be unmapped while it lives
        finally:
            rc = cp.finish(s.wait_s)
        intact = reuser.sentinels_intact()
        c.check("sentinels_intact", all(intact.values()) and len(intact) == len(bufs), intact)
        c.check("canaries_intact", all(bb.canaries_intact() for bb in bufs.values()), None)
        c.record("submitted", {"d2h": a["ticket"], "h2d": b["ticket"]})
    after = leak_counts(prefix)
    c.check("no_leaks", after == before, {"before": before, "after": after})
    return timings


# -- the stage ----------------------------------------------------------------------------------------------
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
    st = os.statvfs(shm.SHM_DIR)
    if st.f_bavail * st.f_frsize < need:
        raise StageError(f"/dev/shm has {st.f_bavail * st.f_frsize} bytes free, the drain stage needs {need} "
                         f"(lower drain.nbytes or enlarge /dev/shm)")
    log_dir = cfg.stage_dir("drain")
    return Setting(device, nbytes, chunk, float(sec.get("drain_timeout_s", 0.2)), float(sec.get("wait_s", 60)),
                   int(sec.get("bench_reps", 7)), int(cfg.data["timing"]["warmup"]),
                   int(sec.get("producer_cycles", 50_000_000)), log_dir)


def run(cfg: Config) -> Result:
    s = setting(cfg)
    res = Result.begin("drain", cfg)
    res.extra["device"] = s.device
    res.extra["nbytes"] = s.nbytes
    res.extra["chunk_bytes"] = s.chunk_bytes
    base = f"kmesh-drain-{os.getpid()}"
    i = 0
    cp = CopierProcess(s.device, s.log_dir / "copier.log")
    try:
        for direction in DIRECTIONS:
            for mode in MODES:
                cid = f"{direction}-{mode}"
                with res.case(cid, {"direction": direction, "mode": mode, "device": s.device,
                                    "nbytes": s.nbytes, "chunk_bytes": s.chunk_bytes, "copier_pid": cp.pid}) as c:
                    res.timings[cid] = run_transfer_case(c, s, cp, direction, mode, cfg.seed + i, f"{base}-{i}")
                i += 1
    finally:
        res.extra["copier_exit"] = cp.finish(s.wait_s)
    with res.case("client-sigkill", {"device": s.device, "nbytes": s.nbytes, "chunk_bytes": s.chunk_bytes,
                                     "gated_chunks": 2}) as c:
        res.timings["client-sigkill"] = run_kill_case(c, s, cfg.seed + i, f"{base}-{i}")
    for case in res.cases:
        res.timings.setdefault(case.id, {})["case_s"] = case.seconds
    return res
