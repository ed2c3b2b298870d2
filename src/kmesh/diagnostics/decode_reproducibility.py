"""Is greedy decode of the equivalence workload bit-reproducible run to run, with a service process beside it?

Seven full recomputes of one child (default C) through the layer-wise runner, each followed by `--steps` greedy
decode steps: runs 0-1 on a quiet device, runs 2-4 while a service process runs (started as the equivalence
stage starts it: on a GPU, another process's CUDA context), runs 5-6 after it stopped. Kernels are made
deterministic first (kmesh.harness.modelsetup.deterministic_kernels), as the equivalence stage makes them.

Output, one line per run: `<run> token_div <i> first_logits_neq_step <j> [top3 ...]`. token_div is the first
generated token that differs from run 0's (None: every token equal); first_logits_neq_step the first step whose
logits are not bit-equal to run 0's (0 = the prefill's logits; None: all equal). Where tokens diverge, the top-3
logits (values, ids) of this run and of run 0 at that token follow: a near-tie there means one ulp decided it.
Reproducible means every line reads `None ... None`. Runs on the cpu profile too (`--profile cpu`).
"""
from __future__ import annotations

import torch

from kmesh.diagnostics import DiagnosticError
from kmesh.diagnostics._common import load, parser, require_cuda
from kmesh.harness.child import new_cache
from kmesh.harness.modelsetup import ModelSetup, deterministic_kernels, equivalence_setup
from kmesh.harness.service import Harness
from kmesh.harness.workload import Child
from kmesh.model.blend import blend


def recompute_and_decode(setup: ModelSetup, child: Child, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Full-recompute prefill of `child`, then `steps` greedy decode steps: (tokens, logits per step on the CPU,
    the prefill's first)."""
    ids = torch.tensor(child.ids, device=setup.device)
    cache = new_cache(setup.ctx, child)
    first = blend(setup.runner, ids, cache, torch.zeros(len(ids), dtype=torch.bool), setup.ctx.repair, "full")
    step_logits: list[torch.Tensor] = []
    tokens = setup.runner.decode(cache, len(ids), first.logits, steps + 1, step_logits=step_logits)
    return tokens, [logits.float().cpu() for logits in (first.logits, *step_logits)]


def compare(run: int, base: tuple[list[int], list[torch.Tensor]], other: tuple[list[int], list[torch.Tensor]]) -> str:
    """One output line: where `other` first differs from `base` (tokens, then bit-equal logits)."""
    (base_tokens, base_logits), (tokens, logits) = base, other
    token_div = next((i for i, (a, b) in enumerate(zip(base_tokens, tokens)) if a != b), None)
    first_neq = next((i for i, (a, b) in enumerate(zip(base_logits, logits)) if not torch.equal(a, b)), None)
    info = ""
    if token_div is not None:
        top, top_base = torch.topk(logits[token_div], 3), torch.topk(base_logits[token_div], 3)
        info = (f" run top3 {top.values.tolist()} {top.indices.tolist()}"
                f" base top3 {top_base.values.tolist()} {top_base.indices.tolist()}")
    return f"{run} token_div {token_div} first_logits_neq_step {first_neq}{info}"


def main(argv: list[str] | None = None) -> int:
    options = parser("decode_reproducibility", __doc__, config=True)
    options.add_argument("--child", default="C", help="which child of the equivalence workload (default C)")
    options.add_argument("--steps", type=int, default=23, help="greedy decode steps after the prefill (default 23)")
    args = options.parse_args(argv)
    cfg = load(args)
    if cfg.section("equivalence")["device"] == "cuda":
        require_cuda("decode_reproducibility")
    deterministic_kernels()
    setup = equivalence_setup(cfg)
    children = {child.name: child for child in setup.workload.children}
    if args.child not in children:
        raise DiagnosticError(f"no child {args.child!r} in the equivalence workload; it has {', '.join(children)}")
    child = children[args.child]
    runs = [recompute_and_decode(setup, child, args.steps) for _ in range(2)]
    with Harness(device=str(setup.device), heartbeat_timeout_s=float(setup.sec["heartbeat_timeout_s"]),
                 chunk_bytes=int(setup.sec["chunk_bytes"])):
        runs += [recompute_and_decode(setup, child, args.steps) for _ in range(3)]
    runs += [recompute_and_decode(setup, child, args.steps) for _ in range(2)]
    for run, outcome in enumerate(runs):
        print(compare(run, runs[0], outcome), flush=True)
    return 0
