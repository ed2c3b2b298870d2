"""The TTFT's end-to-end arm (issue 21 item 8): from the child's request to its first token through the real child
path, beside the repair-only pairs of kmesh.stages.equivalence.ttft.

    end-to-end   the child's segments loaded from a real cache service process (started for this prompt length,
                 the leader's segments saved into it first), each object's size and sha256 digest checked on
                 arrival, the private copy, the restore, the repair prefill, the first token id on the host:
                 kmesh.harness.child.prefill_from_segments, run_child's own steps up to the first token (not a copy)

Timed in the same rounds as the full-recompute and repair-only arms (kmesh.bench.rotate: every round runs the
three, the order reversed from round to round, warm-up rounds discarded; per round the median over the children),
and paired with the full arm of the same round, compared on the part both arms time: `ttft`. The end-to-end arm's
own parts, nested inside its ttft — stage ⊃ load, private-copy, restore, repair — are recorded for every kept run
beside the pairs (the full arm has none of them, so they are not paired), and with them the share of each run's
ttft spent on what the repair-only arm does not do (stage + private-copy).

The same footing for every arm: each arm's model state (cache) is allocated before the timed part; the model
process's staging buffer is registered with the service once, before any request (a child process registers its
staging when it starts, not per request); the harness's copy gate is opened for good (ServiceSide.unpace: a
deployed service has no gate). With `ttft.graphs` (CUDA) the repair step replays the repair-only arm's own graph
over the same cache — the same prefill in both arms, so the difference is what comes before it; on the CPU both
run eagerly, each over its own cache.

Checked: per child, on caches poisoned with NaN first, the end-to-end arm's state — every layer's K and V over the
prompt, the first token's logits, the recompute masks, the restored positions, the first token — equals the
repair-only arm's bit for bit; every run (checked and timed) staged and digest-checked every segment, in order;
every timed run's first token equals the repair-only arm's; the parts are present in every run and nested as named;
the service holds nothing of the child afterwards.
"""
from __future__ import annotations

import dataclasses
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from kmesh.bench import Intervals, PairedTiming
from kmesh.errors import StageError
from kmesh.harness.child import prefill_from_segments
from kmesh.harness.leader import Export
from kmesh.harness.modelsetup import ModelSetup
from kmesh.harness.service_side import ServiceSide
from kmesh.harness.workload import Child
from kmesh.kv.sources import ServiceSegments
from kmesh.model.blend import BlendResult
from kmesh.model.quality import compare_states, identical
from kmesh.model.runner import KVCache
from kmesh.result import Case


class EndToEndError(StageError):
    """The end-to-end arm could not be run as built (a graph asked to replay another cache or restored mask,
    no timed run recorded)."""


END_TO_END = "end-to-end"
FULL = "full"
# the end-to-end arm's parts and the part each is nested in
PARTS: dict[str, str | None] = {"ttft": None, "stage": "ttft", "load": "stage", "private-copy": "ttft",
                                "restore": "ttft", "repair": "ttft"}


@dataclass
class FirstTokenState:
    """A child's state at its first token, in the fields kmesh.model.quality.compare_states compares."""

    k: torch.Tensor
    v: torch.Tensor
    logits: torch.Tensor
    tokens: list[int]
    masks: torch.Tensor
    restored: torch.Tensor


def first_token_state(cache: KVCache, prompt_tokens: int, restored: torch.Tensor,
                      result: BlendResult) -> FirstTokenState:
    k, v = cache.stacked(prompt_tokens)
    return FirstTokenState(k, v, result.logits.clone(), [int(result.logits.argmax())], result.masks.clone(),
                           restored.clone())


@dataclass
class RepairOnlyArm:
    """What the TTFT case built for one child's repair-only arm: its cache, and its restore + prefill (the
    in-memory export restored into `cache`, then the blend: eager, or the arm's graph replayed over `cache`)."""

    cache: KVCache
    run: Callable[[], tuple[torch.Tensor, BlendResult]]
    prefill_fn: Callable[[KVCache, torch.Tensor], BlendResult] | None = None   # the graph's replay (graphs only)


