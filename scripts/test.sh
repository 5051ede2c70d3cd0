#!/usr/bin/env bash
# Install, then run the default test suite (slow-marked tests are excluded; `RUN_SLOW=1` adds them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export GLOO_SOCKET_IFNAME=lo RAY_DEDUP_LOGS=0
MARK="not slow"
[ "${RUN_SLOW:-0}" = "1" ] && MARK=""
python3 -m pytest -q -m "$MARK" "$@"
