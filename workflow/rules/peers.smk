# vLLM alone vs vLLM + LMCache (its multiprocess server, started as its users start it) vs vLLM + KMesh: the same engine
# settings, prompts and pair design, in one run (issue 24). After reliability, before vllm: the three stages that start
# vLLM engines bind them to the same cores (threads_bind "0-1"), so they run one after another and never time beside
# each other's engines, also on a machine with cores enough to run them at once (order-only inputs). Peers and vllm
# declare 2 threads, so on the 2-core machine nothing else runs beside them either.
rule peers:
    input:
        code=stage_code("peers"),
        model=result("model"),
        reliability=result("reliability"),   # order only: its engine churn binds the same cores
    output:
        result=result("peers"),
    log:
        logfile("peers"),
    threads: stage_threads("peers")
    priority: stage_priority("peers")
    resources:
        gpu=None,   # the pinned vLLM and LMCache run on the CPU
        mem_mb=14000,   # four engines at once (~2.6 GB RSS each, 3.2 with KMesh's repair runner) + LMCache's 0.5 GiB L1
    shell:
        kmesh_run("peers")
