#!/usr/bin/env bash
# On a GPU machine (after scripts/device_env.sh and the weights' parts are in /tmp/parts): reassemble
# and check the model, convert it for transformers, then measure the base agent on the test split of
# τ²-bench airline, retail and telecom at once (serve=hf: the engine serves the agent and the user
# simulator). Results under runs/base-rates/<domain>/; a tarball of them in $OUT when it is set.
#   bash scripts/gpu_base_rates.sh MODEL [SECONDS] [CONCURRENCY]
set -u
MODEL=${1:-qwen2.5-coder-1.5b}; LIMIT=${2:-420}; CONC=${3:-24}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
t0=$(date +%s)
[ -d /tmp/parts ] && python3 scripts/gpu_weights.py join /tmp/parts "$MODEL"
python3 -m trace_rl.graph.cli models path "$MODEL" --hf || exit 1
echo "model ready after $(( $(date +%s) - t0 )) s"
for d in airline retail telecom; do
  timeout "$LIMIT" python3 -m trace_rl.graph.cli eval --benchmark "tau2:$d" --split test --model "$MODEL" \
    --serve hf --concurrency "$CONC" --max-steps 30 --max-tokens 512 --temperature 0 \
    --out "runs/base-rates/$d" > "runs-base-rates-$d.log" 2>&1 &
done
wait
echo "evals done after $(( $(date +%s) - t0 )) s"
for d in airline retail telecom; do echo "== $d"; tail -n 12 "runs-base-rates-$d.log"; done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/base-rates.tgz" runs/base-rates runs-base-rates-*.log; fi
