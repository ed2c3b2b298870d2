#!/usr/bin/env bash
# The one entry point for work on the lent GPU machine (the device tool runs it in the repository root of a copy of
# the working tree; carry .whl, which scripts/fetch-device-wheels.sh fills here):
#   scripts/device.sh RUN [ARG...] [RUN [ARG...]...]      e.g. scripts/device.sh kernels stages "model equivalence"
#   scripts/device.sh --list                               the runs, their arguments and options (no GPU needed)
#   scripts/device.sh env && eval "$(scripts/device.sh --exports)"   the installed package for later commands
# Everything else (installing, each run's steps and limits, reading the results into $OUT/summary.txt) is
# kmesh.diagnostics.device_plan, run here from the tree's src/ (it needs nothing beyond the standard library).
cd "$(dirname "$0")/.." || exit 2
PYTHONPATH="$PWD/src" KMESH_ROOT="${KMESH_ROOT:-$PWD}" exec python3 -m kmesh.diagnostics.device_plan "$@"
