# §24 storage routes: the equivalence workload's children restore from object files on disk through two routes
# (cpu: buffered vs O_DIRECT; cuda: staging vs cuFile, mode recorded), 7 matched pairs, raw O_DIRECT floor,
# read-once serving (singleflight + retention) vs forced eviction.
rule storage:
    input:
        code=stage_code("storage"),
        model=result("model"),
    output:
        result=result("storage"),
    log:
        logfile("storage"),
    threads: stage_threads("storage")
    priority: stage_priority("storage")
    resources:
        gpu=GPU,
        mem_mb=6000,
    shell:
        kmesh_run("storage")
