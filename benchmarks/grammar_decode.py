"""What the engine's JSON-schema grammar (models/grammar.py) costs per token, and that it holds on the
device that runs it (on CUDA: the masked decode step replayed as a CUDA graph).

Random-init model of a real Qwen2.5 shape, bf16 on CUDA (fp32 on CPU), with a real Qwen tokenizer (the
grammar needs its vocabulary). Per batch size, round-robin: free decoding at T = 1 to the same token count
as the grammar arm, and grammar decoding of the analyst's labelling answer (6 trajectories x 2 capabilities:
label, step, a quote of <= 160 characters, a fact) at T = 1. Every grammar reply must parse and validate.

    python benchmarks/grammar_decode.py --tokenizer DIR [--config 1.5b|0.5b|tiny] [--batches 1,32]
"""
import argparse
import json
import time

import torch

from moe_throughput import CONFIGS


def labelling_schema():
    from trace_rl.agents.analyst import answer_shapes

    ids = [f"T{i}" for i in range(1, 7)]
    strict, _ = answer_shapes(ids, ["tool_argument_precision", "multi_step_state_modification"],
                              {t: ["tool_errors", "invalid_arguments"] for t in ids})
    return strict, strict.model_json_schema()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="a Qwen2.5 tokenizer folder (e.g. the converted 0.5B's)")
    ap.add_argument("--config", default="1.5b", choices=sorted(CONFIGS))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trace_rl.models.chat import extract_json
    from trace_rl.models.engine import Engine, Request
    from trace_rl.models.grammar import Grammars

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIGS[args.config], max_position_embeddings=8192)).to(dev, dtype).eval()
    batches = [int(b) for b in args.batches.split(",")]
    eng = Engine(model, tok, rows=max(batches), max_len=args.prompt + args.max_new + 64)
    grammars = Grammars(tok, eng.vocab_size, sorted(eng.stop_set))
    shape, schema = labelling_schema()
    prompt = [int(t) for t in torch.randint(1000, 100000, (args.prompt,))]

    def timed(reqs):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = eng.generate(reqs)
        if dev == "cuda":
            torch.cuda.synchronize()
        return outs, time.perf_counter() - t0

    rows = []
    for b in batches:
        # warm-up: captures both graphs (free and masked) for this cache layout
        eng.generate([Request(prompt, 16, 1.0, grammar=grammars.matcher(schema)) for _ in range(b)])
        eng.generate([Request(prompt, 16, 1.0) for _ in range(b)])
        g_tok = g_s = f_tok = f_s = valid = 0
        for r in range(args.rounds):
            outs, s = timed([Request(prompt, args.max_new, 1.0, grammar=grammars.matcher(schema)) for _ in range(b)])
            g_tok, g_s = g_tok + sum(map(len, outs)), g_s + s
            for o in outs:
                text = tok.decode([t for t in o if t not in eng.stop_set])
                try:  # parsed as the pipeline parses a structured reply
                    shape.model_validate(extract_json(text))
                    valid += 1
                except ValueError:
                    pass
            n = max(map(len, outs))  # free rows decode as long as the longest grammar reply
            outs, s = timed([Request(prompt, n, 1.0) for _ in range(b)])
            f_tok, f_s = f_tok + sum(map(len, outs)), f_s + s
        rows.append((b, f_tok / f_s, g_tok / g_s, (g_s / g_tok) / (f_s / f_tok), f"{valid}/{b * args.rounds}",
                     g_tok / (b * args.rounds)))
    table = Table(title=f"grammar decoding, random-init Qwen2.5-{args.config}, {dev} "
                        f"({torch.cuda.get_device_name() if dev == 'cuda' else 'CPU'}), prompt {args.prompt}, T = 1")
    for col in ("batch", "free tok/s", "grammar tok/s", "time per token, grammar / free", "valid replies",
                "mean reply tokens"):
        table.add_column(col, justify="right")
    for b, f, g, ratio, valid, mean in rows:
        table.add_row(str(b), f"{f:,.0f}", f"{g:,.0f}", f"{ratio:.2f}x", valid, f"{mean:.0f}")
    Console(width=140).print(table)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
