"""Decoding throughput on a GPU: HF `generate` (eager, what the project used before the engine)
vs the engine (models/engine.py: static row cache, decode step as one CUDA graph, optionally
fused by torch.compile first), for the base model, an unmerged LoRA and the 4-expert MoE.

Random-init model of a real architecture (Qwen2.5 configs; no weights needed), bf16, greedy,
every row decodes the full `--new-tokens`; all variants in one run, round-robin:
    python benchmarks/moe_throughput.py [--config 1.5b|0.5b] [--batches 1,32] [--modes graph,inductor]
Targets (the speed issue): base batch 1 >= 420 tok/s; MoE time <= 1.10x base under the same settings.
"""
import argparse
import copy
import time

import torch

CONFIGS = {  # the public Qwen2.5 configs, written out (no hub access)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,  # CPU smoke runs
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class Tok:
    """What the engine reads from a tokenizer: a pad id, and end ids a random model never samples."""
    pad_token_id, eos_token_id, unk_token_id = 0, 10**9, None

    def convert_tokens_to_ids(self, token):
        return None


def peft_with_random_b(base, name: str, std: float = 0.01):
    """A rank-16 peft LoRA on a copy of `base` with B drawn at random (peft starts B at 0: the base)."""
    from peft import LoraConfig, get_peft_model

    m = get_peft_model(copy.deepcopy(base), LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0),
                       adapter_name=name)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    return m.eval()


def models(config: str, dev, wanted=("base", "lora", "moe")):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trace_rl.training.moe import Adapter, LoRAMoE

    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**CONFIGS[config], max_position_embeddings=4096)).to(dev, torch.bfloat16).eval()
    nets = {"base": base}
    if "lora" in wanted or "moe" in wanted:
        nets["lora"] = peft_with_random_b(base, "cap0")  # one unmerged peft adapter
    if "moe" in wanted:  # 4 experts
        adapters = [Adapter.from_peft("cap0", nets["lora"])] + [
            Adapter.from_peft(f"cap{i}", peft_with_random_b(base, f"cap{i}")) for i in range(1, 4)]
        nets["moe"] = moe = LoRAMoE(copy.deepcopy(base), adapters).eval()
        with torch.no_grad():  # spread tokens over all experts, as a trained router would
            for g in moe.gates:
                g.proj.weight.normal_(0, 0.05)
                g.proj.bias.zero_()
    return nets


def hf_generate(model, ids, new):
    gen = model.model.generate if hasattr(model, "gates") else model.generate
    out = gen(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0)
    return out.shape[0] * (out.shape[1] - ids.shape[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1.5b", choices=sorted(CONFIGS))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--modes", default="eager-hf,graph,inductor", help="eager-hf (HF generate), eager, graph, inductor")
    ap.add_argument("--variants", default="base,lora,moe", help="base, lora (unmerged peft), moe (4 experts)")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin repeats; the best time counts")
    ap.add_argument("--sum-rows", type=int, default=None,
                    help="models.fuse.SUM_ROWS: up to how many rows a compiled thin product is a multiply-sum")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from trace_rl.core.io import atomic_write_json
    from trace_rl.models import fuse
    from trace_rl.models.engine import Engine, Request

    if args.sum_rows is not None:
        fuse.SUM_ROWS = args.sum_rows

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    wanted = args.variants.split(",")
    nets = models(args.config, dev, wanted)
    modes = args.modes.split(",")
    rows, setup = [], {}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in [int(x) for x in args.batches.split(",")]:
            runners = {}
            for name in wanted:
                for mode in modes:
                    if mode == "eager-hf":
                        runners[(name, mode)] = lambda ids, m=nets[name]: hf_generate(m, ids, args.new_tokens)
                        continue
                    t0 = time.perf_counter()
                    eng = Engine(nets[name], Tok(), rows=b, max_len=args.prompt + args.new_tokens + 16, compile=mode,
                                 before_forward=nets[name].route_rows if hasattr(nets[name], "gates") else None)

                    def run(ids, eng=eng):
                        eng.reset()
                        outs = eng.generate([Request(r, args.new_tokens, 0.0, tag=-1) for r in ids.tolist()])
                        return sum(len(o) for o in outs)
                    run(torch.randint(1000, 100000, (b, args.prompt), generator=g).to(dev))  # capture / compile
                    sync()
                    setup[(b, name, mode)] = time.perf_counter() - t0
                    runners[(name, mode)] = run
            best, toks = {}, {}
            for _ in range(args.rounds):  # round-robin: clock ramp-up and caches hit every variant alike
                for key, run in runners.items():
                    ids = torch.randint(1000, 100000, (b, args.prompt), generator=g).to(dev)
                    sync()
                    t0 = time.perf_counter()
                    n = run(ids)
                    sync()
                    dt = time.perf_counter() - t0
                    if dt < best.get(key, float("inf")):
                        best[key], toks[key] = dt, n
            if not rows:
                print(f"\nQwen2.5-{args.config} config, random init, bf16, prompt {args.prompt}, "
                      f"{args.new_tokens} new tokens, {device}")
                print(f"{'batch':>5} {'variant':<8} {'mode':<9} {'tok/s':>9} {'time vs base, same mode':>24} {'setup s':>8}")
            done = [{"batch": b, "variant": name, "mode": mode, "seconds": dt, "tokens": toks[(name, mode)],
                     "tokens_per_s": toks[(name, mode)] / dt, "setup_s": setup.get((b, name, mode), 0.0),
                     "vs_base": dt / best.get(("base", mode), dt)} for (name, mode), dt in best.items()]
            for r in done:  # printed and saved batch by batch: a run cut short keeps what it finished
                print(f"{b:>5} {r['variant']:<8} {r['mode']:<9} {r['tokens_per_s']:>9.1f} {r['vs_base']:>23.2f}x "
                      f"{r['setup_s']:>8.1f}", flush=True)
            rows += done
            if args.out:  # whole or not at all: a run cut short by its time limit may stop here
                atomic_write_json(args.out, {"device": device, "config": args.config, "rows": rows})


if __name__ == "__main__":
    main()
