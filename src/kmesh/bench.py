"""Matched-pair timing (DESIGN §5): the only way KMesh compares two arms.

Design, stated in every table the report renders:
- n matched pairs (default 7) after `warmup` discarded pairs; within a pair both arms run the same
  children; the arm that goes first alternates (pair 0: A first, pair 1: B first, ...).
- Several arms compared with one of them (e.g. full vs repair and full vs end-to-end) may share rounds
  (kmesh.bench.rotate): each round runs every arm once, in the listed order, then reversed in the next round,
  so within every pairing drawn from the rounds the arm that goes first alternates just the same. Where every arm
  must also take every position (a carry-over from the arm before, e.g. a server's asynchronous store, would
  otherwise always fall on the same arm), the rounds follow a balanced design instead (`design="balanced"`:
  Williams squares, every arm in every position and first in every pairing equally often per cycle).
- Each arm's run of one child records named intervals, possibly nested (read ⊂ restore ⊂ outer).
  A part that occurs several times in one child run is summed (e.g. four object reads).
- Per pair and part: the median over children for each arm. Across pairs: the median of the n
  paired differences (B − A), the median of the n ratios (B / A), and in how many pairs B was faster.
  Nested parts are reported side by side, never added.
- On CUDA, intervals are CUDA events on the current stream, resolved after one synchronize per run.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from kmesh.errors import KMeshError


class TimingError(KMeshError):
    """Misuse of the timing harness (bad nesting, unknown arm, too few pairs)."""


class Intervals:
    """Named, nestable intervals of one arm's run on one child."""

    def __init__(self, device: str = "cpu") -> None:
        if device not in ("cpu", "cuda"):
            raise TimingError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        self._open: list[str] = []
        self._spans: list[tuple[str, Any, Any]] = []
        self.parents: dict[str, str | None] = {}

    def _stamp(self) -> Any:
        if self.device == "cuda":
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter_ns()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        if name in self._open:
            raise TimingError(f"interval {name!r} nested inside itself")
        parent = self._open[-1] if self._open else None
        if self.parents.setdefault(name, parent) != parent:
            raise TimingError(f"interval {name!r} opened under {parent!r}, earlier under {self.parents[name]!r}")
        self._open.append(name)
        start = self._stamp()
        try:
            yield
        finally:
            end = self._stamp()
            self._open.pop()
            self._spans.append((name, start, end))

    def seconds(self) -> dict[str, float]:
        """Total seconds per part (synchronizes once on CUDA)."""
        if self._open:
            raise TimingError(f"intervals still open: {self._open}")
        if self.device == "cuda" and self._spans:
            import torch

            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for name, a, b in self._spans:
            dt = a.elapsed_time(b) / 1e3 if self.device == "cuda" else (b - a) / 1e9
            out[name] = out.get(name, 0.0) + dt
        return out


