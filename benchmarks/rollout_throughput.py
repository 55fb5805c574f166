"""Rollout throughput of the base agent: llama.cpp server vs in-process transformers,
side by side on the same tasks (the reference synthetic env's seeds, so prompts are short
enough for CPU transformers), printing episodes/min and decode tokens/s.
    .venv/bin/python benchmarks/rollout_throughput.py [--model qwen2.5-coder-0.5b] [--episodes 6]
"""
import argparse
import time
from importlib import resources

from rich.console import Console
from rich.table import Table

from trace_rl.agents.base_agent import run_episode
from trace_rl.models.llm import LLM
from trace_rl.evals.synthetic import SyntheticBenchmark
from trace_rl.models.hf_policy import HFPolicy


def measure(policy, bench, n: int, max_steps: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    trajs = [run_episode(policy, bench.episode(str(s)), task_id=str(s), benchmark=bench.name, max_steps=max_steps,
                         max_tokens=max_tokens) for s in range(n)]
    wall = time.perf_counter() - t0
    gen_s = policy.usage.seconds
    return {"episodes_per_min": 60 * n / wall, "gen_tok_s": policy.usage.completion_tokens / gen_s if gen_s else 0,
            "prompt_tokens": policy.usage.prompt_tokens, "completion_tokens": policy.usage.completion_tokens,
            "mean_reward": sum(t.reward for t in trajs) / n, "wall_s": wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--episodes", type=int, default=6)
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    code = (resources.files("trace_rl.sandbox") / "envs" / "precondition_verification_airline.py").read_text()
    rows = {}
    with SyntheticBenchmark(code, seeds=range(args.episodes), pool_size=1) as bench:
        llm = LLM(model=args.model, max_tokens=args.max_tokens)
        llm.chat([{"role": "user", "content": "hi"}], max_tokens=1)  # start the server outside the timing
        llm.usage.__init__()
        rows["llama.cpp (server)"] = measure(llm, bench, args.episodes, args.max_steps, args.max_tokens)
        rows["transformers (in-process, fp32)"] = measure(HFPolicy.load(args.model, max_new_tokens=args.max_tokens),
                                                          bench, args.episodes, args.max_steps, args.max_tokens)
    table = Table("backend", "episodes/min", "generated tok/s (model time)", "prompt tok", "completion tok", "mean reward",
                  title=f"{args.model}: {args.episodes} episodes, <= {args.max_steps} turns, <= {args.max_tokens} tokens a turn")
    for name, r in rows.items():
        table.add_row(name, f"{r['episodes_per_min']:.2f}", f"{r['gen_tok_s']:.1f}", str(r["prompt_tokens"]),
                      str(r["completion_tokens"]), f"{r['mean_reward']:.2f}")
    Console().print(table)
    a, b = rows.values()
    Console().print(f"llama.cpp / transformers episode throughput: {a['episodes_per_min'] / b['episodes_per_min']:.1f}x")


if __name__ == "__main__":
    main()
