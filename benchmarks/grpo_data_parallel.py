"""GRPO data parallelism: the same global batch (G x groups_per_step episodes) on 1 or N processes.

`CapabilityGRPO` splits the global batch into whole groups per process (trl gathers the rewards
for the advantages), so 1 and N processes train on the same batches. This script runs it on a
random-init model of a real architecture (no weights needed) against an in-process toy benchmark
whose reward varies with sampled text (`tests/support/letters.py`), and records per step: reward,
loss, rollout seconds and training seconds. Launch it exactly as a user launches GRPO:

    accelerate launch --num_processes 2 benchmarks/grpo_data_parallel.py --config 1.5b --out dp2.json   # 2 GPUs
    python benchmarks/grpo_data_parallel.py --config 1.5b --out dp1.json                                  # 1 GPU
    torchrun --nproc_per_node 2 benchmarks/grpo_data_parallel.py --config tiny --out dp2.json          # CPU (gloo)
    python benchmarks/grpo_data_parallel.py --compare dp1.json dp2.json      # side-by-side table
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from moe_throughput import CONFIGS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the letters toy benchmark lives there


def train(args) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, TrainerCallback

    from letters import LetterBench

    from trace_rl.training.grpo import PRESETS, CapabilityGRPO

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.manual_seed(args.seed)  # every process builds the same random model
    model = Qwen2ForCausalLM(Qwen2Config(**{**CONFIGS[args.config], "vocab_size": len(tok)},
                                         max_position_embeddings=32768))
    settings = PRESETS["cpu"].model_copy(update=dict(
        steps=args.steps, group_size=args.group_size, groups_per_step=args.groups_per_step, max_steps=2,
        max_turn_tokens=args.new_tokens, save_steps=10_000, log_kl=False, seed=args.seed, learning_rate=1e-4))
    bench = LetterBench(n_tasks=64)
    grpo = CapabilityGRPO(model, tok, bench, [t.id for t in bench.tasks()], args.workdir, settings, name="letters")
    timing: dict[int, dict] = {}
    play = grpo.rollout_func

    def timed_rollout(prompts, trainer):
        t0 = time.perf_counter()
        out = play(prompts, trainer)
        sampled = torch.tensor(float(sum(sum(m) for m in out["env_mask"])), device=trainer.accelerator.device)
        timing.setdefault(trainer.state.global_step, {})["rollout_s"] = time.perf_counter() - t0
        timing[trainer.state.global_step]["sampled_tokens"] = float(trainer.accelerator.reduce(sampled, "sum"))
        return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            timing.setdefault(state.global_step - 1, {})["step_s"] = time.perf_counter() - self.t0

    trainer = grpo.build()
    trainer.rollout_func = timed_rollout
    trainer.add_callback(StepClock())
    res = grpo.train()
    if int(os.environ.get("RANK", "0")) == 0:
        steps = []
        for r in res.log:
            t = timing.get(int(r["step"]) - 1, {})
            steps.append({"step": int(r["step"]), "reward": r["reward"], "reward_std": r.get("reward_std"),
                          "loss": r.get("loss"), "grad_norm": r.get("grad_norm"), **t, "train_s": t.get("step_s", 0) - t.get("rollout_s", 0)})
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        with open(args.out, "w") as f:
            json.dump({"processes": int(os.environ.get("WORLD_SIZE", "1")), "device": dev, "args": vars(args),
                       "global_batch": args.group_size * args.groups_per_step, "steps": steps}, f, indent=1)


def compare(paths: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    runs = [json.load(open(p)) for p in paths]
    con = Console()
    head = runs[0]
    con.print(f"{head['args']['config']} random-init on {head['device']}, global batch {head['global_batch']} episodes "
              f"(G={head['args']['group_size']}), seed {head['args']['seed']}")
    per_step = Table("step", *[f"{r['processes']} proc: reward / loss" for r in runs], title="per step")
    for i in range(min(len(r["steps"]) for r in runs)):
        per_step.add_row(str(i + 1), *[f"{r['steps'][i]['reward']:.4f} / {r['steps'][i]['loss']:.4f}" for r in runs])
    con.print(per_step)
    tp = Table("processes", "mean reward", "rollout s/step", "sampled tok/s", "train s/step", "speedup (step)",
               title="throughput (first step excluded: warm-up)")
    base = None
    for r in runs:
        s = r["steps"][1:] or r["steps"]
        mean = lambda k: sum(x.get(k, 0) for x in s) / len(s)
        step_s = mean("step_s")
        base = base or step_s
        tp.add_row(str(r["processes"]), f"{mean('reward'):.4f}", f"{mean('rollout_s'):.2f}",
                   f"{sum(x.get('sampled_tokens', 0) for x in s) / max(1e-9, sum(x.get('rollout_s', 0) for x in s)):.0f}",
                   f"{mean('train_s'):.2f}", f"{base / step_s:.2f}x")
    con.print(tp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1.5b", choices=sorted(CONFIGS))
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded Qwen2.5-Coder's)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-step", type=int, default=4, help="a multiple of the number of processes")
    ap.add_argument("--new-tokens", type=int, default=64, help="sampled tokens per turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="runs/grpo_dp")
    ap.add_argument("--out", default="grpo_dp.json")
    ap.add_argument("--compare", nargs="+", help="print the table for these result files")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare)
    if args.tokenizer is None:
        from trace_rl.models.weights import hf_checkpoint

        args.tokenizer = str(hf_checkpoint("qwen2.5-coder-0.5b"))
    args.workdir = f"{args.workdir}/p{os.environ.get('WORLD_SIZE', '1')}"
    if os.path.exists(f"{args.workdir}/checkpoints"):  # trl would resume from it: not a fresh measurement
        raise SystemExit(f"{args.workdir} holds an earlier run; remove it or pass another --workdir")
    train(args)


if __name__ == "__main__":
    main()
