# vLLM alone vs vLLM + LMCache (its multiprocess server, started as its users start it) vs vLLM + KMesh: the same engine
# settings, prompts and pair design, in one run (issue 24). After vllm in the pipeline order (DESIGN §3); its engines
# would only compete with the vllm stage's for the two cores and the memory.
rule peers:
    input:
        code=stage_code("peers"),
        model=result("model"),
        vllm=result("vllm"),   # pipeline order (DESIGN §3)
    output:
        result=result("peers"),
    log:
        logfile("peers"),
    threads: STAGE_THREADS
    resources:
        gpu=None,   # the pinned vLLM and LMCache run on the CPU
        mem_mb=14000,   # four engines at once (~2.6 GB RSS each, 3.2 with KMesh's repair runner) + LMCache's 0.5 GiB L1
    shell:
        kmesh_run("peers")
