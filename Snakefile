# KMesh pipeline: sources -> kernels -> model -> synthetic -> drain -> ownership -> equivalence -> storage ->
#   integrity -> group -> vllm -> restore_bench -> reliability -> report.
# Run: `make pipeline` (sets up .venv from requirements/cpu.lock, then `snakemake --cores all` through
#   `python -m kmesh pipeline`: one console line per stage, the full log in results/<profile>/logs/snakemake.log).
# On a cluster: `snakemake --profile workflow/profiles/slurm` (or .../kubernetes); see README.
# Profile: `snakemake --config profile=cuda` (default cpu). Every stage also runs alone:
#   python -m kmesh run STAGE --profile PROFILE
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/sources.smk"
include: "workflow/rules/kernels.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/synthetic.smk"
include: "workflow/rules/drain.smk"
include: "workflow/rules/ownership.smk"
include: "workflow/rules/equivalence.smk"
include: "workflow/rules/storage.smk"
include: "workflow/rules/integrity.smk"
include: "workflow/rules/remote.smk"
include: "workflow/rules/group.smk"
include: "workflow/rules/vllm.smk"
include: "workflow/rules/peers.smk"
include: "workflow/rules/restore_bench.smk"
include: "workflow/rules/reliability.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        all_outputs(),
    default_target: True
