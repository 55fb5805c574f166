#!/usr/bin/env bash
# The main job on the embedded default models. Does its own set-up (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --docker --models qwen2.5-coder-0.5b
exec .venv/bin/trace-rl demo "$@"
