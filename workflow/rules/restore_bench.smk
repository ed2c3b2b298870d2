# Restore cost against moving the same bytes: cuda, kernel vs device copy vs torch path (matched pairs, CUDA
# events, byte-identical check); cpu, torch path vs a plain copy. Summary per shape: kernel_vs_copy,
# speedup_vs_torch, bytes_differ.
rule restore_bench:
    input:
        code=stage_code("restore_bench"),
        kernels=result("kernels"),
    output:
        result=result("restore_bench"),
    log:
        logfile("restore_bench"),
    threads: stage_threads("restore_bench")
    priority: stage_priority("restore_bench")
    resources:
        gpu=GPU,
        mem_mb=4000,
    shell:
        kmesh_run("restore_bench")
