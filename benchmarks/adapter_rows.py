"""One adapter row of a CPU evaluation, side by side: llama.cpp with the adapter converted to a GGUF
LoRA (what `evaluate` runs on a CPU machine) vs in-process transformers (fp32, the engine's CPU
path) with the peft adapter, on the same τ²-bench telecom test tasks, greedy. Each arm computes
the ~10k-token system prompt once (the GGUF LoRA is new, so no saved prompt state matches it).

    .venv/bin/python benchmarks/adapter_rows.py [--tasks 2] [--max-steps 5] [--max-tokens 96] [--json out.json]

The adapter is a rank-16 LoRA on q/k/v/o of the embedded 0.5B with small random B (peft starts B
at 0, which would be the base model itself), so both arms run a real adapted model.
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trace_rl.agents.base_agent import run_episode
from trace_rl.models.llm import LLM, LLMConfig
from trace_rl.evals.tau2_bench import Tau2Benchmark
from trace_rl.models.hf_policy import HFPolicy, load_model

MODEL = "qwen2.5-coder-0.5b"


def random_adapter(out: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(MODEL)
    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.002)
    peft.save_pretrained(out)
    return out


def arm(policy, bench, ids: list[str], max_steps: int) -> dict:
    t0, trajs, seconds = time.perf_counter(), [], []
    for tid in ids:
        t = time.perf_counter()
        trajs.append(run_episode(policy, bench.episode(tid), task_id=tid, benchmark=bench.name, max_steps=max_steps))
        seconds.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    return {"episodes": len(ids), "wall_s": wall, "episode_s": seconds, "episodes_per_min": 60 * len(ids) / wall,
            "prompt_tokens": policy.usage.prompt_tokens, "completion_tokens": policy.usage.completion_tokens,
            "passed": sum(t.passed for t in trajs), "tool_calls": sum(t.tool_calls for t in trajs)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bench = Tau2Benchmark("telecom")
    ids = [t.id for t in bench.tasks("test")][:args.tasks]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapter = random_adapter(Path(tmp) / "adapter")
        llm = LLM(LLMConfig(model=MODEL, lora=str(adapter), temperature=0.0, max_tokens=args.max_tokens))
        rows["llama.cpp + GGUF LoRA (Q4)"] = arm(llm, bench, ids, args.max_steps)
        hf = HFPolicy.load(MODEL, adapter=str(adapter), max_new_tokens=args.max_tokens)
        rows["transformers in-process + peft (fp32)"] = arm(hf, bench, ids, args.max_steps)
    table = Table("arm", "episodes/min", "first episode s", "others s / episode", "prompt tok", "completion tok",
                  "passed", title=f"one adapter row, τ²-bench telecom test, {len(ids)} tasks, greedy, 2-core CPU")
    for name, r in rows.items():
        rest = r["episode_s"][1:]
        table.add_row(name, f"{r['episodes_per_min']:.2f}", f"{r['episode_s'][0]:.0f}",
                      f"{sum(rest) / len(rest):.0f}" if rest else "-", str(r["prompt_tokens"]),
                      str(r["completion_tokens"]), f"{r['passed']}/{r['episodes']}")
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
