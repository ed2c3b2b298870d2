"""The copying process of the `drain` stage: `python -m kmesh.stages.drain.client --ctl FD --device D`.

It owns the "device" buffers (CPU profile: a shared memory segment the stage created; cuda profile: GPU
memory of this process) and, per case, a TransferEngine whose copies are gated chunk by chunk by the stage
(a ChunkGate whose read end arrives with `setup` over SCM_RIGHTS). Holds on shared memory are mirrored into
the stage's SharedLedger so the owning process can see them. Commands arrive as JSON lines on the control
socket (a message with "nfds": n is followed by one byte carrying n descriptors); every reply is one JSON
line {"ok": bool, ...}. `end_case` closes everything the case opened; `exit` ends the process.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from typing import Any

import torch

from kmesh.stages.drain.protocol import CANARY, POISON
from kmesh.transfer import ChunkGate, FaultPlan, SharedLedger, Ticket, TransferEngine, TransferError, shm


def pattern(n_words: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """int32 words w[i] = (i * 2654435761 + seed) mod 2^31: exact on every device (int64 math)."""
    i = torch.arange(n_words, dtype=torch.int64, device=device)
    return ((i * 2654435761 + seed) & 0x7FFFFFFF).to(torch.int32)


class Client:
    def __init__(self, device: str) -> None:
        self.device = device
        self.gate: ChunkGate | None = None
        if device == "cuda":
            _warm_cuda()  # the driver's one-time fds are not a case's leak
        self.idle_fds = shm.open_fds()
        self.segs: dict[str, shm.Segment] = {}
        self.bufs: dict[str, torch.Tensor] = {}  # name -> payload byte view (host shm or GPU)
        self.registered: list[int] = []
        self.engine: TransferEngine | None = None
        self.ledger: SharedLedger | None = None
        self.tickets: dict[int, Ticket] = {}

    # -- commands -----------------------------------------------------------------------------------
    def setup(self, buffers: dict[str, dict[str, Any]], ledger: str, faults: dict[str, Any],
              fds: list[int]) -> dict[str, Any]:
        """buffers: name -> {"seg": shm name | None (GPU), "nbytes", "fill": "pattern"|"poison"|None, "seed"};
        fds: [gate read end]."""
        if self.engine is not None:
            raise RuntimeError("setup while a case is open; end_case first")
        self.idle_fds = shm.open_fds() - len(fds)
        self.gate = ChunkGate.from_read_fd(fds[0])
        self.ledger = SharedLedger.attach(ledger)
        pinned = {}
        for name, spec in buffers.items():
            nbytes = int(spec["nbytes"])
            if spec.get("seg"):
                seg = self.segs[name] = shm.Segment.attach(spec["seg"])
                if self.device == "cuda":
                    _host_register(seg)
                    self.registered.append(seg.address)
                view = seg.tensor(torch.uint8, (nbytes,), CANARY)
                pinned[name] = bool(view.is_pinned()) if self.device == "cuda" else None
            else:
                view = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.bufs[name] = view
            if spec.get("fill") == "poison":
                view.fill_(POISON)
            elif spec.get("fill") == "pattern":
                if self.device == "cuda":
                    # A slow producer on the current stream: the engine must order its copy after it.
                    view.fill_(POISON)
                    torch.cuda._sleep(int(spec.get("producer_cycles", 50_000_000)))
                view.view(torch.int32).copy_(pattern(nbytes // 4, int(spec["seed"]), str(view.device)))
        self.engine = TransferEngine(self.device, FaultPlan.from_dict(faults), gate=self.gate, ledger=self.ledger)
        return {"pinned": pinned, "pid": os.getpid()}

    def submit(self, src: str, dst: str) -> dict[str, Any]:
        assert self.engine is not None
        t0 = time.perf_counter()
        err, pending = None, []
        try:
            ticket = self.engine.submit(self.bufs[src], self.bufs[dst], owner="drain-case")
        except TransferError as e:
            err, pending = type(e).__name__, e.pending
            ticket = e.pending[0]
        dt = time.perf_counter() - t0
        self.tickets[ticket.id] = ticket
        return {"ticket": ticket.id, "error": err, "pending": [p.id for p in pending], "submit_s": dt,
                "chunks_total": ticket.chunks_total}

    def progress(self, ticket: int) -> dict[str, Any]:
        held = self.tickets[ticket]
        return {"chunks_done": held.chunks_done, "chunks_total": held.chunks_total, "state": held.state}

    def release(self, names: list[str]) -> dict[str, Any]:
        """Try engine.release on each buffer: the API must refuse while tickets hold it."""
        assert self.engine is not None
        out = {}
        for name in names:
            try:
                self.engine.release(self.bufs[name])
                out[name] = None
            except TransferError as e:
                out[name] = type(e).__name__
        return {"raised": out}

    def holds(self) -> dict[str, Any]:
        assert self.engine is not None
        return {"per_buffer": {n: self.engine.holds(b) for n, b in self.bufs.items()},
                "live": self.engine.live_holds(), "pending": [t.id for t in self.engine.pending()]}

    def drain(self, tickets: list[int] | None, timeout: float | None) -> dict[str, Any]:
        assert self.engine is not None
        sel = [self.tickets[i] for i in tickets] if tickets is not None else None
        t0 = time.perf_counter()
        try:
            drained = self.engine.drain(sel, timeout=timeout)
        except TransferError as e:
            return {"error": type(e).__name__, "message": str(e), "pending": [t.id for t in e.pending],
                    "drain_s": time.perf_counter() - t0}
        return {"error": None, "done": [t.id for t in drained.done], "failed": [t.id for t in drained.failed],
                "holds_released": drained.holds_released, "drain_s": time.perf_counter() - t0}

    def digest(self, name: str) -> dict[str, Any]:
        """sha256 of a buffer's bytes (read after a full synchronize): how the stage checks GPU memory."""
        buf = self.bufs[name]
        if buf.device.type == "cuda":
            torch.cuda.synchronize()
        return {"sha256": hashlib.sha256(buf.cpu().numpy().tobytes()).hexdigest()}

    def reuse_device(self, name: str, sentinel: int) -> dict[str, Any]:
        """The would-be reuser of this process's own device buffer (after the final drain): hand its memory
        to a new allocation, write a sentinel, let every stream finish, check nothing overwrote it."""
        assert self.engine is not None
        raised = None
        try:
            self.engine.release(self.bufs[name])
        except TransferError as e:
            raised = type(e).__name__
        nbytes = self.bufs[name].numel()
        if name not in self.segs:
            del self.bufs[name]  # the caching allocator may give the same block to the next request
            self.bufs[name] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.bufs[name].fill_(sentinel)
        if self.device == "cuda":
            torch.cuda.synchronize()
        intact = bool((self.bufs[name] == sentinel).all())
        return {"release_raised": raised, "sentinel_intact": intact}

    def bench(self, src: str, dst: str, reps: int, warmup: int) -> dict[str, Any]:
        """Ungated submit→drain round trips on a fault-free engine (warm-up runs excluded)."""
        eng = TransferEngine(self.device)
        times = []
        for rep in range(warmup + reps):
            if self.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.drain([eng.submit(self.bufs[src], self.bufs[dst], owner="bench")])
            if rep >= warmup:
                times.append(time.perf_counter() - t0)
        eng.close()
        return {"seconds": times, "nbytes": self.bufs[src].numel()}

    def end_case(self) -> dict[str, Any]:
        """Close the case's engine (drains, joins its worker), gate, segments and ledger; count what is left."""
        live = 0
        if self.engine is not None:
            self.engine.close()
            live = self.engine.live_holds()
            self.engine = None
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        self.bufs.clear()
        self.tickets.clear()
        if self.device == "cuda":
            torch.cuda.synchronize()
        for seg in self.segs.values():
            if seg.address in self.registered:
                _host_unregister(seg)
            seg.close()
        self.segs.clear()
        self.registered.clear()
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        return {"live_holds": live, "live_segments": shm.live_segments(), "fds": shm.open_fds(),
                "idle_fds": self.idle_fds, "mapped_shm": shm.mapped_shm(prefix="kmesh-drain")}

    def exit(self) -> dict[str, Any]:
        return {"open_case": self.engine is not None}


