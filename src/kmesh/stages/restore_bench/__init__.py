"""Stage `restore_bench`: what a restore costs against moving the same bytes once (design in stage.py).

    stage   run(cfg): per shape, matched pairs copy vs kernel / torch vs kernel (cuda) or copy vs torch (cpu)
    cases   the shapes, one seeded restore per shape, the timed arms and the correctness check
"""
from kmesh.stages.restore_bench.stage import run

__all__ = ["run"]
