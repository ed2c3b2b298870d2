# Prepare the models: SmolLM2 GGUF -> safetensors folder (cached, bit-identical logits), seeded random Qwen2.
# The stage reads config.yaml + the profile overlay (which Snakemake's `config` lacks), so ask it the same way.
from kmesh.config import load_config as _load_config

_MODEL = _load_config(profile=PROFILE).section("model")
_CONVERTED = (
    {"manifest": f"{_MODEL['dir']}/{_MODEL['smollm2']['name']}/manifest.json"}
    if _MODEL["smollm2"].get("enabled", True)
    else {}
)


rule model:
    input:
        code=stage_code("model"),
        sources=result("sources"),
    output:
        result=result("model"),
        **_CONVERTED,
    log:
        logfile("model"),
    resources:
        gpu=GPU,
        mem_mb=4000,
    shell:
        kmesh_run("model")
