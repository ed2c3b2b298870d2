# The pinned vLLM engine with KMeshConnector: exact reuse, interior segments repaired by KMesh, fallbacks (corrupt
# object, service down and back, engine exit drains), engine TTFT pairs with vs without KMesh.
rule vllm:
    input:
        code=stage_code("vllm"),
        model=result("model"),
        equivalence=result("equivalence"),
        group=result("group"),   # pipeline order (DESIGN §3)
    output:
        result=result("vllm"),
    log:
        logfile("vllm"),
    resources:
        gpu=None,   # the pinned vLLM is the CPU engine; a 0 would still ask Kubernetes for a GPU
        mem_mb=8000,
    shell:
        kmesh_run("vllm")
