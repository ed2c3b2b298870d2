"""Stage `vllm`: the pinned vLLM engine with KMeshConnector, end to end.

    stage.py     the engines, every case, and run(cfg)
    prompts.py   the prompts and KMesh's own-runner references (no engine)
    faults.py    deliberately bad objects for the connector's fallback checks
    refusals.py  arrangements the connector must refuse (engine-free)
"""
from kmesh.stages.vllm.stage import run

__all__ = ["run"]
