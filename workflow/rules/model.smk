# Prepare the models: SmolLM2 GGUF -> safetensors folder (cached, bit-identical logits), seeded random Qwen2.
_SMOLLM2 = config["model"]["smollm2"]
_CONVERTED = (
    {"manifest": f"{config['model']['dir']}/{_SMOLLM2['name']}/manifest.json"}
    if _SMOLLM2.get("enabled", True)
    else {}
)


rule model:
    input:
        sources=result("sources"),
    output:
        result=result("model"),
        **_CONVERTED,
    log:
        logfile("model"),
    resources:
        gpu=GPU,
        mem_mb=6000,
    shell:
        kmesh_run("model")