def paired_stats(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Statistics of matched pairs (a[i], b[i]): median difference B−A, median ratio B/A, B-faster count."""
    if len(a) != len(b) or not a:
        raise TimingError(f"need equally many, at least one, paired values; got {len(a)} and {len(b)}")
    diffs = [y - x for x, y in zip(a, b)]
    ratios = [y / x if x > 0 else float("inf") for x, y in zip(a, b)]
    return {
        "pairs": len(a),
        "median_a": statistics.median(a),
        "median_b": statistics.median(b),
        "median_diff": statistics.median(diffs),
        "median_ratio": statistics.median(ratios),
        "b_faster": sum(d < 0 for d in diffs),
        "diffs": diffs,
        "ratios": ratios,
    }


@dataclass
class PairedTiming:
    """Raw per-pair, per-child times of two arms and their paired summary."""

    arm_a: str
    arm_b: str
    pairs: list[dict[str, Any]] = field(default_factory=list)   # {"order": [...], arm: {part: [s per child]}}
    parents: dict[str, str | None] = field(default_factory=dict)
    warmup: int = 0
    shared_with: tuple[str, ...] = ()   # the other arms that ran in the same rounds (kmesh.bench.rotate)
    balanced: bool = False              # rounds of rotate's balanced design: the first arm balanced, not alternating

    def parts(self) -> list[str]:
        seen: list[str] = []
        for p in self.pairs:
            for arm in (self.arm_a, self.arm_b):
                for name in p[arm]:
                    if name not in seen:
                        seen.append(name)
        return seen

    def per_pair(self, arm: str, part: str) -> list[float]:
        """Median over children of one arm's part, one value per pair."""
        missing = [i for i, p in enumerate(self.pairs) if part not in p.get(arm, {})]
        if missing:
            raise TimingError(f"part {part!r} was not timed in arm {arm!r} in pairs {missing}: "
                              "both arms must time the same parts to be compared")
        return [statistics.median(p[arm][part]) for p in self.pairs]

    def summary(self) -> dict[str, dict[str, Any]]:
        return {part: paired_stats(self.per_pair(self.arm_a, part), self.per_pair(self.arm_b, part))
                for part in self.parts()}

    def to_dict(self) -> dict[str, Any]:
        first = self.pairs[0]["order"][0] if self.pairs else self.arm_a
        order = f"alternating, {'A' if first == self.arm_a else 'B'} first in pair 0"
        if self.balanced:
            a_first = sum(p["order"][0] == self.arm_a for p in self.pairs)
            order = f"balanced (Williams design), A first in {a_first} of {len(self.pairs)} pairs"
        design: dict[str, Any] = {"pairs": len(self.pairs), "warmup": self.warmup, "order": order,
                                  "per_pair": "median over children", "nesting": self.parents}
        if self.shared_with:
            design["rounds_shared_with"] = list(self.shared_with)
        return {"kind": "paired", "arms": {"A": self.arm_a, "B": self.arm_b}, "design": design,
                "summary": self.summary(), "raw": self.pairs}


RunFn = Callable[[str, Any, Intervals], None]
ArmRun = Callable[[str, int], dict[str, list[float]]]


@dataclass
class Rounds:
    """The kept rounds of kmesh.bench.rotate: per round the order run and each arm's seconds per part."""

    arms: tuple[str, ...]
    warmup: int
    records: list[dict[str, Any]] = field(default_factory=list)
    balanced: bool = False

    def by_position(self, part: str) -> dict[str, dict[str, Any]]:
        """Per arm and position in the round (0 = first): how many rounds, and the median of the arm's per-round
        value (median over children) there: a carry-over from the arm before shows as a position effect."""
        out: dict[str, dict[str, Any]] = {}
        for arm in self.arms:
            at: dict[int, list[float]] = {}
            for r in self.records:
                at.setdefault(r["order"].index(arm), []).append(statistics.median(r[arm][part]))
            out[arm] = {str(pos): {"rounds": len(v), "median": statistics.median(v)} for pos, v in sorted(at.items())}
        return out

    def paired(self, arm_a: str, arm_b: str) -> PairedTiming:
        """The matched pairs of two of the arms, one pair per round (the rounds' other arms named in the design)."""
        unknown = {arm_a, arm_b} - set(self.arms)
        if unknown or arm_a == arm_b:
            raise TimingError(f"pairing {arm_a!r} with {arm_b!r}: the rounds ran {list(self.arms)}")
        pairs = [{"order": [a for a in r["order"] if a in (arm_a, arm_b)], arm_a: r[arm_a], arm_b: r[arm_b]}
                 for r in self.records]
        return PairedTiming(arm_a, arm_b, pairs, warmup=self.warmup,
                            shared_with=tuple(a for a in self.arms if a not in (arm_a, arm_b)),
                            balanced=self.balanced)


def williams_orders(n: int) -> list[list[int]]:
    """The round orders of a Williams design over n arms (indices): each row a permutation, every arm in every
    position equally often and, for every two arms, each first equally often over the rows (n rows for even n; for
    odd n the square's rows each followed by its mirror, 2n rows). n = 2: [0, 1], [1, 0]."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:                # 0, 1, n-1, 2, n-2, ...
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows = [row for r in rows for row in (r, r[::-1])]
    return rows


def rotate(arms: tuple[str, ...], pairs: int, warmup: int, run_arm: ArmRun, progress: bool = False,
           label: str | None = None, design: str = "reversing") -> Rounds:
    """`warmup + pairs` rounds, in each `run_arm(arm, round)` once per arm: in the listed order in even rounds,
    reversed in odd ones, so for ANY two arms the one that goes first alternates from round to round (the first
    listed of the two first in the first kept round); the warm-up rounds' times are discarded.

    `run_arm` returns the arm's seconds per part, one value per child (a whole-group arm may return a list of
    one); `round` runs from 0, the first `warmup` rounds being the discarded ones. Rounds.paired draws the pairs
    of two arms; the caller sets each timing's `parents` (nesting) if its parts nest.

    `design="balanced"`: the kept rounds follow williams_orders (the warm-up rounds the design's last rows), so every
    arm takes every position equally often per cycle (n rounds for an even number of arms, 2n for odd); with two
    arms the same order as "reversing".
    """
    if pairs < 1:
        raise TimingError("pairs must be ≥ 1")
    if len(arms) < 2 or len(set(arms)) != len(arms):
        raise TimingError(f"rounds need at least two distinct arms, got {list(arms)}")
    if design not in ("reversing", "balanced"):
        raise TimingError(f"unknown round design {design!r}: reversing or balanced")
    result = Rounds(tuple(arms), warmup, balanced=design == "balanced")
    rows = williams_orders(len(arms))
    from kmesh.progress import track

    for index in track(range(warmup + pairs), label or "rounds " + " / ".join(arms), enabled=progress):
        if result.balanced:
            order = [arms[i] for i in rows[(index - warmup) % len(rows)]]
        else:
            order = list(arms) if (index - warmup) % 2 == 0 else list(reversed(arms))
        record: dict[str, Any] = {"order": order}
        for arm in order:
            record[arm] = run_arm(arm, index)
        if index >= warmup:
            result.records.append(record)
    return result


def alternate(arms: tuple[str, str], pairs: int, warmup: int, run_arm: ArmRun, progress: bool = False,
              label: str | None = None) -> PairedTiming:
    """The paired-run loop of two arms (kmesh.bench.rotate with two: A first in the first kept pair, then the
    order alternating); the warm-up rounds' times are discarded."""
    arm_a, arm_b = arms
    return rotate((arm_a, arm_b), pairs, warmup, run_arm, progress,
                  label or f"pairs {arm_a} vs {arm_b}").paired(arm_a, arm_b)


def run_pairs(
    fn: RunFn,
    arms: tuple[str, str],
    children: Sequence[Any],
    pairs: int = 7,
    warmup: int = 1,
    device: str = "cpu",
    progress: bool = True,
    between: Callable[[], None] | None = None,
) -> PairedTiming:
    """Run `fn(arm, child, intervals)` for both arms over all children, `pairs` times, order alternating
    (kmesh.bench.alternate).

    `between` runs before every child run (e.g. forced eviction so each read is cold).
    """
    if pairs < 1:
        raise TimingError("pairs must be ≥ 1")
    parents: dict[str, str | None] = {}
    result = alternate(arms, pairs, warmup, over_children(fn, children, device, parents, between),
                       progress=progress)
    result.parents.update(parents)
    return result


def over_children(fn: RunFn, children: Sequence[Any], device: str = "cpu",
                  parents: dict[str, str | None] | None = None,
                  between: Callable[[], None] | None = None) -> ArmRun:
    """An ArmRun (for kmesh.bench.alternate / rotate) that runs `fn(arm, child, intervals)` once per child and
    returns each part's seconds, one per child; the parts' nesting is collected into `parents`. `between` runs
    before every child run (e.g. forced eviction so each read is cold)."""
    if not children:
        raise TimingError("need at least one child")
    nesting = parents if parents is not None else {}

    def run_arm(arm: str, _round: int) -> dict[str, list[float]]:
        per_part: dict[str, list[float]] = {}
        for child in children:
            if between:
                between()
            iv = Intervals(device)
            fn(arm, child, iv)
            for name, seconds in iv.seconds().items():
                per_part.setdefault(name, []).append(seconds)
            for name, parent in iv.parents.items():
                nesting.setdefault(name, parent)
        return per_part

    return run_arm
