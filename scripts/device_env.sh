#!/usr/bin/env bash
# On a lent GPU machine (no registry, its own python3 with CUDA torch): install the carried wheels
# the machine lacks and make `trace_rl` importable from this checkout without building it.
# Idempotent (a warm machine keeps what the first call installed). Source it:
#   source scripts/device_env.sh [WHEEL_DIR ...]      (default: .device/wheels)
# Wheels come from scripts/device_wheels.sh on the CPU machine.
set -e
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
for dir in "${@:-$ROOT/.device/wheels}"; do
  [ -d "$dir" ] || continue
  stamp=/tmp/.trace-rl-wheels-$(ls "$dir" | sha256sum | cut -c1-12)
  if [ ! -f "$stamp" ]; then
    "$PY" -m pip install -q --no-deps --no-index --disable-pip-version-check "$dir"/*.whl && touch "$stamp"
  fi
done
# trace_rl.<folder> -> this checkout's folders (what the setuptools package-dir mapping does)
SHIM=/tmp/trace-rl-path/trace_rl
mkdir -p "$SHIM"
for sub in core models agents graph sandbox training prompts evals; do ln -sfn "$ROOT/$sub" "$SHIM/$sub"; done
export PYTHONPATH=/tmp/trace-rl-path:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}
export LITELLM_LOCAL_MODEL_COST_MAP=True  # no Docker here: runs resume with --set sandbox=subprocess
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set +e
