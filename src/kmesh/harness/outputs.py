"""Engine outputs against the harness's references (the vllm and peers stages): agreement of tokens and logits,
and the spans a child places its segments at.

agreement() compares an engine output (kmesh.vllm.engine: tokens and its own per-step logprobs) with a reference:
KMesh's runner (a RunnerDecode) or another engine's output on the same prompt: greedy tokens, and the logprob of
every generated token against the reference's for the same token in the same context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kmesh.harness.workload import Child, Workload
from kmesh.kv.repair import Repaired
from kmesh.model.quality import first_divergence


@dataclass
class RunnerDecode:
    """KMesh's runner on one prompt: greedy tokens and the next-token logits [vocab] behind each of them."""

    tokens: list[int]
    logits: list[torch.Tensor]
    repair: Repaired | None = field(default=None, repr=False)     # runner_repair: the K/V handed over


@dataclass(frozen=True)
class Agreement:
    """An engine output against a reference on the same prompt."""

    tokens_equal: bool
    first_divergence: int
    max_logprob_diff: float     # nats, over every step both took in the same context (up to the divergence)
    steps_compared: int

    def within(self, bound: float) -> bool:
        """The check the stage asserts: the same greedy tokens, every token's logprob within `bound` nats."""
        return self.tokens_equal and self.steps_compared > 0 and self.max_logprob_diff <= bound

    def describe(self) -> dict[str, Any]:
        return {"tokens_equal": self.tokens_equal, "first_divergence": self.first_divergence,
                "max_logprob_diff": self.max_logprob_diff, "steps_compared": self.steps_compared}


def save_spans(workload: Workload) -> list[list[int]]:
    """The leader's segments as [start, end) token spans (the request's kmesh_save_segments)."""
    return [[seg.leader_start, seg.leader_start + seg.tokens] for seg in workload.segments]


def child_spans(child: Child) -> list[list[int]]:
    """Where the child placed each segment, as [start, end) token spans (the request's kmesh_segments)."""
    return [[a, b] for _, a, b in child.segment_slices()]


def _engine_logprob(step: dict[str, float] | None, token: int) -> float | None:
    if not step:
        return None
    return step.get(str(token))


def agreement(engine_out: dict[str, Any], ref: RunnerDecode | dict[str, Any]) -> Agreement:
    """The engine's greedy tokens and per-token logprobs against our runner's (a RunnerDecode) or against
    another engine output (its own logprobs). Logprobs are compared at every step up to and including the
    first divergence (the same context on both sides), for the token the engine generated."""
    got = list(engine_out["tokens"])
    steps = engine_out.get("logprobs") or []
    if isinstance(ref, RunnerDecode):
        ref_tokens = ref.tokens
        equal = bool(got) and got == ref_tokens[:len(got)]

        def ref_lp(i: int, token: int) -> float | None:
            return float(torch.log_softmax(ref.logits[i].double(), -1)[token]) if i < len(ref.logits) else None
    else:
        ref_tokens = list(ref["tokens"])
        equal = bool(got) and got == ref_tokens
        ref_steps = ref.get("logprobs") or []

        def ref_lp(i: int, token: int) -> float | None:
            return _engine_logprob(ref_steps[i], token) if i < len(ref_steps) else None
    div = first_divergence(ref_tokens, got)
    diffs = []
    for i, token in enumerate(got[:div + 1]):
        mine = _engine_logprob(steps[i] if i < len(steps) else None, token)
        theirs = ref_lp(i, token)
        if mine is not None and theirs is not None:
            diffs.append(abs(mine - theirs))
    return Agreement(equal, div, max(diffs) if diffs else math.inf, len(diffs))


def tokens_of(outputs: Sequence[dict[str, Any]]) -> list[list[int]]:
    return [o["tokens"] for o in outputs]


def repairs_by_request(outputs: list[dict[str, Any]], repairs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The connector's repair records of each output, matched by the engine's request id (the output's kmesh
    report carries it), never by position in the list: one list per output (exactly one repair expected)."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for rep in repairs:
        by_id.setdefault(str(rep["req_id"]), []).append(rep)
    return [by_id.get(str((o.get("kmesh") or {}).get("req_id")), []) for o in outputs]
