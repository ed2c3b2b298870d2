"""Stage `group` (write-up §25): a request group executed layer-major, bit-identical to serial.

    stage.py  the setup and the serial / group / failure / originals cases, and run(cfg)
    path.py   the group path end to end (run_group) and its layer write-back
    load.py   the group's loads through the service and its admission barrier (GroupLoad)
    bench.py  the measurements: batched agreement, scaling pairs, peak memory, bytes held
"""
from kmesh.stages.group.stage import run

__all__ = ["run"]
