#!/usr/bin/env bash
# Runs the same long-mix trace against the cluster once per policy and prints the comparison.
#   bash scripts/compare_policies.sh [APP_YAML] [POLICIES] [QPS] [DURATION_S] [OUT_DIR]
# e.g. bash scripts/compare_policies.sh deployments/local.yaml fcfs,lars 2 60 runs/compare
# Each policy gets a fresh cluster (`raycluster up --detach`, then `down`); the trace is written
# once (`loadgen generate`) so every run sends identical requests at identical times.
set -euo pipefail
APP=${1:-deployments/local.yaml}
POLICIES=${2:-fcfs,lars}
QPS=${3:-2}
DURATION=${4:-60}
OUT=${5:-runs/compare}
PORT=${PORT:-8000}
mkdir -p "$OUT"
loadgen generate --workload long-mix --qps "$QPS" --duration "$DURATION" --seed 0 \
  --long-tokens 4096:8192 --max-output-tokens 64 --out "$OUT/trace.jsonl"
files=()
for policy in ${POLICIES//,/ }; do
  raycluster up --app "$APP" --policy "$policy" --port "$PORT" --no-dashboard --detach
  trap 'raycluster down' EXIT
  loadgen run --url "http://127.0.0.1:$PORT" --workload "$OUT/trace.jsonl" --arrival trace \
    --prompt-format ids --seed 0 --out "$OUT/$policy.json" --quiet
  raycluster down
  trap - EXIT
  files+=("$OUT/$policy.json")
done
loadgen report "${files[@]}" --plot "$OUT/compare.png"
echo "wrote ${files[*]} and $OUT/compare.png"
