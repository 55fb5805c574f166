#!/usr/bin/env bash
# vLLM on a lent GPU machine (issue #42), one verb per device call. The machine keeps /tmp only while warm
# (~30 s between calls). The vLLM bundle is ../shared/tools/vllm-bundle's (vLLM 0.25.1 for the image's torch
# 2.11): two parts, .whl1/ and .whl2/, built on the CPU machine by its build.sh, each carried in its own call.
#   install            (carry .whl1)  park part 0 in /tmp/wh                                     (a few seconds)
#   join               (carry .whl2)  append part 1, check the sha256 (.whl2/SHA256SUMS), unpack to /tmp/site,
#                                     import vllm once                                           (~1 min)
#   lora               a random r=16 q/k/v/o adapter for $MODEL in /tmp/lora-r16 (peft; B non-zero: it changes
#                      every answer, like a trained one)
#   serving [SECONDS]  benchmarks/serving.py: vLLM vs the engine for $MODEL (tok/s at B=1,32,256, base and the
#                      LoRA, start-up, episodes/min at 64 concurrent episodes on $BENCH); $OUT/serving.json, logs
#   eval [SECONDS]     `trace-rl eval --serve vllm` on $BENCH ($TASKS tasks, $CONC at once), then the same with
#                      --serve hf; both reports to $OUT/eval-{vllm,hf}/
#   grpo STEPS [SECONDS]  GRPO of $MODEL on the target $BENCH with vLLM rollouts (trace-rl train --target
#                      --serve vllm), then the same steps on the engine; logs, curves, timings to $OUT/grpo-*/
# The model's weights must be there first: scripts/gpu_proof.sh part + model (as for every GPU step).
# Every verb that runs Python sources scripts/device_env.sh (the project's carried wheels and checkout).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
MODEL=${MODEL:-qwen2.5-coder-1.5b}
BENCH=${BENCH:-tau2:airline}
TASKS=${TASKS:-64}
CONC=${CONC:-64}
OUT=${OUT:-/tmp/vllm-out}
mkdir -p "$OUT"
vllm_env() {  # the unpacked bundle after the checkout's own paths: the image's torch stays the one imported
  source scripts/device_env.sh /nonexistent
  [ -d /tmp/site/vllm ] || { echo "no vLLM in /tmp/site: run install (carry .whl1) then join (carry .whl2)" >&2; exit 3; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  export VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false  # flashinfer is not in the bundle
}
case "${1:-}" in
  install)
    [ -f .whl1/site.tar.xz.part0 ] || { echo "carry .whl1 (../shared/tools/vllm-bundle/build.sh makes it)" >&2; exit 2; }
    mkdir -p /tmp/wh && cp .whl1/site.tar.xz.part0 /tmp/wh/ && ls -l /tmp/wh ;;
  join)
    [ -f .whl2/site.tar.xz.part1 ] || { echo "carry .whl2" >&2; exit 2; }
    [ -f /tmp/wh/site.tar.xz.part0 ] || { echo "part 0 is gone (machine not warm): install again, then join" >&2; exit 2; }
    cp .whl2/site.tar.xz.part1 /tmp/wh/ && cat /tmp/wh/site.tar.xz.part0 /tmp/wh/site.tar.xz.part1 > /tmp/wh/site.tar.xz
    (cd /tmp/wh && grep ' site.tar.xz$' "$OLDPWD/.whl2/SHA256SUMS" | sha256sum -c -) || exit 4
    rm -rf /tmp/site && mkdir -p /tmp/site && xz -dc /tmp/wh/site.tar.xz | tar -x -C /tmp/site || exit 5
    rm -f /tmp/wh/site.tar.xz /tmp/wh/site.tar.xz.part*
    vllm_env
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" ;;
  lora)
    vllm_env
    python3 - "$MODEL" /tmp/lora-r16 <<'PY'
import sys, torch
from peft import LoraConfig, get_peft_model
from trace_rl.models.hf_policy import load_model
model, tok = load_model(sys.argv[1])
net = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                       init_lora_weights=False, task_type="CAUSAL_LM"))
torch.manual_seed(0)
with torch.no_grad():
    for n, p in net.named_parameters():
        if "lora_" in n:
            p.normal_(0, 0.01)
net.save_pretrained(sys.argv[2])
print("adapter", sys.argv[2])
PY
    ;;
  serving)
    vllm_env
    [ -d /tmp/lora-r16 ] || bash "$0" lora || exit 1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout "${2:-560}" python3 benchmarks/serving.py --model "$MODEL" --lora /tmp/lora-r16 --bench "$BENCH" \
      --episodes "$CONC" --out "$OUT/serving.json" 2>&1 | tee "$OUT/serving.log" ;;
  eval)
    vllm_env
    for serve in vllm hf; do
      t0=$(date +%s)
      timeout "$(( ${2:-560} / 2 ))" python3 -m trace_rl.graph.cli eval --benchmark "$BENCH" --model "$MODEL" \
        --serve "$serve" --tasks "$TASKS" --concurrency "$CONC" --out "$OUT/eval-$serve" 2>&1 | tee "$OUT/eval-$serve.log"
      echo "eval --serve $serve: $(( $(date +%s) - t0 )) s in all (start-up included)" | tee -a "$OUT/eval-$serve.log"
    done ;;
  grpo)
    [ $# -ge 2 ] || { echo "usage: $0 grpo STEPS [SECONDS]" >&2; exit 2; }
    vllm_env
    for serve in vllm engine; do
      rm -rf "/tmp/grpo-$serve"   # never resume another call's checkpoints
      t0=$(date +%s)
      timeout "$(( ${3:-560} / 2 ))" python3 -m trace_rl.graph.cli train --target "$BENCH" --model "$MODEL" \
        --preset paper --set steps="$2" --out "/tmp/grpo-$serve" $([ "$serve" = vllm ] && echo --serve vllm) 2>&1 \
        | tee "$OUT/grpo-$serve.log"
      echo "grpo ($serve rollouts): $(( $(date +%s) - t0 )) s in all" | tee -a "$OUT/grpo-$serve.log"
      mkdir -p "$OUT/grpo-$serve" && (cd "/tmp/grpo-$serve" && find . -maxdepth 4 -type f \( -name '*.json' -o -name \
        '*.png' \) -size -8M -not -path '*checkpoint*' -not -path '*adapter*' -exec cp --parents {} "$OUT/grpo-$serve/" \;)
    done ;;
  *) echo "usage: $0 install | join | lora | serving [SECONDS] | eval [SECONDS] | grpo STEPS [SECONDS]" >&2; exit 2 ;;
esac
