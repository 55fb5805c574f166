"""The evaluate stage: every policy on the same tasks and trials; rows that cannot be a result
of their own are listed with the reason instead of being measured."""
from __future__ import annotations

from pathlib import Path

from trace_rl.core.episode import STEP_TIMEOUT_S
from trace_rl.core.io import atomic_write_json
from trace_rl.core.records import Capability
from trace_rl.core.rundir import EvalDir
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.benchmark import Benchmark
from trace_rl.evals.facts import transfer_metrics
from trace_rl.evals.report import plot_pass_rates, summarize
from trace_rl.evals.rollout import rollout


def backend(policy) -> str:
    """What produced a row's answers: llama.cpp, vllm, engine (this project's: its server under serve=hf, or
    in-process, as the router and the moe always are) or endpoint (a base_url of the user's)."""
    return getattr(policy, "backend", "engine")


def evaluate(bench: Benchmark, policies: dict, task_ids: list[str], out_dir: str | Path, *, split: str,
             trials: int = 1, skipped: dict[str, str] | None = None, mode_tasks: dict[str, int] | None = None,
             passed_threshold: float | None = None, concurrency: int = 1,
             capabilities: list[Capability] | None = None, step_timeout_s: float = STEP_TIMEOUT_S,
             max_steps: int | None = None, **executor) -> dict:
    """{mode: figures | {"skipped": why}}; writes out_dir/<mode>/ stores, report.json and report.png.
    `mode_tasks` gives some modes fewer tasks (slow in-process decoding); each row states its count.
    `capabilities`: each mode's figures get "transfer", the code-measured rate
    of the failure each capability is about (evals/facts.py), a result even when no task passes.
    Each row says which `backend` produced it.
    `executor`: where rollout() plays the episodes (executor, ray_address, ray_retries: evals/executor.py)."""
    out, results, series = EvalDir(out_dir), {}, {}
    for mode, policy in policies.items():
        n = (mode_tasks or {}).get(mode)
        trajs = rollout(bench, policy, task_ids[:n] if n else task_ids, TrajectoryStore(out.mode(mode)), trials=trials,
                        split=split, passed_threshold=passed_threshold, concurrency=concurrency,
                        step_timeout_s=step_timeout_s, max_steps=max_steps, **executor)
        series[mode] = summarize(trajs)
        results[mode] = {**next(iter(series[mode].values())), "trials": trials, "model": policy.name,
                         "backend": backend(policy)}
        if capabilities:
            results[mode]["transfer"] = transfer_metrics(trajs, capabilities, bench.spec()["tools"])
    results.update({m: {"skipped": why} for m, why in (skipped or {}).items()})
    plot_pass_rates(series, out.plot, f"{bench.name} [{split}]: base vs composed")
    atomic_write_json(out.report, {"benchmark": bench.name, "split": split, "tasks": task_ids,
                                   "trials": trials, "modes": results})
    return results
