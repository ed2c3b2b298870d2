"""The vllm stage's prompts and KMesh's own-runner references (no engine here).

Prompts come from the equivalence workload (kmesh.harness.workload, SmolLM2's chat template): the leader saves its
segments, the children place them elsewhere. Exact-reuse and TTFT prompts are children's ids too (real text).

References through OUR runner (kmesh.model.runner.LayerRunner, the engine's weights):
  runner_full    the full recompute of a prompt and its greedy continuation;
  runner_repair  what the engine must produce by construction in the interior case: KMesh's repair of
                 prompt[0:E) over the segments the engine stored (kmesh.kv.repair.repair_span, the connector's
                 own code) — the K/V the connector hands over — then positions [E, T) computed over them and the
                 greedy continuation, as the engine does after the hand-over.
The agreement measure (agreement(), Agreement) and the span helpers live in kmesh.harness.outputs: the peers stage
compares engine outputs the same way.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from kmesh.kv.repair import repair_span
from kmesh.kv.restore import restore
from kmesh.model.blend import RepairConfig, blend
from kmesh.model.runner import LayerRunner
from kmesh.vllm.loads import Span
from kmesh.harness.outputs import RunnerDecode


@torch.no_grad()
def runner_full(runner: LayerRunner, ids: Sequence[int], max_new_tokens: int) -> RunnerDecode:
    """The runner's full recompute of `ids` and its greedy continuation."""
    cache = runner.new_cache(len(ids) + max_new_tokens)
    first = runner.prefill(torch.tensor(list(ids)), cache)
    steps: list[torch.Tensor] = []
    tokens = runner.decode(cache, len(ids), first, max_new_tokens, step_logits=steps)
    return RunnerDecode(tokens, [first, *steps])


@torch.no_grad()
def runner_repair(runner: LayerRunner, ids: Sequence[int], span: Span, span_end: int,
                  config: RepairConfig, max_new_tokens: int) -> RunnerDecode:
    """KMesh's repair of ids[0:span_end) over the restored `span` (what the connector hands the engine), then the rest
    of the prompt computed over those K/V and the greedy continuation (what the engine does after the hand-over)."""
    T = len(ids)
    if not 0 < span_end < T:
        raise ValueError(f"the repaired span must end inside the {T}-token prompt (before its last token), "
                         f"got {span_end}")
    rep = repair_span(runner, list(ids[:span_end]), span.raw, span.layout, span.restored, config,
                      keep_restored=True)
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
