"""In-process transformers models behind the agent's `chat` interface, and the token-level
helpers GRPO shares with it: chat rendering, batched generation, environment-turn deltas.

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

from trace_rl.core.episode import tool_arguments
from trace_rl.core.llm import Reply, Usage, parse_tool_calls
from trace_rl.core.models import hf_checkpoint

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> what HF chat templates expect (tool-call arguments as dicts)."""
    def as_dict(fn: dict) -> dict:  # a malformed call keeps its text
        args = tool_arguments(fn["arguments"]) if isinstance(fn.get("arguments"), str) else None
        return dict(fn) if args is None else {**fn, "arguments": args}

    out = [dict(m) for m in messages]
    for m in out:
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": as_dict(tc["function"])} for tc in m["tool_calls"]]
            m["content"] = m.get("content") or ""
    return out


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


def stop_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn (eos, and <|im_end|> where the template uses it)."""
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


def env_turn_ids(tokenizer, history: list[dict], new: list[dict], tools: list[dict] | None) -> list[int]:
    """Tokens the template puts after an assistant turn's end token: the environment's
    messages `new` and the header of the next assistant turn. `history` ends with that
    assistant turn. These tokens are context, not the model's output (masked from the loss)."""
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


def sampling(temperature: float) -> dict:
    """generate() settings: plain softmax sampling at `temperature` (no top-k / top-p, as GRPO
    assumes), or greedy at 0."""
    return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)


def cut_at_stop(row: list[int], stops: list[int]) -> list[int]:
    """A sampled turn up to and including its first end-of-turn token."""
    return row[:next((k + 1 for k, t in enumerate(row) if t in stops), len(row))]


def generate_batch(model, tokenizer, seqs: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
    """Sample one continuation per token sequence (a left-padded batch), cut after the first
    end-of-turn token: reading every sequence from its start."""
    return CachedBatch(model, tokenizer, temperature)(seqs, max_new_tokens)


class CachedBatch:
    """`generate_batch` across the turns of multi-turn episodes, keeping each row's KV cache.

    Called each turn with the live rows' full token lists; when every row extends a row of the
    previous call (its sampled turn, then the environment's tokens), only the new tokens are
    fed: each row's block is left-padded and the holes are masked, finished rows are dropped
    from the cache. Otherwise (a new batch) it starts fresh. Same samples as re-reading the
    whole batch each turn, without paying the long prompts again."""

    def __init__(self, model, tokenizer, temperature: float):
        self.model, self.tok, self.temperature = model, tokenizer, temperature
        self.rows: list[list[int]] | None = None  # each row's real tokens so far
        self.ids = self.mask = self.cache = None  # the padded layout the cache covers

    def _continuation(self, seqs: list[list[int]]) -> list[int] | None:
        if self.rows is None:
            return None
        idx = []
        for s in seqs:
            j = next((j for j, r in enumerate(self.rows) if len(r) < len(s) and s[:len(r)] == r and j not in idx), None)
            if j is None:
                return None
            idx.append(j)
        return idx

    def __call__(self, seqs: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        import torch

        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        dev = next(self.model.parameters()).device
        stops = stop_ids(self.tok)
        idx = self._continuation(seqs)
        rows = seqs if idx is None else [s[len(self.rows[j]):] for s, j in zip(seqs, idx)]  # all, or the new tokens
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=dev)  # left-padded, holes masked
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=dev)
        cache = None
        if idx is not None:
            sel = torch.tensor(idx, device=dev)
            ids, mask = torch.cat([self.ids[sel], ids], 1), torch.cat([self.mask[sel], mask], 1)
            cache = self.cache
            cache.batch_select_indices(sel)
        self.fed = ids.shape[1] - (cache.get_seq_length() if cache is not None else 0)  # columns run this call
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=max_new_tokens,
                                      eos_token_id=stops, pad_token_id=pad, repetition_penalty=1.0,
                                      return_dict_in_generate=True, **sampling(self.temperature))
        new = out.sequences[:, ids.shape[1]:]
        results, new_mask = [], torch.zeros_like(new)
        for i, row in enumerate(new.tolist()):
            results.append(cut_at_stop(row, stops))
            new_mask[i, :len(results[-1])] = 1
        self.ids, self.mask = out.sequences, torch.cat([mask, new_mask], 1)
        self.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        self.rows = [s + r for s, r in zip(seqs, results)]
        return results


