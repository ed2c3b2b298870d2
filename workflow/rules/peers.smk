# vLLM alone vs vLLM + LMCache (its multiprocess server, started as its users start it) vs vLLM + KMesh: the same engine
# settings, prompts and pair design, in one run (issue 24). After equivalence (KMesh's own data path proven first) and
# after reliability, before vllm: the three stages that start vLLM engines bind them to the same cores
# (threads_bind "0-1"), so they run one after another and never time beside each other's engines; the other stages
# of that stretch (storage, integrity, remote, group) may run beside peers where cores are free.
rule peers:
    input:
        code=stage_code("peers"),
        model=result("model"),
        equivalence=result("equivalence"),   # pipeline order (DESIGN §3)
        reliability=result("reliability"),   # order only: its engine churn binds the same cores
    output:
        result=result("peers"),
    log:
        logfile("peers"),
    threads: stage_threads("peers")
    resources:
        gpu=None,   # the pinned vLLM and LMCache run on the CPU
        mem_mb=14000,   # four engines at once (~2.6 GB RSS each, 3.2 with KMesh's repair runner) + LMCache's 0.5 GiB L1
    shell:
        kmesh_run("peers")
