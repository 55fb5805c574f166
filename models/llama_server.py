"""llama.cpp's OpenAI-compatible server for a local GGUF, started and stopped by us.

Used for rollouts on CPU (llama.cpp decodes several times faster than transformers
here) and as the default endpoint for every agent when no base_url is configured.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trace_rl.core.episode import template_messages
from trace_rl.core.io import atomic_write, atomic_write_text, cache_dir
from trace_rl.models.endpoints import ServerProcess, exit_with_parent
from trace_rl.models.weights import MODELS, gguf_path


def default_prompt_states() -> Path | None:
    where = os.environ.get("TRACE_RL_PROMPT_STATES", "")
    return None if where == "0" else Path(where).expanduser() if where else cache_dir() / "prompt-states"


@dataclass
class LlamaServer(ServerProcess):
    """llama.cpp's server for a local GGUF (through our entry point: it exits when we die)."""

    n_ctx: int = 8192
    # the cores this process may run on (taskset, a cgroup's cpuset), not the machine's: llama.cpp's threads wait
    # for one another, and more threads than cores collapse its speed
    n_threads: int = field(default_factory=lambda: max(1, len(os.sched_getaffinity(0))))
    lora: str | Path | None = None  # a GGUF LoRA (models/lora_gguf.py) applied on top of the model
    # flash attention (LLMConfig.flash_attn, the run config's flash_attn): faster prompts, but greedy replies then
    # depend on how a prompt was split between cached and new tokens. Off: they never do (tested)
    flash_attn: bool = False
    # where long prompts' states are kept between servers (PromptStates): $TRACE_RL_PROMPT_STATES if it names a
    # folder, none if it is 0, else the cache's prompt-states/
    prompt_states: Path | None = field(default_factory=default_prompt_states)
    prompt_state_min_tokens: int = 1024

    @property
    def model_name(self) -> str:
        """The name the server answers to (the alias we pass)."""
        return Path(self.model).stem if self.model.endswith(".gguf") else self.model

    def command(self) -> list[str]:
        path = gguf_path(self.model)
        chat_format = MODELS[self.model].chat_format if self.model in MODELS else None  # None: the GGUF's template
        states = [f"--prompt-states={self.prompt_states}", f"--prompt-state-min-tokens={self.prompt_state_min_tokens}"] \
            if self.prompt_states else []
        return [sys.executable, "-m", "trace_rl.models.llama_server", str(os.getpid()), *states, "--model", str(path), "--model_alias",
                self.model_name, "--host", self.host, "--port", str(self.port), "--n_ctx", str(self.n_ctx),
                "--n_threads", str(self.n_threads), "--flash_attn", str(self.flash_attn).lower()] \
            + (["--chat_format", chat_format] if chat_format else []) \
            + (["--lora_path", str(self.lora)] if self.lora else [])


