"""GRPO rollout generation, side by side on the same multi-turn schedule:
  - HF generate, cache kept: each episode's DynamicCache is kept between turns (`HFCachedBatch`
    below: what GRPO used before the engine);
  - engine (eager / graph / inductor): models/engine.py, what GRPO uses now.

Random-init model of a real architecture (Qwen2.5 configs; no weights needed), a batch of
episodes with a long first prompt (system prompt + tool schemas), then `--turns` turns of
`--new` sampled tokens each followed by an environment reply of `--env` tokens; every
turn runs to full length. Prints a table: wall time per rollout, sampled tokens/s, speedup.
    python benchmarks/grpo_rollout_throughput.py --config 0.5b --batch 16      (GPU)
    python benchmarks/grpo_rollout_throughput.py --config tiny --batch 4       (CPU smoke)
"""
import argparse
import json
import time

import torch

from moe_throughput import CONFIGS


class Tok:
    """Just what the generators read from a tokenizer: pad / end ids (never sampled here)."""
    pad_token_id, eos_token_id, unk_token_id = 151643, 151645, None

    def convert_tokens_to_ids(self, token):
        return {"<|im_end|>": 151645, "<|endoftext|>": 151643}.get(token)


def cut_at_stop(row, stops):
    return row[:next((k + 1 for k, t in enumerate(row) if t in stops), len(row))]


class HFCachedBatch:
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
        stops = [self.tok.eos_token_id, self.tok.pad_token_id]
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
                                      return_dict_in_generate=True, do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0)
        new = out.sequences[:, ids.shape[1]:]
        results, new_mask = [], torch.zeros_like(new)
        for i, row in enumerate(new.tolist()):
            results.append(cut_at_stop(row, stops))
            new_mask[i, :len(results[-1])] = 1
        self.ids, self.mask = out.sequences, torch.cat([mask, new_mask], 1)
        self.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        self.rows = [s + r for s, r in zip(seqs, results)]
        return results


def schedule(batch: int, prompt: int, env: int, turns: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1000, 100000, (prompt + 16 * i,), generator=g).tolist() for i in range(batch)]
    replies = [[torch.randint(1000, 100000, (env,), generator=g).tolist() for _ in range(batch)] for _ in range(turns)]
    return prompts, replies


def rollout(generate, prompts, replies, new: int, sync) -> tuple[float, int]:
    seqs = [list(p) for p in prompts]
    sampled = 0
    sync()
    t0 = time.perf_counter()
    for turn, env in enumerate(replies):
        outs = generate(seqs, new)
        sampled += sum(len(o) for o in outs)
        seqs = [s + o + e for s, o, e in zip(seqs, outs, env)]
    sync()
    return time.perf_counter() - t0, sampled


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="0.5b", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=16, help="episodes in flight (a GRPO group)")
    ap.add_argument("--prompt", type=int, default=1500, help="first prompt tokens (system + tools + task)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--new", type=int, default=48, help="sampled tokens per turn")
    ap.add_argument("--env", type=int, default=80, help="environment reply tokens per turn")
    ap.add_argument("--rounds", type=int, default=2, help="round-robin repeats; the best time counts")
    ap.add_argument("--modes", default="hf,eager,graph,inductor")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trace_rl.models.engine import Engine, Request

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIGS[args.config], max_position_embeddings=32768)).to(dev, dtype).eval()
    model.generation_config.min_new_tokens = args.new  # every turn runs to full length (no early stop)
    tok = Tok()
    tok.eos_token_id = 10**9  # the engine: no early stop either (a random model never samples this id)
    prompts, replies = schedule(args.batch, args.prompt, args.env, args.turns)
    max_len = args.prompt + 16 * args.batch + args.turns * (args.new + args.env) + 64
    engines = {}

    def engine(mode):
        if mode not in engines:
            engines[mode] = Engine(model, tok, rows=args.batch, max_len=max_len, compile=mode)
        eng = engines[mode]
        eng.reset()  # a GRPO step starts from new weights: nothing reused across steps
        return lambda s, n: eng.generate([Request(x, n, 1.0) for x in s])
    variants = {"HF generate, cache kept (before)": lambda: HFCachedBatch(model, Tok(), 1.0)}
    variants.update({f"engine, {m}": (lambda m=m: engine(m)) for m in args.modes.split(",") if m != "hf"})
    for make in variants.values():  # warm-up: graph capture, compilation
        rollout(make(), prompts, replies[:1], 4, sync)
    best = {name: float("inf") for name in variants}
    sampled = {}
    for _ in range(args.rounds):
        for name, make in variants.items():
            t, n = rollout(make(), prompts, replies, args.new, sync)
            best[name], sampled[name] = min(best[name], t), n
    title = (f"{args.config} on {dev.type} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}), "
             f"{args.batch} episodes, prompt {args.prompt}, {args.turns} turns x {args.new} sampled + {args.env} env tokens")
    table = Table("generator", "s / rollout", "sampled tok/s", "speedup", title=title)
    base = best["HF generate, cache kept (before)"]
    rows = []
    for name in variants:
        rows.append({"generator": name, "seconds": best[name], "sampled_tok_s": sampled[name] / best[name],
                     "speedup": base / best[name]})
        table.add_row(name, f"{best[name]:.2f}", f"{sampled[name] / best[name]:.0f}", f"{base / best[name]:.2f}x")
    Console().print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"title": title, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
