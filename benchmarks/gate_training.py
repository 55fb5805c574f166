"""MoE gate training (training/moe.py train_gates) on rows as long as τ² episodes: peak GPU memory
and seconds per row, with and without per-layer activation checkpointing, in one run.

Random-init model of a real architecture (Qwen2.5 configs from moe_throughput.py; no weights
needed), bf16, two LoRA experts of rank 16 on q/k/v/o; each row a full-length sequence with labels
on its last quarter (the assistant turns), as `gate_examples` gives them:
    python benchmarks/gate_training.py [--config 1.5b|0.5b|tiny] [--lengths 2048,6144,12288] [--rows 3]
The proof run's telecom episodes are 4.5-6k tokens (the 1.5B's tokenizer).
"""
import argparse
import json
import time

import torch

from moe_throughput import CONFIGS, peft_with_random_b


def moe_model(config: str, dev):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trace_rl.training.moe import Adapter, LoRAMoE

    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**CONFIGS[config], max_position_embeddings=32768)).to(dev, torch.bfloat16).eval()
    return LoRAMoE(base, [Adapter.from_peft(f"cap{i}", peft_with_random_b(base, f"cap{i}", 0.02)) for i in range(2)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="1.5b", choices=sorted(CONFIGS))
    ap.add_argument("--lengths", default="2048,6144,12288")
    ap.add_argument("--rows", type=int, default=3, help="rows per measurement (one optimiser step each)")
    ap.add_argument("--json", help="also write the table here")
    args = ap.parse_args()
    from trace_rl.training.moe import train_gates

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    moe = moe_model(args.config, dev)
    vocab = CONFIGS[args.config]["vocab_size"]
    out = []
    print(f"{'length':>7} {'checkpointing':>13} {'peak GiB':>9} {'s/row':>7}  note")
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(0, vocab, (1, length), device=dev)
        labels = ids.clone()
        labels[:, : length * 3 // 4] = -100  # the policy and tool results: context, not labels
        rows = [{"input_ids": ids, "labels": labels}] * args.rows
        for checkpointing in (True, False):
            if dev == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.synchronize()
            t0, note = time.perf_counter(), ""
            try:
                train_gates(moe, rows, epochs=1, checkpointing=checkpointing)
                if dev == "cuda":
                    torch.cuda.synchronize()
            except torch.OutOfMemoryError:
                note = "out of memory"
            sec = (time.perf_counter() - t0) / args.rows
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
            out.append({"length": length, "checkpointing": checkpointing, "peak_gib": round(peak, 2),
                        "s_per_row": round(sec, 3), "note": note})
            print(f"{length:>7} {str(checkpointing):>13} {peak:>9.2f} {sec:>7.3f}  {note}", flush=True)
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device: {device}; config {args.config}, bf16, 2 experts r=16")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "config": args.config, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
