"""Stage `equivalence` (write-up §24, first half): segments saved by a leader restored and repaired in children,
bit for bit the same whether they came from inside the model process or through the cache service.

    stage.py     the setup and the runner / workload / leader / child / quality cases, and run(cfg)
    refs.py      the per-child references the later cases compare with (full recompute, repaired in-process)
    controls.py  negative controls (a flipped bit is caught) and the seven failure controls
    ttft.py      time to first token, matched pairs
"""
from kmesh.stages.equivalence.stage import run

__all__ = ["run"]
