# Pinned vLLM + LMCache: fetch the locked files, verify sha256, unpack the sources, compare the install.
rule sources:
    input:
        code=stage_code("sources"),
        lock=config["sources"]["lock"],
    output:
        result=result("sources"),
        pins=f"{RESULTS}/sources/pins.json",
    log:
        logfile("sources"),
    threads: stage_threads("sources")
    priority: stage_priority("sources")
    resources:
        gpu=None,
        mem_mb=1000,
    shell:
        kmesh_run("sources")