def _cudart() -> Any:
    """torch's cudart bindings, else cupy's runtime (both name the calls the same way here)."""
    try:
        rt = torch.cuda.cudart()
        return rt.cudaHostRegister, rt.cudaHostUnregister
    except (AttributeError, RuntimeError):
        import cupy

        return cupy.cuda.runtime.hostRegister, cupy.cuda.runtime.hostUnregister


def _warm_cuda() -> None:
    """Create the CUDA context and touch every driver path a case uses (stream, event, host registration)."""
    torch.cuda.init()
    x = torch.ones(1024, device="cuda")
    st = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record(st)
    ev.synchronize()
    with shm.Segment.create(1 << 16) as seg:
        _host_register(seg)
        seg.tensor(torch.float32, (1024,)).copy_(x.cpu())
        _host_unregister(seg)
    torch.cuda.synchronize()


def _host_register(seg: shm.Segment) -> None:
    """Page-lock a shared mapping so GPU copies to/from it are real async DMA."""
    rc = _cudart()[0](seg.address, seg.size, 0)
    if rc is not None and int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed with {rc}")


def _host_unregister(seg: shm.Segment) -> None:
    _cudart()[1](seg.address)


def serve(ctl: socket.socket, client: Client) -> None:
    stream = ctl.makefile("rwb", buffering=0)  # unbuffered: readline never reads past the line (fd carrier byte)
    for line in stream:
        msg = json.loads(line)
        op = msg.pop("op")
        if "nfds" in msg:
            _, msg["fds"], _, _ = socket.recv_fds(ctl, 1, msg.pop("nfds"))
        try:
            reply = {"ok": True, **getattr(client, op)(**msg)}
        except Exception as e:  # reported to the stage, which fails the case with this text
            reply = {"ok": False, "exc": type(e).__name__, "message": str(e)}
        stream.write((json.dumps(reply) + "\n").encode())
        if op == "exit":
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ctl", type=int, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    ctl = socket.socket(fileno=args.ctl)
    serve(ctl, Client(args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
