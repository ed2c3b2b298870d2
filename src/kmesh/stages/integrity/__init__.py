"""Stage `integrity`: checking restored objects — the write-up's whole-object GPU SHA-256 reproduced, and the
formats that let a GPU check win (sha256-tree, BLAKE3). The case list is in stage.py.

    stage   run(cfg): refusals, CPU and GPU digests against references, the chunk sweep, the arm benchmarks
    arms    the data sets, arms and rotating trial loop of the benchmarks
    gpu     the GPU digest checks and the big object's whole-object SHA-256
"""
from kmesh.stages.integrity.stage import run

__all__ = ["run"]
