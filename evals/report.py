"""Evaluation reports: pass@1 and pass^k with confidence intervals, JSON + PNG."""
from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from pathlib import Path

from trace_rl.core.trajectory import Trajectory
from trace_rl.core.figures import save_figure, subplots
from trace_rl.core.io import atomic_write_json


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval: sensible at 0/n and n/n, unlike the normal approximation."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_ci(per_task: dict[str, list[float]], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean reward (a graded benchmark's similarity) by a bootstrap over tasks: a task's
    trials are resampled together, since they are not independent of one another. Fixed seed: reproducible."""
    tasks = [r for r in per_task.values() if r]
    if not tasks:
        return (0.0, 0.0)
    rng, means = random.Random(seed), []
    for _ in range(draws):
        picked = [tasks[rng.randrange(len(tasks))] for _ in tasks]
        means.append(sum(map(sum, picked)) / sum(map(len, picked)))
    means.sort()
    return (means[int(0.025 * draws)], means[min(draws - 1, int(0.975 * draws))])


def pass_hat_k(per_task: dict[str, list[bool]], k: int) -> float:
    """τ-bench's pass^k: mean over tasks of C(c, k) / C(n, k) (all k of k trials pass)."""
    vals = [math.comb(sum(r), k) / math.comb(len(r), k) for r in per_task.values() if len(r) >= k]
    return sum(vals) / len(vals) if vals else float("nan")


def summarize(trajs: list[Trajectory]) -> dict:
    """Figures per (benchmark, split) group and overall."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[f"{t.benchmark}[{t.split or '-'}]"].append(t)
    out = {}
    for name, items in sorted(groups.items()) + ([("overall", trajs)] if len(groups) > 1 else []):
        per_task: dict[str, list[bool]] = defaultdict(list)
        rewards: dict[str, list[float]] = defaultdict(list)
        for t in sorted(items, key=lambda t: t.trial):
            per_task[f"{t.benchmark}/{t.task_id}"].append(t.passed)
            rewards[f"{t.benchmark}/{t.task_id}"].append(t.reward)
        n, s = len(items), sum(t.passed for t in items)
        max_k = min(len(r) for r in per_task.values()) if per_task else 0
        out[name] = {
            "episodes": n, "tasks": len(per_task), "passed": s,
            "pass@1": s / n if n else 0.0, "ci95": wilson(s, n),
            "pass^k": {k: pass_hat_k(per_task, k) for k in range(1, max_k + 1)},
            "mean_reward": sum(t.reward for t in items) / n if n else 0.0, "reward_ci95": mean_ci(rewards),
            "terminations": dict(Counter(t.termination for t in items)),
            "mean_steps": sum(t.steps for t in items) / n if n else 0.0,
            "tokens": sum(t.prompt_tokens + t.completion_tokens for t in items),
            "seconds": sum(t.seconds for t in items),
        }
    return out


def write_report(trajs: list[Trajectory], out_dir: str | Path, title: str = "evaluation",
                 extra: dict | None = None) -> dict:
    """report.json and report.png (pass@1 with 95% CI per group) in out_dir."""
    out_dir = Path(out_dir)
    figures = summarize(trajs)
    report = {"title": title, "models": sorted({t.model for t in trajs}), "groups": figures, **(extra or {})}
    atomic_write_json(out_dir / "report.json", report)
    plot_pass_rates({title: figures}, out_dir / "report.png", title)
    return report


def plot_pass_rates(series: dict[str, dict], path: Path, title: str) -> None:
    """Grouped bars: one bar per (series, group), error bars = Wilson 95% CI."""
    groups = sorted({g for figs in series.values() for g in figs})
    width = 0.8 / max(1, len(series))
    fig, ax = subplots(figsize=(max(5, 1.6 * len(groups) * max(1, len(series)) ** 0.5), 3.6))
    for i, (label, figs) in enumerate(series.items()):
        present = [g for g in groups if g in figs]
        xs = [j + i * width for j, g in enumerate(groups) if g in figs]
        ps = [figs[g]["pass@1"] * 100 for g in present]
        lo = [max(0.0, p - figs[g]["ci95"][0] * 100) for p, g in zip(ps, present)]  # rounding: never below 0
        hi = [max(0.0, figs[g]["ci95"][1] * 100 - p) for p, g in zip(ps, present)]
        bars = ax.bar(xs, ps, width, yerr=[lo, hi], capsize=3, label=label)
        for b, g in zip(bars, present):
            ax.annotate(f"{figs[g]['passed']}/{figs[g]['episodes']}", (b.get_x() + b.get_width() / 2, 1),
                        ha="center", fontsize=8, color="white" if b.get_height() > 8 else "black")
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], groups, fontsize=8)
    ax.set_ylabel("pass@1 (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)
    save_figure(fig, path)
