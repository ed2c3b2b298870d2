# §21: restore into every KV arrangement × dtype × shift; values, keys, canary (cuda profile: kernel too).
rule synthetic:
    input:
        code=stage_code("synthetic"),
        kernels=result("kernels"),
    output:
        result=result("synthetic"),
    log:
        logfile("synthetic"),
    threads: stage_threads("synthetic")
    priority: stage_priority("synthetic")
    resources:
        gpu=GPU,
        mem_mb=4000,
    shell:
        kmesh_run("synthetic")
