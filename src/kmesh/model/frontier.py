"""A quality/speed frontier: points (cost, loss), both lower-is-better, e.g. TTFT as a ratio of full recompute's
and KL to full recompute. Used by the equivalence stage's RAG frontier and drawn by kmesh.report.

A point dominates another when it is no worse on both axes and better on at least one; the Pareto front is the set
of points nothing dominates. Ties on both axes dominate neither way (both stay on the front).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Point:
    name: str
    cost: float     # e.g. TTFT ratio vs full recompute (lower is faster)
    loss: float     # e.g. KL(full || arm) (lower is closer)


def dominates(a: Point, b: Point) -> bool:
    return a.cost <= b.cost and a.loss <= b.loss and (a.cost < b.cost or a.loss < b.loss)


def pareto_front(points: Sequence[Point]) -> list[str]:
    """Names of the points no other point dominates, by increasing cost."""
    front = [p for p in points if not any(dominates(q, p) for q in points if q is not p)]
    return [p.name for p in sorted(front, key=lambda p: (p.cost, p.loss, p.name))]


def dominated_by(points: Sequence[Point], name: str) -> list[dict[str, Any]]:
    """Every point that `name` dominates, with by how much: the other's cost and loss as multiples of `name`'s
    (None where `name`'s is 0)."""
    me = next(p for p in points if p.name == name)
    return [{"arm": p.name, "cost_ratio": p.cost / me.cost if me.cost else None,
             "loss_ratio": p.loss / me.loss if me.loss else None}
            for p in points if p is not me and dominates(me, p)]


def better_at_no_more_cost(points: Sequence[Point], name: str) -> list[str]:
    """The points that reach a lower loss than `name` at equal or lower cost (what a claim that `name` leads the
    frontier must find empty)."""
    me = next(p for p in points if p.name == name)
    return [p.name for p in points if p is not me and p.cost <= me.cost and p.loss < me.loss]
