"""vLLM's OpenAI-compatible server for a model a run needs (`serve: vllm`, a GPU machine), in the one
registry of servers this project starts (models/endpoints.py), reached through the one client (models/llm.py).

- One server per model folder (the transformers checkpoint `trace-rl models path NAME --hf` makes), answering
  under the model's own name (`--served-model-name`), with Qwen's tool calls parsed by vLLM (hermes) and
  `response_format` decoded by llguidance (the carried bundle has no xgrammar).
- Adapters (each adapter alone, grpo_target, GRPO's current policy) are LoRA requests: the server starts with
  `--enable-lora --max-loras N --max-lora-rank 16` and loads an adapter when it is first asked for, through
  `/v1/load_lora_adapter` (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), under a name made from its folder
  (`lora_name`); a request names that adapter as its `model`. Loading at run time, not `--lora-modules` at
  start-up, because the server is started before the adapters exist (the rollout stage's agent and user
  simulator, the analyst: all the same 1.5B in the gpu preset) and GRPO must push a new adapter after every
  step; a restart per adapter set would cost vLLM's start-up (~90-100 s on an H100) each time.
  `--lora-modules` is used by `trace-rl serve --serve vllm --lora NAME=PATH`, whose adapters are known.
- The router and the MoE stay on the engine: vLLM applies one adapter per request and cannot route per token.

    python -m trace_rl.models.vllm_server --parent PID -- python -m vllm.entrypoints.openai.api_server ...

is what the child runs: vLLM's own server, exactly as documented, under a watcher that ends the process group
(vLLM's engine-core process too) when this project's process is gone, even if it was SIGKILLed.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from trace_rl.models.endpoints import ServerProcess

INSTALL_HINT = ("pip install 'trace-rl[vllm]' on a machine with a package registry, or on a lent GPU machine "
                "the carried bundle: scripts/gpu_vllm.sh install, then join")
MAX_LORA_RANK = 16  # GRPOSettings.lora_r's default (the paper's r)


class VllmMissing(RuntimeError):
    """serve=vllm where vllm cannot be imported: one line, and what to do."""


def vllm_available() -> bool:
    """Whether `import vllm` would find it (it is not imported here: that takes seconds and CUDA)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(what: str = "serve=vllm") -> None:
    if not vllm_available():
        raise VllmMissing(f"{what}: vllm is not importable by {sys.executable}; {INSTALL_HINT}")


