# Source this at the start of every command on the GPU machine (device tool), with `.whl` carried:
#   source scripts/device-env.sh
# The GPU machine has its own python3/torch/transformers and no registry access: bring the few
# missing wheels (fetched here by scripts/fetch-device-wheels.sh into .whl/) and install KMesh
# itself from the carried tree with --no-deps, so its own torch is used.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site .
export PYTHONPATH=/tmp/site
export KMESH_ROOT="$PWD" PYTHONUNBUFFERED=1 LMCACHE_TRACK_USAGE=false
set +e
