"""The dtype a stage runs SmolLM2 in (`model.smollm2.run_dtype`): the converted folder stays float32, the model a
stage gets is cast (the cuda profile runs it in bf16, as served)."""
from __future__ import annotations

import pytest
import torch

from smollm2_model import converted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_runs_in_the_configured_dtype(dtype: str) -> None:
    from kmesh.config import load_config, parse_overrides
    from kmesh.harness.modelsetup import load_model

    folder = converted()     # the whole model, wherever the suite's tests load it (tests/smollm2_model.py)
    cfg = load_config(profile="cpu", overrides=parse_overrides([f"model.smollm2.run_dtype={dtype}",
                                                                 f"model.dir={folder.parent}"]))
    model, tok, what = load_model(cfg, {"model": "smollm2"}, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert what.endswith(f":{dtype}")
    assert tok.encode("Paris")


def test_cuda_profile_runs_smollm2_in_bf16_and_cpu_in_float32() -> None:
    from kmesh.config import load_config

    assert load_config(profile="cuda").section("model")["smollm2"]["run_dtype"] == "bfloat16"
    assert load_config(profile="cpu").section("model")["smollm2"]["run_dtype"] == "float32"


def test_unknown_run_dtype_is_refused() -> None:
    from kmesh.config import load_config, parse_overrides
    from kmesh.errors import ConfigError

    with pytest.raises(ConfigError, match="run_dtype"):
        load_config(profile="cpu", overrides=parse_overrides(["model.smollm2.run_dtype=int8"]))
