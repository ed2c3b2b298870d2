# Issue 11: integrity microbenchmark — whole-object SHA-256 (the write-up's GPU kernel), sha256-tree and BLAKE3, CPU
# and CUDA, 15 trials rotating order; every digest checked against an independent reference.
rule integrity:
    input:
        code=stage_code("integrity"),
        kernels=result("kernels"),
        cu=sorted(glob.glob("kernels/sha256*.cu") + glob.glob("kernels/blake3*.cu") + glob.glob("kernels/*.cuh")),
    output:
        result=result("integrity"),
    log:
        logfile("integrity"),
    threads: stage_threads("integrity")
    priority: stage_priority("integrity")
    resources:
        gpu=GPU,
        mem_mb=4000,
    shell:
        kmesh_run("integrity")
