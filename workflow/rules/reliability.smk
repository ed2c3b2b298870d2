# Reliability at scale (issue 26): a soak under memory pressure, a stateful protocol fuzz, service crash consistency,
# engine churn — real processes against the cache service. It needs the converted SmolLM2 (churn's engines) and
# nothing of the model stages after it, so Snakemake may run it beside them.
rule reliability:
    input:
        code=stage_code("reliability"),
        model=result("model"),
    output:
        result=result("reliability"),
    log:
        logfile("reliability"),
    threads: stage_threads("reliability")
    priority: stage_priority("reliability")
    resources:
        gpu=None,   # the service and the CPU vLLM engine: no GPU on either profile
        mem_mb=6000,
    shell:
        kmesh_run("reliability")
