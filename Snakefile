# KMesh pipeline: one rule file per stage, workflow/rules/<stage>.smk, for each stage of kmesh.stages.STAGES (the
#   one list of the stages, in pipeline order; the order the jobs run in comes from the rules' inputs: docs/dag.svg).
# Run: `make pipeline` (sets up .venv from requirements/cpu.lock, then `snakemake --cores all` through
#   `python -m kmesh pipeline`: one console line per stage, the full log in results/<profile>/logs/snakemake.log).
# On a cluster: `snakemake --profile workflow/profiles/slurm` (or .../kubernetes); see README.
# Profile: `snakemake --config profile=cuda` (default cpu). Every stage also runs alone:
#   python -m kmesh run STAGE --profile PROFILE
# The kmesh package must be importable by the Python that runs Snakemake (setup-env.sh installs it editable in .venv).
from snakemake.utils import min_version

import kmesh.stages

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


# A stage added to kmesh.stages.STAGES brings its rule file in here; tests/test_stage_list.py holds the rule files,
# the rules Snakemake plans and the stage pages to that list.
for _stage in kmesh.stages.STAGES:

    include: f"workflow/rules/{_stage}.smk"


rule all:
    input:
        all_outputs(),
    default_target: True
