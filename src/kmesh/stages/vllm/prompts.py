"""The vllm stage's prompts and KMesh's own-runner references (no engine here).

Prompts come from the equivalence workload (kmesh.workload, SmolLM2's chat template): the leader saves its
segments, the children place them elsewhere. Exact-reuse and TTFT prompts are children's ids too (real text).
The runner side (kmesh.child, the lead's code) gives, for each child, the full recompute and KMesh's repair
through OUR runner with OUR leader's K/V — what the engine's outputs are compared with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kmesh.child import ChildContext, ChildOutcome, full_reference, run_child
from kmesh.model.blend import RepairConfig
from kmesh.model.runner import LayerRunner
from kmesh.modelsetup import leader_prefill
from kmesh.segments import InProcessSegments
from kmesh.transfer.engine import TransferEngine
from kmesh.workload import Child, Workload


@dataclass
class RunnerRefs:
    full: dict[str, ChildOutcome]
    kmesh: dict[str, ChildOutcome]


def save_spans(workload: Workload) -> list[list[int]]:
    """The leader's segments as [start, end) token spans (the request's kmesh_save_segments)."""
    return [[seg.leader_start, seg.leader_start + seg.tokens] for seg in workload.segments]


def child_spans(child: Child) -> list[list[int]]:
    """Where the child placed each segment, as [start, end) token spans (the request's kmesh_segments)."""
    return [[a, b] for _, a, b in child.segment_slices()]


def runner_refs(runner: LayerRunner, workload: Workload, repair: RepairConfig, max_new_tokens: int,
                full: bool = True) -> RunnerRefs:
    export = leader_prefill(runner, workload, b"kmesh-vllm/runner-leader")
    ctx = ChildContext(runner, export.catalog, TransferEngine("cpu"), repair, max_new_tokens)
    source = InProcessSegments(export)
    staging = torch.empty(export.catalog.nbytes, dtype=torch.uint8)
    private = torch.empty_like(staging)
    fulls = {ch.name: full_reference(ctx, ch) for ch in workload.children} if full else {}
    kmesh = {ch.name: run_child(ctx, ch, source, staging, private) for ch in workload.children}
    return RunnerRefs(fulls, kmesh)


def logprob_gap(engine_top: dict[str, float] | None, ref: Any) -> float:
    """Max |logprob| difference over the engine's top-k first-token candidates, against full logits of our
    runner or another engine's top-k (over the candidates both list; see topk_overlap)."""
    if not engine_top:
        return math.inf
    if isinstance(ref, torch.Tensor):
        logprobs = torch.log_softmax(ref.double(), -1)
        return max(abs(v - float(logprobs[int(k)])) for k, v in engine_top.items())
    shared = [k for k in engine_top if k in ref]
    return max(abs(engine_top[k] - ref[k]) for k in shared) if shared else math.inf


def topk_overlap(a: dict[str, float] | None, b: dict[str, float] | None) -> float:
    """Fraction of a's top-k first-token candidates that b lists too."""
    return len(set(a or ()) & set(b or ())) / max(len(a or ()), 1)


def tokens_of(outputs: Sequence[dict[str, Any]]) -> list[list[int]]:
    return [o["tokens"] for o in outputs]
