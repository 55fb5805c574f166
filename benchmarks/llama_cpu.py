"""llama.cpp on this CPU with and without flash attention, side by side: prompt reading and decoding at the
depths τ²-bench reaches (its telecom system prompt and tools are ~10k tokens; a new task re-reads ~4.6k of
them, because the ticket sits before the tools), and whether greedy decoding picks the same tokens.
    .venv/bin/python benchmarks/llama_cpu.py [--model qwen2.5-coder-0.5b] [--depth 6000] [--json out.json]
"""
import argparse
import json
import os
import time

import llama_cpp
from rich.console import Console
from rich.table import Table
from trace_rl.models.weights import gguf_path

TEXT = "The customer's line is suspended until the overdue bill is paid; verify the account before acting. " * 800


def measure(model: str, flash_attn: bool, depth: int, read: int, decode: int) -> dict:
    llm = llama_cpp.Llama(str(gguf_path(model)), n_ctx=16384, n_threads=os.cpu_count(), flash_attn=flash_attn,
                          verbose=False)
    toks = llm.tokenize(TEXT.encode())[:depth + read]
    llm.eval(toks[:depth])  # the cached prefix
    t = time.perf_counter()
    llm.eval(toks[depth:])  # what a new task reads
    read_s = time.perf_counter() - t
    out, t = [], time.perf_counter()
    for tok in llm.generate([], temp=0.0, reset=False):  # greedy, continuing at depth + read
        out.append(tok)
        if len(out) == decode:
            break
    decode_s = time.perf_counter() - t
    return {"flash_attn": flash_attn, "read_tok_s": read / read_s, "decode_tok_s": decode / decode_s, "tokens": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--depth", type=int, default=6000)
    ap.add_argument("--read", type=int, default=2000)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [measure(a.model, fa, a.depth, a.read, a.decode) for fa in (False, True)]
    same = sum(x == y for x, y in zip(rows[0]["tokens"], rows[1]["tokens"]))
    first_diff = next((i for i, (x, y) in enumerate(zip(rows[0]["tokens"], rows[1]["tokens"])) if x != y), None)
    t = Table(title=f"llama.cpp {llama_cpp.__version__}, {a.model}, {os.cpu_count()} threads, "
                    f"{a.read} tokens read after {a.depth}, {a.decode} decoded")
    for col in ("flash attention", "read tok/s", "decode tok/s", "read ×", "decode ×"):
        t.add_column(col)
    for r in rows:
        t.add_row("on" if r["flash_attn"] else "off", f"{r['read_tok_s']:.1f}", f"{r['decode_tok_s']:.1f}",
                  f"{r['read_tok_s'] / rows[0]['read_tok_s']:.2f}", f"{r['decode_tok_s'] / rows[0]['decode_tok_s']:.2f}")
    Console().print(t)
    print(f"greedy tokens equal: {same}/{a.decode}" + (f" (first difference at token {first_diff})"
                                                         if first_diff is not None else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows], "same": same,
                       "first_difference": first_diff, "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
