"""The drain stage's owner side: payload buffers in named shared memory with canaries around them, the would-be
reuser that takes memory back only when the shared ledger shows no holds on it, and the leak counters."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from kmesh.errors import StageError
from kmesh.stages.drain.protocol import CANARY
from kmesh.transfer import SharedLedger, shm

CANARY_BYTE = 0xC3
SENTINEL = 0x5A  # written by the would-be reuser into memory it reclaimed


def expected_pattern(n_bytes: int, seed: int) -> np.ndarray:
    """Independent reference of kmesh.stages.drain.client.pattern (numpy uint64 math), as bytes."""
    i = np.arange(n_bytes // 4, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed)) & np.uint64(0x7FFFFFFF)).astype("<i4").view(np.uint8)


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


