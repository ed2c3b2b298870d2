"""Stage `vllm`: the pinned vLLM engine with KMeshConnector, end to end.

    stage.py     the engines, every case, and run(cfg)
    prompts.py   the prompts and KMesh's own-runner references (no engine; the agreement measure: kmesh.harness.outputs)
    stored.py    the segments the engine stored, read back from the service for the runner reference
    faults.py    deliberately bad objects for the connector's fallback checks
    refusals.py  arrangements the connector must refuse (engine-free)
"""
from kmesh.stages.vllm.stage import run

__all__ = ["run"]