def common_prefix(a, b) -> int:
    """How many leading tokens two token lists share (a cached prefix's reusable length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def states_to_keep(saved: list[tuple[Path, list[int]]], keep: int) -> list[Path]:
    """Of (state, its tokens) newest first (a restore renews a state), the `keep` to keep: half the
    newest, half the longest of the rest (in whole 1,024-token steps, newest first among equals).
    Newest alone let a pipeline's unique analysis and build prompts (2-5k tokens) push τ²'s 10k-token
    prompts out between rollout and evaluation; longest alone would never keep a short one again."""
    newest, rest = saved[:keep // 2], saved[keep // 2:]
    longest = sorted(rest, key=lambda s: len(s[1]) // 1024, reverse=True)  # stable: newest first among equals
    return [state for state, _ in newest + longest[:keep - len(newest)]]


class PromptStates:
    """llama.cpp states of long prompts kept on disk, so that a server restores the longest saved prefix of a
    request instead of computing it again. τ²-bench's ~10k-token system prompt is the same for every task of a
    domain and is read once per server start (llama.cpp itself reuses the previous request's prefix within a
    server); a restore is far cheaper (benchmarks/README.md). The tokens are the same, the outputs too.

    A state belongs to one model file (and LoRA) and context size (its own folder); `keep` states stay
    (`states_to_keep`: the 4 newest, and the 4 longest of the rest)."""

    def __init__(self, root: Path, model: Path, n_ctx: int, n_batch: int, min_tokens: int = 1024, keep: int = 8,
                 lora: Path | None = None, flash_attn: bool = False):
        import hashlib

        import llama_cpp

        key = "|".join(f"{f.resolve()}|{f.stat().st_size}|{f.stat().st_mtime_ns}" for f in (model, lora) if f)
        key += f"|{n_ctx}|{n_batch}|{llama_cpp.__version__}" + ("|flash_attn" if flash_attn else "")  # its own V layout
        self.dir = Path(root) / f"{model.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        self.min_tokens, self.keep = min_tokens, keep
        self.bad: set[Path] = set()  # states that failed to load here: not tried again

    def _saved(self) -> list[tuple[Path, list[int]]]:
        """(state, its tokens), newest first. Another server may prune at any moment: what vanishes is skipped."""
        import json

        out = []
        for meta in self.dir.glob("*.tokens.json"):
            state = meta.with_name(meta.name.replace(".tokens.json", ".state"))
            with contextlib.suppress(OSError, ValueError):  # a half-pruned or foreign file: not a state
                out.append((meta.stat().st_mtime, state, json.loads(meta.read_text())))
        return [(state, tokens) for _, state, tokens in sorted(out, key=lambda t: t[0], reverse=True)]

    def restore(self, llama, prompt: list[int]) -> int:
        """Load the saved state sharing the longest prefix with `prompt` when it beats what `llama` holds;
        returns the prefix length now in `llama` that matches `prompt`."""
        import ctypes

        import llama_cpp

        have = common_prefix(llama.input_ids[:llama.n_tokens].tolist(), prompt)
        if len(prompt) - have < self.min_tokens:
            return have  # little to read: not worth a look on disk
        best = max(((common_prefix(tokens, prompt), path, tokens) for path, tokens in self._saved()
                    if path not in self.bad), default=(0, None, None), key=lambda t: t[0])
        if best[0] < have + self.min_tokens or not best[1].is_file():
            return have
        n = len(best[2])
        out, count = (llama_cpp.llama_token * n)(), ctypes.c_size_t(0)
        if not llama_cpp.llama_state_load_file(llama._ctx.ctx, str(best[1]).encode(), out, n, ctypes.byref(count)) \
                or list(out[:count.value]) != best[2]:
            self.bad.add(best[1])  # torn, pruned meanwhile, or from another build: compute the prompt instead
            llama.reset()  # the load may have written part of the cache: nothing in it is trusted (cleared with
            llama._ctx.kv_cache_clear()  # its data: under flash attention, stale cells changed the next replies)
            return 0
        llama.input_ids[:n] = best[2]
        llama.n_tokens, llama._requires_eval = n, True
        with contextlib.suppress(OSError):  # recently used: among the newest kept (unless another server pruned it)
            os.utime(best[1].with_name(best[1].stem + ".tokens.json"))
        print(f"trace-rl prompt state: restored {best[0]} of {len(prompt)} prompt tokens", file=sys.stderr, flush=True)
        return best[0]

    def save(self, llama) -> None:
        """Keep `llama`'s current state (written beside, then renamed: never half a state)."""
        import hashlib
        import json

        import llama_cpp

        tokens = llama.input_ids[:llama.n_tokens].tolist()
        name = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]

        def write(tmp: Path) -> None:
            if not llama_cpp.llama_state_save_file(llama._ctx.ctx, str(tmp).encode(),
                                                   (llama_cpp.llama_token * len(tokens))(*tokens), len(tokens)):
                raise OSError(f"llama.cpp could not write a state to {tmp}")

        try:
            atomic_write(self.dir / f"{name}.state", write)
            atomic_write_text(self.dir / f"{name}.tokens.json", json.dumps(tokens))  # last: the state is whole
        except OSError as err:  # a full disk costs the next server the prompt, never this request
            print(f"trace-rl prompt state: not saved: {err}", file=sys.stderr, flush=True)
            return
        saved = self._saved()
        kept = states_to_keep(saved, self.keep)
        listed = [state for state, _ in saved]
        stale = [state for state in listed if state not in kept]
        stale += [f for f in self.dir.glob("*.state") if f not in listed  # orphans of a kill
                  and time.time() - f.stat().st_mtime > 3600]
        stale += [f for f in self.dir.glob(".*.tmp") if time.time() - f.stat().st_mtime > 3600]
        for f in stale:
            f.with_name(f.stem + ".tokens.json").unlink(missing_ok=True)
            f.unlink(missing_ok=True)
        print(f"trace-rl prompt state: saved {len(tokens)} tokens", file=sys.stderr, flush=True)
        prune_prompt_states(self.dir.parent, self.dir)

    def install(self, llama_class) -> None:
        """Wrap `Llama.generate`: restore before the prompt is read, save once a long new prompt has been read."""
        original, states = llama_class.generate, self

        def generate(llama, tokens, *args, **kwargs):
            tokens = list(tokens)
            try:
                fresh = len(tokens) - states.restore(llama, tokens) >= states.min_tokens
            except Exception as err:  # a cache must never fail a request: the prompt is computed instead
                print(f"trace-rl prompt state: restore failed: {err!r}", file=sys.stderr, flush=True)
                llama.reset()
                fresh = False
            for i, token in enumerate(original(llama, tokens, *args, **kwargs)):
                if i == 0 and fresh:  # the prompt has just been read, nothing generated yet
                    try:
                        states.save(llama)
                    except Exception as err:
                        print(f"trace-rl prompt state: save failed: {err!r}", file=sys.stderr, flush=True)
                yield token

        llama_class.generate = generate


