"""The model the connector repairs interior spans with: a second copy of the engine's weights loaded through
transformers into KMesh's layer-wise runner (kmesh.model.runner.LayerRunner implements kmesh.kv.repair.RepairModel).
The engine's own loaded model is the goal (its own issue); this is what runs until then."""
from __future__ import annotations

from pathlib import Path

import torch

from kmesh.model.runner import LayerRunner


def load_runner(folder: str | Path, dtype: torch.dtype = torch.float32) -> LayerRunner:
    from transformers import AutoModelForCausalLM

    from kmesh.model.offline import go_offline

    go_offline()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True).eval()
    return LayerRunner(model)
