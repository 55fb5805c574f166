"""In-process transformers policy (+ optional LoRA adapter or MoE): the same `chat` interface
as `LLM`, so the base agent, training and MoE evaluation share one loop.

Tool calls are parsed from the generated text (<tool_call> tags, fences or bare JSON), as
for any endpoint. Slower than llama.cpp on CPU for rollouts; needed where gradients or
adapters live in-process.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from trace_rl.agents.llm import Reply, Usage, parse_tool_calls


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> what HF chat templates expect (tool-call arguments as dicts)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = dict(tc["function"])
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except ValueError:
                        pass
                calls.append({**tc, "function": fn})
            m["tool_calls"] = calls
            m["content"] = m.get("content") or ""
        out.append(m)
    return out


class HFPolicy:
    def __init__(self, model: str, adapter: str | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                 device: str | None = None, dtype=None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trace_rl.training.models import hf_checkpoint

        path = hf_checkpoint(model)
        self.name = f"{Path(model).stem}+{Path(adapter).name}" if adapter else Path(model).stem
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.bfloat16 if self.device == "cuda" else torch.float32)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        if adapter:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, adapter).eval()
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.usage = Usage()
        self._lock = threading.Lock()  # one generate at a time per model

    def chat(self, messages: list[dict], tools: list[dict] | None = None, temperature: float | None = None,
             max_tokens: int | None = None, **_) -> Reply:
        import torch

        enc = self.tokenizer.apply_chat_template(template_messages(messages), tools=tools, add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)
        ids = enc["input_ids"].to(self.device)
        temp = self.temperature if temperature is None else temperature
        kw = dict(max_new_tokens=max_tokens or self.max_new_tokens, pad_token_id=self.tokenizer.eos_token_id)
        kw.update(dict(do_sample=True, temperature=temp) if temp > 0 else dict(do_sample=False))
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        new = out[0, ids.shape[1]:]
        text = self.tokenizer.decode(new, skip_special_tokens=True).strip()
        names = {t["function"]["name"] for t in tools or []}
        calls = parse_tool_calls(text, names) if tools else []
        reply = Reply(content="" if calls else text, tool_calls=calls, finish_reason="stop",
                      prompt_tokens=int(ids.shape[1]), completion_tokens=int(new.shape[0]),
                      seconds=time.perf_counter() - t0, tool_calls_from_text=bool(calls))
        self.usage.add(reply, 0.0)
        return reply
