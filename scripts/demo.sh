#!/usr/bin/env bash
# The main job on the embedded default models: the whole TRACE pipeline (`trace-rl run --preset demo`)
# on ToolSandbox's single-user-turn scenarios (its own venv) on this machine's CPU. Does its own set-up (idempotent); re-running
# resumes runs/demo where it stopped. Pass --run-dir DIR for a fresh run elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --docker --models qwen2.5-coder-0.5b --benchmarks toolsandbox
.venv/bin/trace-rl models fetch --hf qwen2.5-coder-0.5b >/dev/null   # transformers copy for training (once)
exec .venv/bin/trace-rl demo "$@"
