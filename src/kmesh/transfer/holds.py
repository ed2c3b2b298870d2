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


def device_name(t: torch.Tensor) -> str:
    """str(t.device) ("cpu", "cuda:0", ...) without building a torch.device for the common two."""
    if t.is_cuda:
        return f"cuda:{t.get_device()}"
    return "cpu" if t.is_cpu else str(t.device)


def span_of(t: torch.Tensor) -> Span:
    """Bytes from the lowest to one past the highest element of t (the whole extent for strided views)."""
    start = t.data_ptr()
    n = t.numel()
    if n == 0:
        return Span(device_name(t), start, start)
    extent = n if t.is_contiguous() else 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return Span(device_name(t), start, start + extent * t.element_size())


@dataclass(frozen=True)
class Hold:
    ticket_id: int
    role: str  # "src" or "dst"
    span: Span


class HoldTable:
    """Thread-safe multiset of holds; counting is by overlap with a span. Kept by ticket: a drain drops each
    ticket's holds in O(1) (a service's lane drops one ticket's pair while hundreds of copies are in flight)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ticket: dict[int, list[Hold]] = {}
        self._count = 0

    def add(self, hold: Hold) -> None:
        with self._lock:
            self._by_ticket.setdefault(hold.ticket_id, []).append(hold)
            self._count += 1

    def add_pair(self, a: Hold, b: Hold) -> None:
        """Two holds of one ticket (a copy's source and destination) under one acquisition of the lock."""
        if a.ticket_id != b.ticket_id:
            raise ValueError(f"add_pair takes one ticket's holds, got tickets {a.ticket_id} and {b.ticket_id}")
        with self._lock:
            self._by_ticket.setdefault(a.ticket_id, []).extend((a, b))
            self._count += 2

    def drop_ticket(self, ticket_id: int) -> list[Hold]:
        with self._lock:
            gone = self._by_ticket.pop(ticket_id, [])
            self._count -= len(gone)
        return gone

    def over(self, span: Span) -> list[Hold]:
        with self._lock:
            return [h for holds in self._by_ticket.values() for h in holds if h.span.overlaps(span)]

    def __len__(self) -> int:
        with self._lock:
            return self._count
