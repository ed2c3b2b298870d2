# Prepare the models: SmolLM2 GGUF -> safetensors folder (cached, bit-identical logits), seeded random Qwen2.
# The stage reads config.yaml + the profile file + the run's overlay (which Snakemake's `config` lacks), so ask it
# the same way: the converted folder is where the stage writes it (make test's overlay moves it to results/test).
from kmesh.config import load_config as _load_config

_MODEL = _load_config(profile=PROFILE, overlays=[OVERLAY] if OVERLAY else []).section("model")
_CONVERTED = (
    {"manifest": f"{_MODEL['dir']}/{_MODEL['smollm2']['name']}/manifest.json"}
    if _MODEL["smollm2"].get("enabled", True)
    else {}
)
if _CONVERTED and _MODEL["smollm2"].get("layers") is not None:
    # the first-layers folder the other stages load (make test's overlay: model.smollm2.layers)
    _CONVERTED["first_layers"] = f"{_MODEL['dir']}/{_MODEL['smollm2']['name']}-layers{_MODEL['smollm2']['layers']}/manifest.json"


rule model:
    input:
        code=stage_code("model"),
        sources=result("sources"),
    output:
        result=result("model"),
        **_CONVERTED,
    log:
        logfile("model"),
    threads: stage_threads("model")
    priority: stage_priority("model")
    resources:
        gpu=GPU,
        mem_mb=4000,
    shell:
        kmesh_run("model")
