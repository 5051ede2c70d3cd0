#!/usr/bin/env bash
# Installs the project into the current Python. torch is pinned first: an unpinned torch pulls a
# multi-GB CUDA build, while 2.13.0 resolves to the CPU wheel these machines carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[dev,nixl]"
