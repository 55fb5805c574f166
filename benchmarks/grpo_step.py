"""Seconds per GRPO step and the generation share, before and after the engine, side by side.

Real trl GRPOTrainer steps (training/grpo.py) on a multi-turn environment from sandbox/envs/,
run in the subprocess sandbox backend (a GPU machine has no Docker; these envs passed the Docker
verifier); a random-init Qwen2.5 model of the chosen shape with the real Qwen tokenizer
(`--tokenizer DIR`). Generators, alternating step by step in one process:
  before: HF `generate` with each episode's DynamicCache kept between turns (what GRPO used);
  after:  the engine (static row cache; the decode step one CUDA graph, `--mode`).
    python benchmarks/grpo_step.py --tokenizer .device/qwen-tokenizer
"""
import argparse
import json
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

from grpo_rollout_throughput import HFCachedBatch
from moe_throughput import CONFIGS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1.5b", choices=sorted(CONFIGS))
    ap.add_argument("--tokenizer", required=True, help="a transformers tokenizer folder (Qwen's)")
    ap.add_argument("--env", default="mobile_data_troubleshooting_telecom.py")
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="steps per generator (the first is a warm-up)")
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--mode", default="graph", help="engine mode: graph, inductor, eager")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trace_rl.evals.synthetic import SyntheticBenchmark
    from trace_rl.models.engine import Engine
    from trace_rl.training.grpo import CapabilityGRPO, GRPOSettings

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    code = (resources.files("trace_rl.sandbox") / "envs" / args.env).read_text()
    settings = GRPOSettings(group_size=args.group, groups_per_step=1, steps=args.steps, max_steps=args.turns,
                            max_turn_tokens=args.turn_tokens, max_seq_len=8192, save_steps=10**6, log_kl=False,
                            learning_rate=1e-5, hint_fraction=0.25)
    results = {}
    for name in ("before", "after"):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**CONFIGS[args.config], max_position_embeddings=32768)).to(dev)
        if dev.type == "cuda":
            model = model.to(torch.bfloat16)

        class Bench(CapabilityGRPO):
            def _generator(self, trainer):
                if name == "before":
                    net = trainer.accelerator.unwrap_model(trainer.model)
                    return HFCachedBatch(net, tok, settings.temperature)
                if self.engine is None:
                    self.engine = Engine(trainer.accelerator.unwrap_model(trainer.model), tok, rows=args.group,
                                         max_len=settings.max_seq_len + settings.max_turn_tokens, compile=args.mode)
                return super()._generator(trainer)

        from transformers import TrainerCallback

        class StepTimer(TrainerCallback):
            def __init__(self):
                self.marks = [time.perf_counter()]

            def on_step_end(self, *a, **k):
                self.marks.append(time.perf_counter())

        timer = StepTimer()
        with tempfile.TemporaryDirectory() as out, SyntheticBenchmark(code, seeds=range(50), pool_size=args.group,
                                                                               verified=True, backend="subprocess") as b:
            g = Bench(model, tok, b, [str(s) for s in range(50)], Path(out), settings, name=f"bench-{name}")
            g.build().add_callback(timer)
            res = g.train()
        step_s = [b - a for a, b in zip(timer.marks, timer.marks[1:])]
        rollout_s = [r.get("time/rollout_s", float("nan")) for r in res.log]
        timed = slice(1, None) if len(step_s) > 1 else slice(None)  # the first step pays capture / warm-up
        per, gen = (sum(x[timed]) / len(x[timed]) for x in (step_s, rollout_s))
        results[name] = {"step_s": step_s, "rollout_s": rollout_s, "turns": [r.get("episode/turns") for r in res.log],
                         "s_per_step": per, "rollout_s_per_step": gen, "generation_share": gen / per}
        print(name, json.dumps(results[name]))
        del model, g
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\nGRPO on {args.env}, Qwen2.5-{args.config} shape (random init), group {args.group}, "
          f"<= {args.turns} turns x {args.turn_tokens} tokens, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}")
    print(f"{'generator':<10} {'s / step':>9} {'generation s / step':>20} {'generation share':>17}")
    for name, r in results.items():
        print(f"{name:<10} {r['s_per_step']:>9.2f} {r['rollout_s_per_step']:>20.2f} {r['generation_share']:>16.0%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
