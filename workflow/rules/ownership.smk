# §22: the cache service owns shared state across processes: registration identity and generation,
# close vs release, cancelled copies, heartbeat loss, killed clients (real service + client processes).
rule ownership:
    input:
        code=stage_code("ownership"),
        drain=result("drain"),
    output:
        result=result("ownership"),
    log:
        logfile("ownership"),
    threads: stage_threads("ownership")
    priority: stage_priority("ownership")
    resources:
        gpu=GPU,
        mem_mb=3000,
    shell:
        kmesh_run("ownership")
