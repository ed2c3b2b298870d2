"""The layer step eager vs compiled (kmesh.model.layer_step), per arm (full / repair), at 4k and 16k tokens (GPU).

For each prompt length the equivalence workload is scaled to it, the leader prefilled and child A restored. Four
CUDA graphs are captured over copies of that restored cache: {full, repair} × {eager, compiled}; each graph is
first compared bit for bit with its own step run eagerly (`graphs_equal_eager`), and each compiled arm with the
eager arm (logits max |Δ| / max |logit|, argmax equal, masks equal: the step's rounding may move a near-tie of the
check layer's selection). Then rounds: every round replays the four graphs once each, the order reversed from
round to round (kmesh.bench.rotate), each replay timed with CUDA events and synchronised; 2 warm-up rounds.

Output (JSON, --out; printed as well), one entry per prompt length with the checks above and kmesh.bench's paired
summaries: `<arm>_eager_vs_compiled` (A eager, B compiled: median_ratio below 1 is compiled faster) and
`full_vs_repair_<step>` (A full, B repair: what a TTFT ratio of that step sees).
"""
from __future__ import annotations

from typing import Any

import torch

from kmesh.bench import rotate
from kmesh.diagnostics._common import ScaledLeader, load, parser, require_cuda, scaled_leaders, write_json
from kmesh.harness.child import restore_child
from kmesh.harness.modelsetup import ModelSetup, deterministic_kernels, equivalence_setup
from kmesh.model.graphs import GraphedBlend
from kmesh.model.runner import LayerRunner

PROMPT_TOKENS = (4096, 16384)
ROUNDS = 15
WARMUP_ROUNDS = 2
ARMS = ("full", "repair")
STEPS = ("eager", "compiled")


def _replay_ms(graph: GraphedBlend) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def pair_steps(setup: ModelSetup, runners: dict[str, LayerRunner], scaled: ScaledLeader) -> dict[str, Any]:
    child, export, length = scaled.child, scaled.export, scaled.prompt_tokens
    eager = runners["eager"]
    ids = torch.tensor(child.ids, device=setup.device)
    pristine = eager.new_cache(length, scaled.workload.spec.block_size)
    restored = restore_child(pristine, export.catalog, export.raw, child, eager, "cuda")
    graphs: dict[tuple[str, str], GraphedBlend] = {}
    checks: dict[str, Any] = {}
    for step, runner in runners.items():
        for arm in ARMS:
            mask = restored if arm == "repair" else torch.zeros(length, dtype=torch.bool)
            cache = runner.cache_over(pristine.raw.clone(), pristine.layout, fill=None)
            g = GraphedBlend(runner, ids, cache, mask, setup.ctx.repair, arm)
            checks[f"graphs_equal_eager_{arm}_{step}"] = g.verify_against_eager()
            graphs[(arm, step)] = g
    for arm in ARMS:
        e, c = graphs[(arm, "eager")].replay(), graphs[(arm, "compiled")].replay()
        scale = float(e.logits.float().abs().max())
        checks[f"compiled_vs_eager_{arm}"] = {
            "logits_max_abs_diff_rel": float((e.logits.float() - c.logits.float()).abs().max()) / max(scale, 1.0),
            "argmax_equal": int(e.logits.argmax()) == int(c.logits.argmax()),
            "masks_equal_layers": int((e.masks == c.masks).all(1).sum()), "layers": int(e.masks.shape[0])}
    def run_arm(arm: str, _round: int) -> dict[str, list[float]]:
        return {"replay": [_replay_ms(graphs[tuple(arm.split("-"))]) / 1e3]}

    rounds = rotate(tuple(f"{a}-{s}" for a, s in graphs), ROUNDS, WARMUP_ROUNDS, run_arm)
    out: dict[str, Any] = {"prompt_tokens": length, "rounds": ROUNDS, "warmup_rounds": WARMUP_ROUNDS,
                           "checks": checks}
    for arm in ARMS:   # A = eager, B = compiled: median_ratio below 1 is compiled faster
        out[f"{arm}_eager_vs_compiled"] = rounds.paired(f"{arm}-eager", f"{arm}-compiled").to_dict()["summary"]
    for step in STEPS:  # A = full, B = repair: what a TTFT ratio of that step sees
        out[f"full_vs_repair_{step}"] = rounds.paired(f"full-{step}", f"repair-{step}").to_dict()["summary"]
    print(length, {k: {p: (v["median_a"], v["median_b"], v["median_ratio"]) for p, v in out[k].items()}
                   for k in out if "_vs_" in k}, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser("layer_step_pair", __doc__, config=True, out=True).parse_args(argv)
    require_cuda("layer_step_pair")
    cfg = load(args)
    deterministic_kernels()
    setup = equivalence_setup(cfg)
    runners = {step: LayerRunner(setup.model, setup.runner.attention, step) for step in STEPS}
    out = {"model": setup.what, "attention": setup.runner.attention,
           "lengths": [pair_steps(setup, runners, scaled) for scaled in scaled_leaders(setup, PROMPT_TOKENS, "ls")]}
    write_json(args.out, out, cfg)
    return 0
