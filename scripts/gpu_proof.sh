#!/usr/bin/env bash
# The proof run (issue #18) on lent GPU machines, one step per device call. The machine keeps /tmp
# only while warm (30 s between calls), so each call is one verb:
#   wheels DIR          install a carried wheel folder (scripts/device_wheels.sh made it)
#   part                move the carried weight part(s) in .device/chunk to /tmp/parts
#   model               reassemble + sha256-check the 1.5B, convert it for transformers (once per machine)
#   analyse SECONDS     rollouts + analysis on τ² telecom into /tmp/proof (stops at the capabilities
#                       approval), then pack it into $OUT/proof
#   resume SECONDS      unpack the carried .device/run (the run as the CPU machine left it: envs built
#                       and verified in Docker), resume it on the engine (train, compose, evaluate), pack it
# A run cut by SECONDS is packed all the same: `trace-rl resume` continues it where its checkpoint is.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
MODEL=qwen2.5-coder-1.5b
RUN=/tmp/proof
cli() { python3 -m trace_rl.graph.cli "$@"; }
pack() { rm -rf "$OUT/proof"; cli pack "$RUN" --out "$OUT/proof" --part-mb 15; }
case "${1:-}" in
  wheels) source scripts/device_env.sh "$2" ;;
  part) mkdir -p /tmp/parts && mv .device/chunk/* /tmp/parts/ && ls /tmp/parts | wc -l ;;
  model)
    source scripts/device_env.sh /nonexistent
    t0=$(date +%s)
    python3 scripts/gpu_weights.py join /tmp/parts "$MODEL" && rm -rf /tmp/parts || exit 1
    cli models path "$MODEL" --hf || exit 1
    echo "model ready in $(( $(date +%s) - t0 )) s" ;;
  analyse)
    source scripts/device_env.sh /nonexistent
    # every field the later stages read is set now, so the CPU and GPU halves share one config
    timeout "${2:-420}" python3 -m trace_rl.graph.cli run --run-dir "$RUN" --preset gpu -c docs/examples/gpu/proof.yaml \
      --no-wait --no-web 2>&1 | tee "$OUT/analyse.log"
    pack ;;
  resume)
    source scripts/device_env.sh /nonexistent
    [ -d "$RUN" ] || cli unpack .device/run --into /tmp || exit 1
    timeout "${2:-540}" python3 -m trace_rl.graph.cli resume "$RUN" --set serve=hf --no-wait --no-web 2>&1 \
      | tee "$OUT/resume.log"
    pack ;;
  *) echo "usage: $0 wheels DIR | part | model | analyse [SECONDS] | resume [SECONDS]" >&2; exit 2 ;;
esac
