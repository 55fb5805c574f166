"""In-process transformers models behind the agent's `chat` interface, and the token-level
helpers GRPO shares with it: chat rendering, environment-turn deltas (generation: engine.py).

Tool calls are parsed from the generated text (<tool_call> tags, fences or bare JSON), as
for any endpoint. Chat templates without tool support (SmolLM2's) get the tool schemas in
the system prompt and tool calls rendered as <tool_call> text, the Hermes/Qwen format.
Slower than llama.cpp on CPU for rollouts; needed where gradients or adapters live in-process.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from trace_rl.core.episode import template_messages
from trace_rl.models.chat import Reply, Usage, parse_tool_calls
from trace_rl.models.weights import hf_checkpoint

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")


def _tools_as_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For templates that ignore `tools`: schemas into the system prompt, calls and results as text."""
    preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
    out = []
    for m in messages:
        if m["role"] == "system":
            m = {"role": "system", "content": f"{m['content']}\n\n{preamble}"}
        elif m.get("tool_calls"):
            text = "\n".join("<tool_call>\n" + json.dumps({"name": tc["function"]["name"],
                                                           "arguments": tc["function"]["arguments"]}) + "\n</tool_call>"
                             for tc in m["tool_calls"])
            m = {"role": "assistant", "content": text}
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools and not any(m["role"] == "system" for m in out):
        out.insert(0, {"role": "system", "content": preamble})
    return out


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages` (+ tools), one rendering rule for eval and training."""
    msgs = template_messages(messages)
    if tools and "tools" not in (tokenizer.chat_template or ""):  # a template that ignores `tools`
        msgs, tools = _tools_as_text(msgs, tools), None
    return tokenizer.apply_chat_template(msgs, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def env_turn_ids(tokenizer, history: list[dict], new: list[dict], tools: list[dict] | None) -> list[int]:
    """Tokens the template puts after an assistant turn's end token: the environment's
    messages `new` and the header of the next assistant turn. `history` ends with that
    assistant turn. These tokens are context, not the model's output (masked from the loss)."""
    from trace_rl.models.engine import stop_ids

    before = render(tokenizer, history, tools)
    after = render(tokenizer, history + new, tools, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template re-renders earlier turns differently; cannot build turn deltas")
    at, end = max((before.rfind(t), t) for t in (tokenizer.decode([i]) for i in stop_ids(tokenizer)))
    if at < 0:
        raise ValueError("cannot find the end-of-turn token in the rendered assistant turn")
    return encode(tokenizer, after[at + len(end):])


def assistant_labels(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation: labels are the assistant turns' tokens, -100
    elsewhere (the prompt, tool results, user turns). Used to train routing gates."""
    ids, labels = [], []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render(tokenizer, messages[:i], tools, add_generation_prompt=True)
            turn = render(tokenizer, messages[:i + 1], tools)
            if not (head.startswith(done) and turn.startswith(head)):
                raise ValueError("the chat template re-renders earlier turns differently")
            ctx, out = encode(tokenizer, head[len(done):]), encode(tokenizer, turn[len(head):])
            ids += ctx + out
            labels += [-100] * len(ctx) + out
            done = turn
    return ids, labels


def load_model(name_or_path: str):
    """(model in eval mode, tokenizer) of an embedded model name, a .gguf or a transformers
    checkpoint directory: on this process's GPU (`LOCAL_RANK` under torchrun / accelerate, one GPU
    per process) in bf16 when CUDA is available, else on the CPU in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = hf_checkpoint(name_or_path)
    cuda = torch.cuda.is_available()
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)


class HFPolicy:
    """A transformers model (optionally with a LoRA adapter, or an MoE's routed model) with `chat`.

    Generation runs in an `Engine` (models/engine.py): calls from several threads (episodes of
    an evaluation) are decoded together, a conversation's earlier turns stay in the cache, and a
    system prompt shared by episodes is computed once. `tag(messages)` picks a conversation's
    routing tag (the composition's adapter slot); policies may share one engine (`engine=`); `decode`: the
    engine's decode step (Engine's `compile`: auto, eager, graph or inductor)."""

    def __init__(self, model, tokenizer, name: str, max_new_tokens: int = 256, engine=None, rows: int | None = None,
                 max_len: int = 16384, tag=None, decode: str = "auto"):
        self.model, self.tokenizer, self.name, self.max_new_tokens = model, tokenizer, name, max_new_tokens
        self.usage = Usage()
        self._usage_lock = threading.Lock()
        self.tag = tag or (lambda messages, tools: 0)
        self._engine, self._rows, self._max_len, self._decode = engine, rows, max_len, decode
        self._batcher = None
        self._init_lock = threading.Lock()  # the first chats of an evaluation arrive together

    @property
    def batcher(self):
        """The engine's batcher, made on first use (once, however many threads ask at once)."""
        from trace_rl.models.engine import Batcher, Engine

        with self._init_lock:
            if self._batcher is None:
                if self._engine is None:
                    cuda = next(self.model.parameters()).device.type == "cuda"
                    self._engine = Engine(self.model, self.tokenizer, rows=self._rows or (16 if cuda else 1),
                                          max_len=self._max_len, compile=self._decode)
                self._batcher = Batcher(self._engine)
            return self._batcher

    @classmethod
    def load(cls, model: str, adapter: str | None = None, **kw) -> "HFPolicy":
        net, tok = load_model(model)
        if adapter:
            from peft import PeftModel

            net = PeftModel.from_pretrained(net, adapter).eval()
        name = f"{Path(model).stem}+{Path(adapter).name}" if adapter else Path(model).stem
        return cls(net, tok, name, **kw)

    def chat(self, messages: list[dict], tools: list[dict] | None = None, temperature: float = 0.0,
             max_tokens: int | None = None, text_tool_calls: bool = True, **_) -> Reply:
        from trace_rl.models.engine import Request

        ids = encode(self.tokenizer, render(self.tokenizer, messages, tools, add_generation_prompt=True))
        t0 = time.perf_counter()
        new = self.batcher.submit(Request(ids, max_tokens or self.max_new_tokens, temperature,
                                          self.tag(messages, tools)))
        text = self.tokenizer.decode(new, skip_special_tokens=True).strip()
        calls = parse_tool_calls(text, {t["function"]["name"] for t in tools}, loose=text_tool_calls) if tools else []
        reply = Reply(content="" if calls else text, tool_calls=calls, prompt_tokens=len(ids),
                      completion_tokens=len(new), seconds=time.perf_counter() - t0, tool_calls_from_text=bool(calls))
        with self._usage_lock:
            self.usage.add(reply, 0.0)
        return reply
