"""Refcounted holds on byte ranges of memory.

A hold says "a ticket may still read or write these bytes". Holds are keyed by (device, address range), not
by tensor object, so two views of one buffer see each other's holds. Only the engine adds or drops holds;
drop happens in drain, after the copy is physically complete.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Span:
    """The bytes a tensor covers: [start, end) on one device."""

    device: str
    start: int
    end: int

    def overlaps(self, other: "Span") -> bool:
        return self.device == other.device and self.start < other.end and other.start < self.end


def span_of(t: torch.Tensor) -> Span:
    """Bytes from the lowest to one past the highest element of t (the whole extent for strided views)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return Span(str(t.device), start, start)
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return Span(str(t.device), start, start + extent * t.element_size())


@dataclass(frozen=True)
class Hold:
    ticket_id: int
    role: str  # "src" or "dst"
    span: Span


class HoldTable:
    """Thread-safe multiset of holds; counting is by overlap with a span."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: list[Hold] = []

    def add(self, hold: Hold) -> None:
        with self._lock:
            self._holds.append(hold)

    def drop_ticket(self, ticket_id: int) -> list[Hold]:
        with self._lock:
            gone = [h for h in self._holds if h.ticket_id == ticket_id]
            self._holds = [h for h in self._holds if h.ticket_id != ticket_id]
        return gone

    def over(self, span: Span) -> list[Hold]:
        with self._lock:
            return [h for h in self._holds if h.span.overlaps(span)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)