def prune_prompt_states(root: Path, current: Path, budget_gb: float | None = None) -> list[Path]:
    """Keep the prompt-state cache within `budget_gb` (default $TRACE_RL_PROMPT_STATES_GB, else 4): whole
    folders of other models, adapters and context sizes go, least recently used first (`keep` bounds each
    folder, not how many folders pile up: every evaluated adapter makes one). `current` is never removed;
    a folder vanishing under a reader is a state it computes again. Returns the folders removed."""
    budget = float(os.environ.get("TRACE_RL_PROMPT_STATES_GB", 4) if budget_gb is None else budget_gb) * 2**30

    def usage(d: Path) -> tuple[float, int]:  # (last use, bytes); a file another server prunes meanwhile is skipped
        last, size = 0.0, 0
        for f in d.iterdir():
            with contextlib.suppress(OSError):
                st = f.stat()
                last, size = max(last, st.st_mtime), size + st.st_size
        return last, size

    try:
        folders = {d: usage(d) for d in Path(root).iterdir() if d.is_dir()}
    except OSError:
        return []
    total, removed = sum(size for _, size in folders.values()), []
    for d in sorted((d for d in folders if d != current), key=lambda d: folders[d][0]):
        if total <= budget:
            break
        shutil.rmtree(d, ignore_errors=True)
        total -= folders[d][1]
        removed.append(d)
    return removed


def render_tool_arguments_as_objects() -> None:
    """llama-cpp-python hands a chat template the request's messages as they come, and an OpenAI tool
    call's `arguments` is a JSON string: Qwen's template (`arguments | tojson`) then showed the model
    its own earlier calls as quoted strings, where transformers (training, the engine) and vLLM give
    objects. Templates get objects here too (core.episode.template_messages): one prompt on every
    path (and a call the model wrote as `json.dumps` would re-render to its own tokens, still cached)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    original = Jinja2ChatFormatter.__call__

    def call(self, *, messages, **kwargs):
        return original(self, messages=template_messages(messages), **kwargs)

    Jinja2ChatFormatter.__call__ = call


def _serve_while_parent_lives() -> None:
    """`python -m trace_rl.models.llama_server PARENT_PID [--prompt-states=DIR --prompt-state-min-tokens=N]
    <llama_cpp.server args>`: llama.cpp's server, with long prompts' states kept in DIR."""
    exit_with_parent(int(sys.argv.pop(1)))
    render_tool_arguments_as_objects()
    ours = {a.split("=", 1)[0][2:]: a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--prompt-state")}
    sys.argv = [a for a in sys.argv if not a.startswith("--prompt-state")]
    if "prompt-states" in ours:
        import llama_cpp

        arg = dict(zip(sys.argv[1::2], sys.argv[2::2]))
        PromptStates(Path(ours["prompt-states"]), Path(arg["--model"]), int(arg.get("--n_ctx", 2048)),
                     int(arg.get("--n_batch", 512)), int(ours.get("prompt-state-min-tokens", 1024)),
                     lora=Path(arg["--lora_path"]) if "--lora_path" in arg else None,
                     flash_attn=arg.get("--flash_attn", "false").lower() == "true").install(llama_cpp.Llama)
    from llama_cpp.server.__main__ import main

    main()


if __name__ == "__main__":
    _serve_while_parent_lives()
