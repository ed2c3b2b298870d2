# §23: no memory is reused before accepted copies physically complete (copier and owner are separate processes).
rule drain:
    input:
        code=stage_code("drain"),
        sources=result("sources"),
    output:
        result=result("drain"),
    log:
        logfile("drain"),
    threads: stage_threads("drain")
    priority: stage_priority("drain")
    resources:
        gpu=GPU,
        mem_mb=2000,
    shell:
        kmesh_run("drain")
