"""Base rates of `trace-rl eval` folders as one markdown table (docs/examples/toolsandbox, docs/examples/bfcl).

    python benchmarks/base_rates.py runs/rates/toolsandbox-base-0.5b runs/rates/bfcl-turn-qwen2.5-coder-1.5b ...

Per folder: the model, benchmark and split, tasks × trials, how many episodes passed by the benchmark's own
rule (ToolSandbox: similarity 1, BFCL: its checker) with pass@1's 95 % interval, the mean reward with its
task-level bootstrap 95 % interval, the share of episodes at reward >= 0.5 (the graded contrast's side),
how episodes ended, and the wall time. Everything comes from the stored trajectories, recomputed here.
"""
from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.report import summarize


def row(folder: Path) -> str:
    trajs = TrajectoryStore(folder).all()
    if not trajs:
        return f"| {folder.name} | no episodes | | | | | |"
    s = summarize(trajs)
    s = s.get("overall") or next(iter(s.values()))
    per_task: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        per_task[t.task_id].append(t.reward)
    trials = max(len(v) for v in per_task.values())
    lo, hi = s["ci95"]
    rlo, rhi = s["reward_ci95"]
    half = sum(t.reward >= 0.5 for t in trajs)
    ends = ", ".join(f"{k} {v}" for k, v in Counter(t.termination for t in trajs).most_common())
    wall = sum(t.seconds for t in trajs)
    return (f"| {trajs[0].model} | {trajs[0].benchmark} [{trajs[0].split}] | {len(per_task)} × {trials} | "
            f"{s['passed']}/{len(trajs)} ({100 * s['pass@1']:.1f} %, {100 * lo:.0f}–{100 * hi:.0f} %) | "
            f"{s['mean_reward']:.3f} ({rlo:.3f}–{rhi:.3f}) | {half}/{len(trajs)} | {ends} | {wall:.0f} |")


def main(folders: list[str]) -> None:
    print("| model | benchmark [split] | tasks × trials | passed (pass@1, 95 % CI) | mean reward (95 % CI) "
          "| reward ≥ 0.5 | ended | episode s (sum) |")
    print("|---|---|---|---|---|---|---|---|")
    for f in folders:
        print(row(Path(f)))


if __name__ == "__main__":
    main(sys.argv[1:])
