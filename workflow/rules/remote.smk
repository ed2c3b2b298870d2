# The remote tier on Mooncake Store (issue 25): its master started on loopback, two service processes standing for
# two hosts; host A's leader publishes, host B's children fetch once, verified; four arms in matched rounds (remote,
# disk, RAM, full recompute) and the store's failures. The same workload as storage, the next tier down.
rule remote:
    input:
        code=stage_code("remote"),
        model=result("model"),
    output:
        result=result("remote"),
    log:
        logfile("remote"),
    threads: stage_threads("remote")
    priority: stage_priority("remote")
    resources:
        gpu=GPU,   # the children run where the equivalence workload runs (the store client itself is CPU code)
        mem_mb=6000,
    shell:
        kmesh_run("remote")
