#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the GPU machine lacks, for its Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  msgpack==1.2.4 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0 blake3==1.0.11 \
  liburing==2026.3.30 \
  2> >(grep -v "is ignored: it is neither" >&2)
ls .whl
