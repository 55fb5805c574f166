#!/usr/bin/env bash
# Idempotent set-up: venv, pinned packages, llama.cpp wheel, and (with --docker/--models)
# the Docker engine, sandbox image and embedded models. Fast when nothing changed.
# Usage: scripts/setup.sh [--docker] [--browser] [--models NAME...] [--benchmarks NAME...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${TRACE_RL_VENV:-$ROOT/.venv}
CACHE=${TRACE_RL_CACHE:-$HOME/.cache/trace-rl}
PY=${PYTHON:-python3}
LLAMA_VERSION=0.3.36
export LITELLM_LOCAL_MODEL_COST_MAP=True PIP_DISABLE_PIP_VERSION_CHECK=1

want_docker=0; want_browser=0; models=(); benchmarks=()
while [ $# -gt 0 ]; do
  case "$1" in
    --docker) want_docker=1 ;;
    --browser) want_browser=1 ;;
    --models) shift; while [ $# -gt 0 ] && [[ "$1" != --* ]]; do models+=("$1"); shift; done; continue ;;
    --benchmarks) shift; while [ $# -gt 0 ] && [[ "$1" != --* ]]; do benchmarks+=("$1"); shift; done; continue ;;
    *) echo "setup.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*"; }

# 1. virtual environment
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip wheel
fi
PIP="$VENV/bin/pip"

# 2. llama-cpp-python: built once from source (no prebuilt CPU wheel on PyPI), cached.
#    Not -march=native (the wheel must run on other machines) but x86-64-v3 (AVX2/FMA/F16C):
#    a baseline-SSE build processes prompts ~5x slower, which tau2's 10k-token prompts feel.
LLAMA_CMAKE=${TRACE_RL_LLAMA_CMAKE:-"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"}
WHEELS="$CACHE/wheels/llama-$(echo "$LLAMA_VERSION $LLAMA_CMAKE" | sha256sum | cut -c1-12)"; mkdir -p "$WHEELS"
if ! ls "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl >/dev/null 2>&1; then
  log "building llama-cpp-python $LLAMA_VERSION from source (about 10 minutes on 2 cores, once)"
  CMAKE_ARGS="$LLAMA_CMAKE" "$PIP" wheel -q --no-cache-dir --no-deps -w "$WHEELS.tmp" "llama-cpp-python==$LLAMA_VERSION"
  mv "$WHEELS.tmp"/*.whl "$WHEELS"/ && rmdir "$WHEELS.tmp"
fi

# 3. packages: torch's CPU wheel first (so nothing pulls a CUDA build), then the lock.
STAMP="$VENV/.trace-rl-installed"
want=$( (cat pyproject.toml requirements.lock; ls "$WHEELS") | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  log "installing packages (requirements.lock)"
  "$PIP" install -q torch==2.13.0
  "$PIP" install -q --find-links "$WHEELS" -c requirements.lock -e ".[dev]"
  "$PIP" install -q --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl
  # the engine's JSON-schema grammar (models/grammar.py), without triton: its CPU path needs no GPU kernels
  "$PIP" install -q --no-deps -c requirements.lock xgrammar apache-tvm-ffi
  echo "$want" > "$STAMP"
fi

# 4. optional: Docker engine + sandbox image, embedded models
if [ $want_docker = 1 ]; then
  log "Docker engine and sandbox image"
  "$VENV/bin/trace-rl" sandbox check >/dev/null
fi
if [ $want_browser = 1 ] && ! command -v chromium >/dev/null; then
  # Debian's headless Chromium for the approval-page browser test (Playwright drives it; no browser download)
  log "installing chromium (Debian package)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }
fi
if [ ${#models[@]} -gt 0 ]; then
  log "embedded models: ${models[*]}"
  "$VENV/bin/trace-rl" models fetch "${models[@]}"
fi
if [ ${#benchmarks[@]} -gt 0 ]; then
  # built-in benchmarks with pins of their own get their own venv; ToolSandbox comes from the vendored
  # archive beside the checkout where there is one (no registry serves it), else from its git repository
  vendor="$ROOT/../shared/vendor/ToolSandbox-165848b.tar.gz"
  if [ -z "${TRACE_RL_TOOLSANDBOX_SOURCE:-}" ] && [ -f "$vendor" ]; then export TRACE_RL_TOOLSANDBOX_SOURCE="$vendor"; fi
  log "benchmark venvs: ${benchmarks[*]}"
  "$VENV/bin/trace-rl" benchmarks install "${benchmarks[@]}"
fi
