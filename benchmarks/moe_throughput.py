"""Decoding throughput: base vs merged LoRA vs unmerged LoRA (peft) vs the 4-expert MoE.

Random-init model of a real architecture (Qwen2.5-1.5B's config; no weights needed),
bf16, greedy decoding with a KV cache, batch 1 and 32, all variants in one run:
    python benchmarks/moe_throughput.py [--config 1.5b|0.5b] [--new-tokens 128]
Target: MoE decoding within 1.15x the time of a single unmerged LoRA.
"""
import argparse
import copy
import json
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


def timed_generate(generate, batch: int, prompt: int, new: int, device) -> float:
    ids = torch.randint(0, 1000, (batch, prompt), device=device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(ids, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1.5b", choices=sorted(CONFIGS))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin repeats; the best time counts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trace_rl.training.moe import Adapter, LoRAMoE

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = Qwen2Config(**CONFIGS[args.config], max_position_embeddings=4096)
    base = Qwen2ForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    lcfg = LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)

    def peft_with_random_b(name):
        m = get_peft_model(copy.deepcopy(base), lcfg, adapter_name=name)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        return m.eval()

    unmerged = peft_with_random_b("cap0")  # the others are only read into the MoE's adapters
    adapters = [Adapter.from_peft("cap0", unmerged)] + [Adapter.from_peft(f"cap{i}", peft_with_random_b(f"cap{i}"))
                                                        for i in range(1, 4)]
    merged = peft_with_random_b("m").merge_and_unload().eval()
    moe = LoRAMoE(copy.deepcopy(base), adapters).eval()
    with torch.no_grad():  # spread tokens over all experts, as a trained router would
        for g in moe.gates:
            g.proj.weight.normal_(0, 0.05)
            g.proj.bias.zero_()
    variants = {"base": base, "merged LoRA": merged, "unmerged LoRA (peft)": unmerged, "MoE, 4 experts": moe}
    rows = []
    with torch.no_grad():
        for b in [int(x) for x in args.batches.split(",")]:
            best = {}
            for _ in range(args.rounds):  # round-robin, so clock ramp-up and caches hit every variant alike
                for name, model in variants.items():
                    gen = model.model.generate if name.startswith("MoE") else model.generate
                    dt = timed_generate(gen, b, args.prompt, args.new_tokens, dev)
                    best[name] = min(best.get(name, float("inf")), dt)
            for name, dt in best.items():
                rows.append({"batch": b, "variant": name, "seconds": dt, "tokens_per_s": b * args.new_tokens / dt})
            rows[-1]["routing_fractions"] = moe.routing_fractions()
    print(f"\nQwen2.5-{args.config} config, random init, bf16, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'batch':>5} {'variant':<22} {'tok/s':>10} {'time vs unmerged':>17}")
    for r in rows:
        ref = next(x for x in rows if x["batch"] == r["batch"] and x["variant"].startswith("unmerged"))
        r["vs_unmerged"] = r["seconds"] / ref["seconds"]
        print(f"{r['batch']:>5} {r['variant']:<22} {r['tokens_per_s']:>10.1f} {r['vs_unmerged']:>16.2f}x")
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