def lora_name(adapter: str | Path) -> str:
    """The name an adapter folder is served under: its training's folder name (run/train/<capability>/adapter
    -> <capability>) and a hash of its resolved path (two runs' adapters of one capability differ)."""
    path = Path(adapter).expanduser().resolve()
    stem = path.parent.name if path.name == "adapter" else path.name
    return f"{stem or 'lora'}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def _post(url: str, body: dict, timeout: float = 600.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def load_lora(base_url: str, name: str, path: str | Path) -> None:
    """Load the peft adapter folder `path` into the vLLM server at `base_url` (…/v1) under `name`."""
    code, text = _post(f"{base_url.rstrip('/')}/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    if code != 200 and "has already been loaded" not in text:
        raise RuntimeError(f"vLLM at {base_url} did not load the adapter {path} as {name!r}: HTTP {code}: {text[:500]}")


def unload_lora(base_url: str, name: str) -> None:
    code, text = _post(f"{base_url.rstrip('/')}/unload_lora_adapter", {"lora_name": name})
    if code != 200 and code != 404:
        raise RuntimeError(f"vLLM at {base_url} did not unload {name!r}: HTTP {code}: {text[:500]}")


def complete_ids(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, temperature: float,
                 stop_token_ids: list[int]) -> list[list[int]]:
    """The new token ids for each prompt (token ids), one /v1/completions request for them all: vLLM
    schedules them together. The token ids come back as sampled (`return_token_ids`), no re-tokenizing."""
    code, text = _post(f"{base_url.rstrip('/')}/completions", {
        "model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": temperature,
        "stop_token_ids": list(stop_token_ids), "return_token_ids": True, "skip_special_tokens": False}, 3600.0)
    if code != 200:
        raise RuntimeError(f"vLLM at {base_url}: completions for {model!r} failed: HTTP {code}: {text[:500]}")
    choices = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
    if len(choices) != len(prompts) or any(c.get("token_ids") is None for c in choices):
        raise RuntimeError(f"vLLM at {base_url}: {len(choices)} choices with token ids for {len(prompts)} prompts")
    return [list(c["token_ids"]) for c in choices]


@dataclass
class VllmServer(ServerProcess):
    """`vllm.entrypoints.openai.api_server` for one model folder, in a child process that ends with this one."""
    served_name: str = ""  # what a request's `model` says (default: the folder's name)
    max_model_len: int = 16384
    max_num_seqs: int = 64  # sequences decoded together (serve_rows)
    gpu_memory_utilization: float = 0.4  # leaves room for the engine (router, moe) and training on the same GPU
    enable_lora: bool = False
    max_loras: int = 4  # adapters in one batch (the GPU's slots); more wait in the CPU cache
    max_lora_rank: int = MAX_LORA_RANK
    max_cpu_loras: int = 16
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> folder, loaded at start-up
    dtype: str = "bfloat16"
    startup_timeout: float = 900.0  # torch.compile + CUDA graphs: 92-103 s measured on an H100
    loaded: dict[str, str] = field(default_factory=dict, repr=False)  # adapters loaded at run time: name -> folder
    _lora_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def model_name(self) -> str:
        return self.served_name or Path(self.model).name

    def vllm_args(self) -> list[str]:
        args = ["--model", str(self.model), "--served-model-name", self.model_name, "--host", self.host,
                "--port", str(self.port), "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs), "--gpu-memory-utilization", str(self.gpu_memory_utilization),
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--structured-outputs-config", json.dumps({"backend": "guidance"}),
                "--disable-uvicorn-access-log"]
        if self.enable_lora or self.lora_modules:
            args += ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank),
                     "--max-cpu-loras", str(max(self.max_cpu_loras, self.max_loras))]
        if self.lora_modules:
            args += ["--lora-modules", *(f"{n}={p}" for n, p in self.lora_modules.items())]
        return args

    def command(self) -> list[str]:
        return [sys.executable, "-m", "trace_rl.models.vllm_server", "--parent", str(os.getpid()), "--",
                sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self.vllm_args()]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if importlib.util.find_spec("flashinfer") is None:  # vLLM's default sampler on CUDA imports it
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def start(self) -> "VllmServer":
        require_vllm()
        return super().start()

    def adapter(self, path: str | Path) -> str:
        """The served name of the adapter folder `path`, loaded now if it is not yet."""
        if not self.enable_lora:
            raise ValueError(f"the vLLM server for {self.model} was started without --enable-lora; it cannot "
                             f"serve the adapter {path}")
        name = lora_name(path)
        with self._lora_lock:
            if name not in self.loaded:
                load_lora(self.base_url, name, path)
                self.loaded[name] = str(path)
        return name


def watch(parent: int, cmd: list[str]) -> int:
    """Run `cmd` in this process group; end the whole group (vLLM's engine core too) once `parent` is gone."""
    child = subprocess.Popen(cmd)
    while child.poll() is None:
        if os.getppid() != parent:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.killpg(0, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            os.killpg(0, signal.SIGKILL)
        time.sleep(1.0)
    return child.returncode


def main() -> None:
    argv = sys.argv[1:]
    if len(argv) < 4 or argv[0] != "--parent" or argv[2] != "--":
        sys.exit("usage: python -m trace_rl.models.vllm_server --parent PID -- COMMAND ...")
    sys.exit(watch(int(argv[1]), argv[3:]))


if __name__ == "__main__":
    main()
