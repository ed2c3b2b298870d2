# §25: a request group executed layer-major — bit-identical to serial (in-process and through the service), child B
# failing after its first layer is isolated, batched group math within a measured bound, scaling pairs, bytes held.
rule group:
    input:
        code=stage_code("group"),
        model=result("model"),
    output:
        result=result("group"),
    log:
        logfile("group"),
    threads: stage_threads("group")
    priority: stage_priority("group")
    resources:
        gpu=GPU,
        mem_mb=6000,
    shell:
        kmesh_run("group")
