# §24: children restore the leader's shared segments in-process and through the cache service; repaired state must be
# bit-identical on both paths; seven failure controls; quality of the repair arms; TTFT pairs.
rule equivalence:
    input:
        code=stage_code("equivalence"),
        model=result("model"),
    output:
        result=result("equivalence"),
    log:
        logfile("equivalence"),
    threads: stage_threads("equivalence")
    priority: stage_priority("equivalence")
    resources:
        gpu=GPU,
        mem_mb=6000,
    shell:
        kmesh_run("equivalence")
