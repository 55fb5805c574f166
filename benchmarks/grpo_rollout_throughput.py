"""GRPO rollout generation, side by side on the same multi-turn schedule:
  - re-read:  every turn re-reads each episode's whole sequence (`generate_batch`);
  - cached:   each episode's KV cache is kept between turns (`CachedBatch`, what GRPO uses).

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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trace_rl.training.hf_policy import CachedBatch, generate_batch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIGS[args.config], max_position_embeddings=32768)).to(dev, dtype).eval()
    model.generation_config.min_new_tokens = args.new  # every turn runs to full length (no early stop)
    tok = Tok()
    prompts, replies = schedule(args.batch, args.prompt, args.env, args.turns)
    variants = {"re-read each turn (generate_batch)": lambda: (lambda s, n: generate_batch(model, tok, s, n, 1.0)),
                "KV cache kept (CachedBatch)": lambda: CachedBatch(model, tok, 1.0)}
    rollout(variants["KV cache kept (CachedBatch)"](), prompts[:2], replies[:1], 4, sync)  # warm-up
    best = {name: float("inf") for name in variants}
    sampled = {}
    for _ in range(args.rounds):
        for name, make in variants.items():
            t, n = rollout(make(), prompts, replies, args.new, sync)
            best[name], sampled[name] = min(best[name], t), n
    title = (f"{args.config} on {dev.type} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}), "
             f"{args.batch} episodes, prompt {args.prompt}, {args.turns} turns x {args.new} sampled + {args.env} env tokens")
    table = Table("generator", "s / rollout", "sampled tok/s", "speedup", title=title)
    base = best["re-read each turn (generate_batch)"]
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
