"""Where a child's restore time goes, part by part, at 4k and 16k tokens (GPU).

The equivalence workload (cuda profile model) scaled to each prompt length, the leader prefilled; for child A,
each part timed alone with CUDA events (median of 15 after 3 warm-ups): capture (the gather of the child's
segments out of the private copy, kmesh.kv.restore.capture), plan (plan_restore: validation, shift tables), the
write of a made plan per backend (torch, cuda), and kmesh.harness.child.restore_child end to end per backend.

Output (JSON, --out; printed as well), per prompt length: tokens_restored, segment_bytes, capture_ms, plan_ms,
write_torch_ms, write_cuda_ms, restore_child_torch_ms, restore_child_cuda_ms, and backends_bytes_equal (the two
backends' caches byte-identical: must be true). restore_child minus the parts is its fixed cost (synchronisations,
allocations): see docs/measurements/equivalence-h200/README.md.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kmesh.diagnostics._common import ScaledLeader, load, parser, require_cuda, scaled_leaders, timed, write_json
from kmesh.harness.child import restore_child
from kmesh.harness.modelsetup import ModelSetup, equivalence_setup
from kmesh.kv.restore import capture, plan_restore

PROMPT_TOKENS = (4096, 16384)
timed15 = functools.partial(timed, reps=15)


def breakdown(setup: ModelSetup, scaled: ScaledLeader) -> dict[str, Any]:
    """The parts of child A's restore at one prompt length (keys: see the module doc)."""
    runner, child, export, length = setup.runner, scaled.child, scaled.export, scaled.prompt_tokens
    cache = runner.new_cache(length, scaled.workload.spec.block_size)
    device = cache.raw.device
    slices = child.segment_slices()
    slots = torch.cat([export.catalog.entries[seg].slots(device) for seg, _, _ in slices])
    old_pos = torch.cat([export.catalog.entries[seg].leader_positions(device) for seg, _, _ in slices])
    new_pos = torch.cat([torch.arange(start, end, device=device) for _, start, end in slices])
    segment = capture(export.raw, export.catalog.layout, slots, old_pos)
    row: dict[str, Any] = {
        "tokens_restored": int(new_pos.numel()), "segment_bytes": segment.nbytes,
        "capture_ms": timed15(lambda: capture(export.raw, export.catalog.layout, slots, old_pos)),
        "plan_ms": timed15(lambda: plan_restore(cache.raw, cache.layout, segment, new_pos, new_pos, runner.rope))}
    plan = plan_restore(cache.raw, cache.layout, segment, new_pos, new_pos, runner.rope)
    for backend in ("torch", "cuda"):
        row[f"write_{backend}_ms"] = timed15(lambda: plan.run(backend))
        row[f"restore_child_{backend}_ms"] = timed15(
            lambda: restore_child(cache, export.catalog, export.raw, child, runner, backend))
    by_torch = runner.new_cache(length, scaled.workload.spec.block_size)
    by_cuda = runner.new_cache(length, scaled.workload.spec.block_size)
    restore_child(by_torch, export.catalog, export.raw, child, runner, "torch")
    restore_child(by_cuda, export.catalog, export.raw, child, runner, "cuda")
    row["backends_bytes_equal"] = bool(torch.equal(by_torch.raw, by_cuda.raw))
    return row


def main(argv: list[str] | None = None) -> int:
    args = parser("restore_breakdown", __doc__, config=True, out=True).parse_args(argv)
    require_cuda("restore_breakdown")
    cfg = load(args)
    setup = equivalence_setup(cfg)
    out: dict[str, Any] = {}
    for scaled in scaled_leaders(setup, PROMPT_TOKENS, "rb"):
        out[str(scaled.prompt_tokens)] = breakdown(setup, scaled)
        print(scaled.prompt_tokens, out[str(scaled.prompt_tokens)], flush=True)
    write_json(args.out, out, cfg)
    return 0
