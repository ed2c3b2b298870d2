#!/usr/bin/env bash
# Re-record the Snakemake output tests/test_console.py parses (after a Snakemake upgrade), from the checkout root:
#   tests/data/console/record.sh
# Each file is what `python -m kmesh pipeline` wrote to <results>/cpu/logs/snakemake*.log, with the scratch results
# directory spelled RESULTS (the test puts its own there). kernels-failed.stage.log is the failed stage's own log.
set -uo pipefail
out=tests/data/console
results=$(mktemp -d /tmp/kmesh-console-record.XXXXXX)
fakebin=$(mktemp -d /tmp/kmesh-console-nvcc.XXXXXX)
printf '#!/bin/sh\necho "nvcc: refused for the recording" >&2\nexit 1\n' > "$fakebin/nvcc" && chmod +x "$fakebin/nvcc"
pipeline() { python -m kmesh pipeline --cores 2 --config results_dir="$results" "$@"; }
keep() { sed "s#$results#RESULTS#g" "$1" > "$out/$2"; }
target=$results/cpu/kernels/result.json
pipeline -n -- "$target";                          keep "$results/cpu/logs/snakemake-dry-run.log" dry-run.log
pipeline -- "$target";                             keep "$results/cpu/logs/snakemake.log" run.log
pipeline -- "$target";                             keep "$results/cpu/logs/snakemake.log" nothing-to-do.log
PATH=$fakebin:$PATH pipeline --forcerun kernels -- "$target"
keep "$results/cpu/logs/snakemake.log" kernels-failed.log
keep "$results/cpu/logs/kernels.log" kernels-failed.stage.log
pipeline timing=7 -- "$target";                    keep "$results/cpu/logs/snakemake.log" bad-config.log
rm -rf "$results" "$fakebin"
