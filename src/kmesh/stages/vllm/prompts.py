"""The vllm stage's prompts, KMesh's own-runner references and the agreement measure (no engine here).

Prompts come from the equivalence workload (kmesh.workload, SmolLM2's chat template): the leader saves its
segments, the children place them elsewhere. Exact-reuse and TTFT prompts are children's ids too (real text).

References through OUR runner (kmesh.model.runner.LayerRunner, the engine's weights):
  runner_full    the full recompute of a prompt and its greedy continuation;
  runner_repair  what the engine must produce by construction in the interior case: KMesh's repair of
                 prompt[0:E) over the segments the engine stored (kmesh.vllm.repair.repair_span, the connector's
                 own code) — the K/V the connector hands over — then positions [E, T) computed over them and the
                 greedy continuation, as the engine does after the hand-over.
agreement() compares an engine output with a reference: greedy tokens, and the logprob of every generated token
(the engine's own, SamplingParams.logprobs) against the reference's for the same token in the same context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kmesh.model.blend import RepairConfig, blend
from kmesh.model.quality import first_divergence
from kmesh.model.runner import LayerRunner
from kmesh.restore import restore
from kmesh.vllm.repair import Placed, Repaired, repair_span
from kmesh.workload import Child, Workload


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


@torch.no_grad()
def runner_full(runner: LayerRunner, ids: Sequence[int], max_new_tokens: int) -> RunnerDecode:
    """The runner's full recompute of `ids` and its greedy continuation."""
    cache = runner.new_cache(len(ids) + max_new_tokens)
    first = runner.prefill(torch.tensor(list(ids)), cache)
    steps: list[torch.Tensor] = []
    tokens = runner.decode(cache, len(ids), first, max_new_tokens, step_logits=steps)
    return RunnerDecode(tokens, [first, *steps])


@torch.no_grad()
def runner_repair(runner: LayerRunner, ids: Sequence[int], placed: Sequence[Placed], span_end: int,
                  config: RepairConfig, max_new_tokens: int) -> RunnerDecode:
    """KMesh's repair of ids[0:span_end) over `placed` (what the connector hands the engine), then the rest of
    the prompt computed over those K/V and the greedy continuation (what the engine does after the hand-over)."""
    T = len(ids)
    if not 0 < span_end < T:
        raise ValueError(f"the repaired span must end inside the {T}-token prompt (before its last token), "
                         f"got {span_end}")
    rep = repair_span(runner, list(ids[:span_end]), placed, config)
    cache = runner.new_cache(T + max_new_tokens, fill=float("nan"))      # poison: nothing unwritten can pass
    span = torch.arange(span_end)
    restore(cache.raw, cache.layout, rep.segment, span, span, runner.rope)   # slot = position, no shift
    handed_over = torch.zeros(T, dtype=torch.bool)
    handed_over[:span_end] = True
    # arm "naive": the handed-over positions keep their K/V at every layer, the others are computed over them
    first = blend(runner, torch.tensor(list(ids)), cache, handed_over, config, arm="naive").logits
    steps: list[torch.Tensor] = []
    tokens = runner.decode(cache, T, first, max_new_tokens, step_logits=steps)
    return RunnerDecode(tokens, [first, *steps], rep)


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
