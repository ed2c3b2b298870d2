"""A cross-process mirror of holds on shared memory, so the process that OWNS memory can see the holds of the
process that COPIES into or out of it.

The ledger is a shm segment of fixed 64-byte slots (int64 x 8): state, pid, ticket id, segment tag (dev, ino),
byte start, byte end, role. A copier's engine adds a slot when it places a hold on shared memory and clears it
in drain. Slot changes and reads take an flock on the ledger's fd (released by the kernel if the holder dies),
plus a thread lock (flock does not exclude threads sharing one open file).

A holder that died leaves its slots behind on purpose: the owner may clear them only with `reap(pid, pidfd)`,
which refuses while the pidfd does not report the process as exited. Once it has exited, none of its threads
runs and its CUDA context is torn down (the driver's file release runs before the exit is signalled), so its
copies are physically over: complete or stopped part-way, never still writing.
"""
from __future__ import annotations

import fcntl
import os
import select
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from kmesh.transfer.errors import HolderAliveError, TransferArgumentError
from kmesh.transfer.shm import Segment

MAGIC = 0x4B4D4C4544474552  # "KMLEDGER"
_FIELDS = 8
_FREE, _LIVE = 0, 1
ROLES = {"src": 1, "dst": 2}


@dataclass(frozen=True)
class LedgerHold:
    slot: int
    pid: int
    ticket_id: int
    tag: tuple[int, int]
    start: int
    end: int
    role: str


class SharedLedger:
    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        words = seg.tensor(torch.int64)
        if words.numel() < _FIELDS:
            raise TransferArgumentError(f"segment of {seg.size} bytes is too small for a ledger")
        self._head = words[:_FIELDS]
        self._slots = words[_FIELDS:].view(-1, _FIELDS)
        self._tlock = threading.Lock()

    @classmethod
    def create(cls, name: str | None = None, slots: int = 1024) -> "SharedLedger":
        seg = Segment.create((slots + 1) * _FIELDS * 8, name=name)
        led = cls(seg)
        led._head[0] = MAGIC
        led._head[1] = slots
        return led

    @classmethod
    def attach(cls, name: str) -> "SharedLedger":
        led = cls(Segment.attach(name))
        if int(led._head[0]) != MAGIC:
            led.close()
            raise TransferArgumentError(f"shm segment {name!r} is not a KMesh hold ledger")
        return led

    @property
    def name(self) -> str | None:
        return self.seg.name

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._tlock:
            fcntl.flock(self.seg.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.seg.fd, fcntl.LOCK_UN)

    def add(self, ticket_id: int, tag: tuple[int, int], start: int, end: int, role: str,
            pid: int | None = None) -> int:
        """Publish a hold; returns its slot."""
        with self._locked():
            free = (self._slots[:, 0] == _FREE).nonzero()
            if free.numel() == 0:
                raise TransferArgumentError(f"hold ledger full ({self._slots.shape[0]} slots)")
            i = int(free[0])
            row = torch.tensor([_LIVE, pid or os.getpid(), ticket_id, tag[0], tag[1], start, end, ROLES[role]],
                               dtype=torch.int64)
            self._slots[i] = row
            return i

    def remove(self, slot: int, ticket_id: int) -> None:
        with self._locked():
            if int(self._slots[slot, 0]) == _LIVE and int(self._slots[slot, 2]) == ticket_id \
                    and int(self._slots[slot, 1]) == os.getpid():
                self._slots[slot].zero_()

    def _rows(self) -> list[LedgerHold]:
        live = (self._slots[:, 0] == _LIVE).nonzero().flatten().tolist()
        names = {v: k for k, v in ROLES.items()}
        out = []
        for i in live:
            _, pid, tid, dev, ino, a, b, role = self._slots[i].tolist()
            out.append(LedgerHold(i, pid, tid, (dev, ino), a, b, names.get(role, "?")))
        return out

    def holds(self, tag: tuple[int, int] | None = None, start: int = 0, end: int | None = None,
              pid: int | None = None) -> list[LedgerHold]:
        """Live holds overlapping bytes [start, end) of the segment `tag` (all segments if None), by pid."""
        with self._locked():
            rows = self._rows()
        return [h for h in rows
                if (tag is None or h.tag == tuple(tag)) and (pid is None or h.pid == pid)
                and h.start < (end if end is not None else 1 << 62) and start < h.end]

    def live(self) -> int:
        return len(self.holds())

    def reap(self, pid: int, pidfd: int) -> int:
        """Clear the holds of process `pid`, which must have exited (its pidfd readable). Returns how many."""
        if not exited(pidfd):
            raise HolderAliveError(f"process {pid} has not exited; its copies may still be running")
        with self._locked():
            rows = [h for h in self._rows() if h.pid == pid]
            for h in rows:
                self._slots[h.slot].zero_()
        return len(rows)

    def close(self) -> None:
        del self._head, self._slots
        self.seg.close()

    def unlink(self) -> None:
        self.seg.unlink()


def exited(pidfd: int, timeout: float = 0.0) -> bool:
    """True once the process behind pidfd has exited (zombie or reaped): a pidfd polls readable then."""
    r, _, _ = select.select([pidfd], [], [], timeout)
    return bool(r)


def open_pidfd(pid: int) -> int:
    """A pidfd for pid; open it while the process is known alive (right after spawning) to avoid pid reuse."""
    return os.pidfd_open(pid)
