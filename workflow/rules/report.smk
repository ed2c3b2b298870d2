# Render tables (md/csv/tex) and plots (png/svg) from every stage result of this profile.
rule report:
    input:
        code=stage_code("report"),
        stages=[result(s) for s in STAGES],
    output:
        result=result("report"),
        summary_table=report(
            f"{RESULTS}/{PROFILE}/tables/summary.md",
            caption="../report/summary_table.rst",
            category="Summary",
        ),
        summary_plot=report(
            f"{RESULTS}/{PROFILE}/plots/summary.png",
            caption="../report/summary_plot.rst",
            category="Summary",
        ),
    log:
        logfile("report"),
    threads: stage_threads("report")
    priority: stage_priority("report")
    resources:
        gpu=None,
        mem_mb=2000,
    shell:
        kmesh_run("report")
