"""GPU: where a child's restore time goes (equivalence workload scaled to T tokens, cuda profile model).

Parts timed separately with CUDA events after warm-up (median of 15): the gather of the child's segments out of
the private copy (capture), plan_restore (validation, shift tables), the write (torch vs cuda backend), and
restore_child end to end per backend. Writes JSON to argv[1].
"""
import functools
import json
import sys

import torch
from gpu_timing import timed

timed15 = functools.partial(timed, reps=15)

from kmesh.config import load_config
from kmesh.restore import capture, plan_restore
from kmesh.segments import restore_child
from kmesh.stages import equivalence as eq
from kmesh.workload import build


cfg = load_config(profile="cuda")
s = eq._setup(cfg)
r = s.runner
out = {}
for T in (4096, 16384):
    wl = build(s.tok, cfg.seed, s.workload.spec.scaled(T))
    ex = eq.leader_prefill(r, wl, f"kmesh-eq/rb-{T}".encode())
    child = wl.children[0]
    cache = r.new_cache(T, wl.spec.block_size)
    dev = cache.raw.device
    sl = child.segment_slices()
    src = torch.cat([ex.catalog.entries[g].slots(dev) for g, _, _ in sl])
    old = torch.cat([ex.catalog.entries[g].leader_positions(dev) for g, _, _ in sl])
    new = torch.cat([torch.arange(a, b, device=dev) for _, a, b in sl])
    seg = capture(ex.raw, ex.catalog.layout, src, old)
    row = {"tokens_restored": int(new.numel()), "segment_bytes": seg.nbytes,
           "capture_ms": timed15(lambda: capture(ex.raw, ex.catalog.layout, src, old)),
           "plan_ms": timed15(lambda: plan_restore(cache.raw, cache.layout, seg, new, new, r.rope))}
    pl = plan_restore(cache.raw, cache.layout, seg, new, new, r.rope)
    for be in ("torch", "cuda"):
        row[f"write_{be}_ms"] = timed15(lambda: pl.run(be))
        row[f"restore_child_{be}_ms"] = timed15(lambda: restore_child(cache, ex.catalog, ex.raw, child, r, be))
    a = r.new_cache(T, wl.spec.block_size); b = r.new_cache(T, wl.spec.block_size)
    restore_child(a, ex.catalog, ex.raw, child, r, "torch"); restore_child(b, ex.catalog, ex.raw, child, r, "cuda")
    row["backends_bytes_equal"] = bool(torch.equal(a.raw, b.raw))
    out[str(T)] = row
    print(T, row, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