def load_model(name_or_path: str, device: str | None = None, dtype=None):
    """(model in eval mode, tokenizer) of an embedded model name, a .gguf or a transformers
    checkpoint directory. Default device: this process's GPU (`LOCAL_RANK` under torchrun /
    accelerate, one GPU per process) when CUDA is available, else the CPU; default dtype:
    bf16 on CUDA, fp32 elsewhere."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = hf_checkpoint(name_or_path)
    device = device or (f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)


class HFPolicy:
    """A transformers model (optionally with a LoRA adapter, or an MoE's routed model) with `chat`.

    Reuses the KV cache of the previous call when the new prompt extends it, so a multi-turn
    episode pays the long system prompt once, not once per turn."""

    def __init__(self, model, tokenizer, name: str, max_new_tokens: int = 256, temperature: float = 0.0):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.usage = Usage()
        self._lock = threading.Lock()  # one generate at a time per model
        self._cache = None  # (token ids the cache covers, DynamicCache)
        self.before_generate = None  # hook(messages, tools) run under the lock (the router uses it)

    @classmethod
    def load(cls, model: str, adapter: str | None = None, device: str | None = None, dtype=None, **kw) -> "HFPolicy":
        net, tok = load_model(model, device, dtype)
        if adapter:
            from peft import PeftModel

            net = PeftModel.from_pretrained(net, adapter).eval()
        name = f"{Path(model).stem}+{Path(adapter).name}" if adapter else Path(model).stem
        return cls(net, tok, name, **kw)

    def _generate(self, ids: list[int], max_new: int, temp: float) -> list[int]:
        import torch

        dev = next(self.model.parameters()).device
        kw: dict = dict(max_new_tokens=max_new, eos_token_id=stop_ids(self.tokenizer), repetition_penalty=1.0,
                        pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                        return_dict_in_generate=True, **sampling(temp))
        if self._cache is not None:
            seen, cache = self._cache
            n = next((i for i, (a, b) in enumerate(zip(seen, ids)) if a != b), min(len(seen), len(ids)))
            if 16 <= n < len(ids):  # at least one new token must be fed
                cache.crop(n - cache.get_seq_length())  # negative: drop the tokens past the common prefix
                kw["cache"] = cache
        self._cache = None
        x = torch.tensor([ids], device=dev)
        with torch.no_grad():
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
        seq = out.sequences[0].tolist()
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if cache is not None:
            self._cache = (seq[:-1], cache)  # the last token was sampled, never fed
        return cut_at_stop(seq[len(ids):], stop_ids(self.tokenizer))

    def chat(self, messages: list[dict], tools: list[dict] | None = None, temperature: float | None = None,
             max_tokens: int | None = None, **_) -> Reply:
        ids = encode(self.tokenizer, render(self.tokenizer, messages, tools, add_generation_prompt=True))
        temp = self.temperature if temperature is None else temperature
        t0 = time.perf_counter()
        with self._lock:
            if self.before_generate:
                self.before_generate(messages, tools)
            new = self._generate(ids, max_tokens or self.max_new_tokens, temp)
        text = self.tokenizer.decode(new, skip_special_tokens=True).strip()
        calls = parse_tool_calls(text, {t["function"]["name"] for t in tools}) if tools else []
        reply = Reply(content="" if calls else text, tool_calls=calls, finish_reason="stop",
                      prompt_tokens=len(ids), completion_tokens=len(new),
                      seconds=time.perf_counter() - t0, tool_calls_from_text=bool(calls))
        self.usage.add(reply, 0.0)
        return reply
