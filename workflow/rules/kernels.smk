# Compile every kernels/*.cu for sm_90 (and load them where the profile has a GPU).
rule kernels:
    input:
        code=stage_code("kernels"),
        sources=result("sources"),
        cu=sorted(glob.glob("kernels/*.cu") + glob.glob("kernels/*.cuh")),
    output:
        result=result("kernels"),
    log:
        logfile("kernels"),
    threads: stage_threads("kernels")
    priority: stage_priority("kernels")
    resources:
        gpu=GPU,
        mem_mb=2000,
    shell:
        kmesh_run("kernels")