def staged_events(export: Export) -> list[str]:
    """The events of a child path that staged and digest-checked every segment, then copied and restored them."""
    return [f"{step}:{e.index}" for step in ("staged", "private-copy-drained", "restored")
            for e in export.catalog.entries]


def _end_to_end_arm(case: Case, setup: ModelSetup, export: Export, children: tuple[Child, ...],
                    repair_only: dict[str, RepairOnlyArm], arm: str, warmup: int,
                    device: str) -> Iterator["EndToEndArm"]:
    """The end-to-end arm of one ttft-<T> case, ready to be timed while the context is open (its service running,
    the leader's segments saved into it, its staging registered, its state checked against the repair-only arm's),
    with its checks recorded on `case`. The caller times it in its rounds and then calls EndToEndArm.finish."""
    sec = setup.sec
    ctx = dataclasses.replace(setup.ctx, catalog=export.catalog)
    prompt_tokens = len(children[0].ids)
    expected_events = staged_events(export)
    with ServiceSide.start(export, setup.device, float(sec["heartbeat_timeout_s"]), int(sec["chunk_bytes"])) as svc:
        saved = svc.save_leader()
        case.check("end_to_end_service_holds_the_segments",
                   all(saved.get(e.key) == e.sha256 for e in export.catalog.entries), value=len(saved))
        svc.unpace()
        private = torch.empty(export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        caches = {child.name: (repair_only[child.name].cache if repair_only[child.name].prefill_fn is not None
                               else setup.runner.new_cache(prompt_tokens, export.catalog.layout.block_size))
                  for child in children}
        with svc.staging(f"ttft-{prompt_tokens}") as staging:

            def child_path(child: Child, events: list[str], part: Any = None) -> tuple[torch.Tensor, BlendResult]:
                # the gate is open (unpace): no after_accept, so the source makes a deployed client's calls
                source = ServiceSegments(svc.client, staging.reg, svc.after_accept if svc.paced else None)
                extra = {"part": part} if part is not None else {}
                return prefill_from_segments(ctx, child, source, staging.tensor, private, caches[child.name], arm,
                                             f"ttft-e2e-{child.name}", events,
                                             prefill_fn=repair_only[child.name].prefill_fn, **extra)

            reference_tokens = _states_equal(case, children, repair_only, caches, child_path, expected_events,
                                             prompt_tokens)
            yield EndToEndArm(children, child_path, expected_events, reference_tokens, warmup, device)
        case.check("end_to_end_service_released_no_leaks", svc.no_leaks(), value=svc.leaks())


# not @contextmanager: mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
end_to_end_arm = contextmanager(_end_to_end_arm)


@dataclass
class EndToEndArm:
    """The end-to-end arm's timed runs (`run`: one round, every child) and what they recorded."""

    children: tuple[Child, ...]
    child_path: Callable[..., tuple[torch.Tensor, BlendResult]]
    expected_events: list[str]
    reference_tokens: dict[str, int]
    warmup: int
    device: str
    kept_parts: list[dict[str, float]] = field(default_factory=list)
    problems: dict[str, list[Any]] = field(default_factory=lambda: {"runs": [], "parts": []})

    def run(self, round_index: int) -> dict[str, list[float]]:
        """One round of the arm: every child's path to its first token, timed as `ttft` with its parts inside,
        each run checked (staged every segment in order, first token equal to the repair-only arm's)."""
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            ttft: list[float] = []
            for child in self.children:
                intervals = Intervals(self.device)
                events: list[str] = []
                with intervals.part("ttft"):
                    _, result = self.child_path(child, events, intervals.part)
                    token = int(result.logits.argmax())   # the first token on the host ends it
                seconds = intervals.seconds()
                ttft.append(seconds["ttft"])
                if events != self.expected_events or token != self.reference_tokens[child.name]:
                    self.problems["runs"].append({"round": round_index, "child": child.name, "events": events,
                                                  "token": token, "expected_token": self.reference_tokens[child.name]})
                if intervals.parents != PARTS or set(seconds) != set(PARTS):
                    self.problems["parts"].append({"round": round_index, "child": child.name,
                                                   "parents": intervals.parents})
                elif not _nested(seconds):
                    self.problems["parts"].append({"round": round_index, "child": child.name, "seconds": seconds})
                if round_index >= self.warmup:
                    self.kept_parts.append(seconds)
            return {"ttft": ttft}

    def finish(self, case: Case, timing: PairedTiming) -> dict[str, Any]:
        """The arm's checks over its timed runs, on `case`; returns its parts' medians and loading share."""
        pairs = len(timing.pairs)
        if not self.kept_parts and pairs:
            raise EndToEndError("the end-to-end arm recorded no timed run")
        kept = self.kept_parts
        case.check("end_to_end_every_timed_run_staged_and_first_token_equal", not self.problems["runs"],
                   value=self.problems["runs"][:8])
        case.check("end_to_end_parts_nested_and_present",
                   not self.problems["parts"] and len(kept) == pairs * len(self.children),
                   value={"problems": self.problems["parts"][:8], "runs": len(kept), "nesting": PARTS})
        parts_ms = {name: statistics.median(run[name] for run in kept) * 1e3 for name in PARTS
                    if kept and all(name in run for run in kept)}
        # what the end-to-end arm does beyond the repair-only arm, as a share of its own ttft in the same run
        loading = [(run["stage"] + run["private-copy"]) / run["ttft"] for run in kept
                   if {"stage", "private-copy", "ttft"} <= set(run) and run["ttft"] > 0]
        return {"parts_ms_median": parts_ms, "loading_fraction_median": statistics.median(loading) if loading else None}


def _states_equal(case: Case, children: tuple[Child, ...], repair_only: dict[str, RepairOnlyArm],
                  caches: dict[str, KVCache], child_path: Callable[..., tuple[torch.Tensor, BlendResult]],
                  expected_events: list[str], prompt_tokens: int) -> dict[str, int]:
    """Untimed, per child, each arm on its cache poisoned first: the end-to-end state equals the repair-only
    state bit for bit. Returns the repair-only arm's first token per child (what every timed run must give)."""
    comparisons: dict[str, Any] = {}
    events_seen: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    with torch.no_grad():
        for child in children:
            arm = repair_only[child.name]
            arm.cache.raw.fill_(0xFF)                 # NaN in every float format: a position nobody wrote shows
            restored, result = arm.run()
            reference = first_token_state(arm.cache, prompt_tokens, restored, result)
            caches[child.name].raw.fill_(0xFF)
            events: list[str] = []
            restored, result = child_path(child, events)
            got = first_token_state(caches[child.name], prompt_tokens, restored, result)
            comparisons[child.name] = compare_states(reference, got)
            events_seen[child.name] = events
            tokens[child.name] = reference.tokens[0]
    case.record("end_to_end_vs_repair_only", comparisons)
    case.check("end_to_end_state_equals_repair_only", all(identical(c) for c in comparisons.values()),
               value={name: c["first_unequal_layer"] for name, c in comparisons.items()})
    case.check("end_to_end_staged_and_digest_checked_every_segment",
               all(events == expected_events for events in events_seen.values()), value=events_seen)
    return tokens


NESTING_SLACK_S = 1e-6   # per part: CUDA event times resolve to about half a microsecond (exact on the CPU)


def _nested(seconds: dict[str, float]) -> bool:
    """Each part's total within its parent's; the parts directly inside ttft together within it."""
    inside = [name for name, parent in PARTS.items() if parent == "ttft"]
    return all(seconds[name] <= seconds[parent] + NESTING_SLACK_S for name, parent in PARTS.items()
               if parent is not None) and \
        sum(seconds[name] for name in inside) <= seconds["ttft"] + NESTING_SLACK_S * len(inside)
