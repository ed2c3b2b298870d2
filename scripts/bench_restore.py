"""Thin wrapper over the pipeline stage `restore_bench` (src/kmesh/stages/restore_bench/: design, arms, checks).

    python scripts/bench_restore.py --out results/cuda/bench_restore [--pairs 7] [--shapes qwen05b,mha-large]
        [--variants ",-DRESTORE_ROT_CHUNK=16"]   # nvcc flag sets of kernels/restore_rope.cu; "" = default build

is the same as `python -m kmesh run restore_bench --profile cuda --set restore_bench.pairs=7 ...
--out OUT/bench_restore.json`; kept for scripts/device_restore_check.sh and tuning sessions. Writes
bench_restore.json (the stage's result file) and bench_restore.md (its bandwidth table).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kmesh.config import load_config
from kmesh.report import tables
from kmesh.stages.restore_bench import run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (bench_restore.json, bench_restore.md)")
    ap.add_argument("--profile", default="cuda")
    ap.add_argument("--pairs", type=int, default=None, help="matched pairs (default: config timing.pairs)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: the profile's)")
    ap.add_argument("--reps", type=int, default=None, help="executions per timed interval (copy/kernel)")
    ap.add_argument("--torch-reps", type=int, default=None, help="executions per interval in torch-vs-kernel")
    ap.add_argument("--variants", default=None, help="comma-separated nvcc flag sets; the first is the default")
    args = ap.parse_args(argv)
    sec: dict = {}
    for key, val in (("pairs", args.pairs), ("reps", args.reps), ("torch_reps", args.torch_reps)):
        if val is not None:
            sec[key] = val
    if args.shapes:
        sec["shapes"] = args.shapes.split(",")
    if args.variants is not None:
        sec["variants"] = args.variants.split(",")
    cfg = load_config(profile=args.profile, overrides={"restore_bench": sec} if sec else None)
    res = run(cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res.write(out / "bench_restore.json")
    shapes = res.extra.get("shapes", {})
    text = tables.bandwidth_frame(shapes).to_markdown(index=False) if shapes else "(no shape ran)"
    (out / "bench_restore.md").write_text(text + "\n")
    print(text)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
