#!/usr/bin/env bash
# The proof run (issue #18) on lent GPU machines, one step per device call. The machine keeps /tmp
# only while warm (30 s between calls), so each call is one verb:
#   wheels DIR          install a carried wheel folder (scripts/device_wheels.sh made it)
#   part                move the carried weight part(s) in .device/chunk to /tmp/parts
#   bench DIR           install the carried wheels of a built-in benchmark's own venv (BFCL: .device/bench-wheels)
#   rates MODEL SECONDS BFCL base rates of MODEL on its test split at T = 0.7, 2 trials: the first $TURNS turns
#                       one at a time and the first $TASKS whole tasks, side by side; results in $OUT/rates-MODEL.tgz
#   model               reassemble + sha256-check the 1.5B, convert it for transformers (once per machine)
#   analyse SECONDS     rollouts + analysis on τ² telecom into /tmp/proof (stops at the capabilities
#                       approval), then pack it into $OUT/proof
#   phase-a STEPS SECONDS  `analyse` and, beside it on the same GPU, `target STEPS` once the run's config exists;
#                       then pack both (the run comes back with its train_target/)
#   target STEPS SECS   GRPO on the target (the baseline) into /tmp/proof/train_target with STEPS steps
#                       (= the capabilities' steps together), while the CPU machine builds: it needs no env
#   envgrpo NAME ENV STEPS SECONDS  GRPO on one env built and verified on the CPU machine (subprocess backend here)
#   keep SECONDS        hold the machine (sleep) while the CPU machine is still building
#   phase-b STEPS SECONDS  unpack the carried .device/run (as the CPU machine left it: envs built and verified in
#                       Docker), then in one call train the capabilities and compose (stopping before train_target)
#                       while a second process on the same GPU trains the target baseline with STEPS steps (= the
#                       capabilities' steps together: 4 per approved env here; only on a GPU of 100 GB or more,
#                       else the next `resume` trains it); `resume` then evaluates
#   resume SECONDS [new] (MODES="m1 m2": evaluate only these rows, on EVAL_TASKS tasks) with `new`: unpack the carried .device/run (the run as the CPU machine left it:
#                       envs built and verified in Docker), keeping the train_target/ this machine made;
#                       then resume it on the engine (train, compose, evaluate) and pack it. Without `new`,
#                       continue the run already here (a cut resume)
# A run cut by SECONDS is packed all the same: `trace-rl resume` continues it where its checkpoint is.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
MODEL=${MODEL:-qwen2.5-coder-1.5b}
CONFIG=${CONFIG:-docs/examples/bfcl/proof.yaml}
RUN=/tmp/proof
cli() { python3 -m trace_rl.graph.cli "$@"; }
# results.tgz first (a few MB: reports, logs, trajectories, curves, envs): a finished run with its adapters and
# composition packs to ~75 MB, past what one call brings back, and the files that do not fit are the last ones
pack() {
  (cd "$RUN" && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.png' -o -name '*.md' -o -name '*.log' \
    -o -name 'env.py' \) -size -8M -not -path '*adapter*' -not -path '*checkpoint*' -not -name 'tokenizer*' \
    | tar czf "$OUT/results.tgz" -T -)
  rm -rf "$OUT/proof"; cli pack "$RUN" --out "$OUT/proof" --part-mb 15; }
case "${1:-}" in
  wheels) source scripts/device_env.sh "$2" ;;
  bench)
    source scripts/device_env.sh /nonexistent
    cli benchmarks install bfcl --source "$2" ;;
  rates)
    source scripts/device_env.sh /nonexistent
    m=$2; mkdir -p /tmp/rates
    timeout "${3:-500}" python3 -m trace_rl.graph.cli eval --benchmark bfcl:base --bench-opt mode=per_turn --split test \
      --tasks "${TURNS:-160}" --trials 2 --temperature 0.7 --model "$m" --serve hf --concurrency 64 \
      --out "/tmp/rates/bfcl-turn-$m" > "$OUT/rates-turn-$m.log" 2>&1 &
    timeout "${3:-500}" python3 -m trace_rl.graph.cli eval --benchmark bfcl:base --split test --tasks "${TASKS:-40}" \
      --trials 2 --temperature 0.7 --model "$m" --serve hf --concurrency 40 \
      --out "/tmp/rates/bfcl-task-$m" > "$OUT/rates-task-$m.log" 2>&1 &
    wait
    tail -n 25 "$OUT"/rates-*-"$m".log
    tar czf "$OUT/rates-$m.tgz" -C /tmp/rates . ;;
  part) mkdir -p /tmp/parts && mv .device/chunk/* /tmp/parts/ && ls /tmp/parts | wc -l ;;
  model)
    source scripts/device_env.sh /nonexistent
    t0=$(date +%s)
    for m in ${MODELS:-$MODEL}; do   # MODELS="a b": every model whose parts were carried
      python3 scripts/gpu_weights.py join /tmp/parts "$m" && cli models path "$m" --hf || exit 1
    done
    rm -rf /tmp/parts
    echo "model ready in $(( $(date +%s) - t0 )) s" ;;
  analyse)
    source scripts/device_env.sh /nonexistent
    # every field the later stages read is set now, so the CPU and GPU halves share one config
    timeout "${2:-420}" python3 -m trace_rl.graph.cli run --run-dir "$RUN" --preset gpu -c "$CONFIG" \
      --no-wait --no-web ${SETS:-} 2>&1 | tee "$OUT/analyse.log"
    pack ;;
  phase-a)
    source scripts/device_env.sh /nonexistent
    rm -rf "$RUN"
    ( for _ in $(seq 120); do [ -f "$RUN/config.json" ] && break; sleep 2; done
      bash "$0" target "$2" "$(( ${3:-540} - 40 ))" >/dev/null 2>&1 ) &   # logs to $OUT/target.log
    timeout "$(( ${3:-540} - 20 ))" python3 -m trace_rl.graph.cli run --run-dir "$RUN" --preset gpu -c "$CONFIG" \
      --no-wait --no-web ${SETS:-} 2>&1 | tee "$OUT/analyse.log"
    wait
    pack ;;
  target)
    source scripts/device_env.sh /nonexistent
    # serve=llama.cpp here only so that no engine server starts: this step calls no LLM (telecom is solo)
    timeout "${3:-540}" python3 - "$RUN" "$2" <<'PY' 2>&1 | tee "$OUT/target.log"
import sys
from trace_rl.core.rundir import RunDir
from trace_rl.graph.config import load_saved_config
from trace_rl.graph.pipeline import Pipeline
run, steps = sys.argv[1], int(sys.argv[2])
cfg = load_saved_config(RunDir(run))
cfg = cfg.model_copy(update={"serve": "llama.cpp", "grpo": cfg.grpo.model_copy(update={"steps": steps})})
print(Pipeline(run, cfg).train_target({})["target_adapter"])
PY
    ;;
  envgrpo)  # envgrpo NAME ENV_PY STEPS SECONDS: GRPO of $MODEL on one built env (verified in Docker on the
            # CPU machine; here it runs in the subprocess backend); logs, curves and held-out results to $OUT
    [ $# -ge 4 ] || { echo "usage: $0 envgrpo NAME ENV_PY STEPS [SECONDS]" >&2; exit 2; }
    source scripts/device_env.sh /nonexistent
    rm -rf "/tmp/envgrpo-$2"   # a warm machine keeps /tmp: never resume an earlier run's checkpoints
    set -o pipefail            # the training's exit status, not tee's
    timeout "${5:-400}" python3 -m trace_rl.graph.cli train "$3" --model "$MODEL" --preset paper --set steps="$4" \
      --set groups_per_step=2 --set learning_rate=1e-4 --heldout 16 --out "/tmp/envgrpo-$2" --name "$2" \
      --sandbox subprocess 2>&1 \
      | tee "$OUT/envgrpo-$2.log"
    mkdir -p "$OUT/envgrpo-$2" && (cd "/tmp/envgrpo-$2" && find . -maxdepth 5 -type f \( -name '*.json' -o -name \
      '*.png' -o -name '*.jsonl' \) -size -8M -not -path '*checkpoint*' -not -name 'tokenizer*' -exec cp --parents {} "$OUT/envgrpo-$2/" \;) ;;
  keep) sleep "${2:-60}"; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
  phase-b)
    source scripts/device_env.sh /nonexistent
    rm -rf /tmp/unpacked && cli unpack .device/run --into /tmp/unpacked || exit 1
    rm -rf "$RUN" && mv /tmp/unpacked/* "$RUN"
    # beside the capabilities only where it fits: on an H100 (80 GB) the serving engine (45 GiB), the capabilities'
    # GRPO (21.5 GiB) and the target's (11 GiB) ran out of memory together (2026-12-06); `resume` trains it after
    if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -ge 100000 ]; then
      bash "$0" target "$2" "$(( ${3:-540} - 20 ))" >/dev/null 2>&1 &   # logs to $OUT/target.log
    else echo "target baseline: not beside the capabilities on this GPU; the next resume trains it"; fi
    # no LLM is asked while training: the agent's engine server (started with the run's components) stays small
    timeout "${3:-540}" python3 -m trace_rl.graph.cli resume "$RUN" --set serve=hf --set serve_rows=16 \
      --set sandbox=subprocess --no-wait \
      --no-web --until train_target 2>&1 | tee "$OUT/phase-b.log"
    wait
    pack ;;
  resume)
    source scripts/device_env.sh /nonexistent
    if [ "${3:-}" = new ]; then
      rm -rf /tmp/unpacked && cli unpack .device/run --into /tmp/unpacked || exit 1
      [ -d "$RUN/train_target" ] && [ ! -d /tmp/unpacked/*/train_target ] && cp -r "$RUN/train_target" /tmp/unpacked/*/
      rm -rf "$RUN" && mv /tmp/unpacked/* "$RUN"
    fi
    [ -d "$RUN" ] || { echo "no run at $RUN: resume SECONDS new, carrying .device/run" >&2; exit 1; }
    if [ -n "${MODES:-}" ]; then  # MODES="a b": evaluate these rows only (an ablation: one adapter alone, ...)
      python3 - "$RUN/config.json" $MODES <<'PY' || exit 1
import json, os, sys
from pathlib import Path
from trace_rl.core.io import atomic_write_json
from trace_rl.core.rundir import RunDir
from trace_rl.graph.config import load_saved_config, stage_fingerprints
path = Path(sys.argv[1]); cfg = json.loads(path.read_text()); cfg["eval_modes"] = sys.argv[2:]
if os.environ.get("EVAL_TASKS"):  # fewer test tasks (the first N of the split), where device time is short
    cfg["eval_tasks"] = int(os.environ["EVAL_TASKS"])
atomic_write_json(path, cfg)  # and the stages' fingerprints with it: only the evaluation changed, nothing is stale
stages = json.loads((path.parent / "stages.json").read_text())
atomic_write_json(path.parent / "stages.json", {**stages, "evaluate": stage_fingerprints(load_saved_config(RunDir(path.parent)))["evaluate"]})
print("eval_modes:", cfg["eval_modes"])
PY
    fi
    timeout "${2:-540}" python3 -m trace_rl.graph.cli resume "$RUN" --set serve=hf --set sandbox=subprocess --no-wait \
      --no-web 2>&1 \
      | tee "$OUT/resume.log"
    pack ;;
  *) echo "usage: $0 wheels DIR | part | model | analyse [SECONDS] | phase-a STEPS SECONDS | target STEPS [SECONDS] | keep SECONDS | phase-b STEPS SECONDS | resume SECONDS [new]" >&2; exit 2 ;;
esac
