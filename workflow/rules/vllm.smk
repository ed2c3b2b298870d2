# The pinned vLLM engine with KMeshConnector: exact reuse, interior segments repaired by KMesh, negative controls
# (a connector that does not write what it reports supplied), fallbacks (corrupt object, service down and back,
# engine exit drains), engine TTFT pairs with vs without KMesh.
rule vllm:
    input:
        code=stage_code("vllm"),
        model=result("model"),
        peers=result("peers"),   # order only: the peers stage's engines bind the same cores (peers.smk)
    output:
        result=result("vllm"),
    log:
        logfile("vllm"),
    threads: stage_threads("vllm")
    priority: stage_priority("vllm")
    resources:
        gpu=None,   # the pinned vLLM is the CPU engine; a 0 would still ask Kubernetes for a GPU
        mem_mb=12000,   # three engines at once (~2.6 GB RSS each, 3.2 with a repair runner) + the stage's runner
    shell:
        kmesh_run("vllm")
