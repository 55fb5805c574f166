"""Rollout engine: N tasks x k trials, bounded concurrency, resumable through the trajectory store."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Iterable

from trace_rl.agents.base_agent import Policy, run_episode
from trace_rl.core.trajectory import Trajectory, TrajectoryStore
from trace_rl.evals.benchmark import Benchmark


def rollout(benchmark: Benchmark, policy: Policy, task_ids: Iterable[str],
            store: TrajectoryStore, trials: int = 1, concurrency: int = 2, split: str = "",
            progress: bool = True, passed_threshold: float | None = None, **chat_kw) -> list[Trajectory]:
    """Run every (task, trial) not already in `store`; returns all trajectories for them.
    `passed_threshold`: an episode passes when its reward reaches it (continuous scores)."""
    jobs = [(tid, k) for tid in task_ids for k in range(trials)]
    todo = [(tid, k) for tid, k in jobs if f"{benchmark.name}/{tid}/{k}" not in store]

    def one(tid: str, k: int) -> Trajectory:
        traj = run_episode(policy, lambda: benchmark.episode(tid), task_id=tid, benchmark=benchmark.name,
                           trial=k, split=split, **chat_kw)
        if passed_threshold is not None:
            traj.passed = traj.reward >= passed_threshold - 1e-9
        store.add(traj)
        return traj

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold]rollout[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("pass {task.fields[passed]}"), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task(benchmark.name, total=len(jobs), completed=len(jobs) - len(todo),
                            passed=sum(store.get(f"{benchmark.name}/{t}/{k}").passed
                                       for t, k in jobs if f"{benchmark.name}/{t}/{k}" in store))
        pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
        try:
            for fut in as_completed([pool.submit(one, tid, k) for tid, k in todo]):
                bar.update(task, advance=1, passed=bar.tasks[0].fields["passed"] + int(fut.result().passed))
        except KeyboardInterrupt:  # stopped: start nothing more, do not wait for the episodes in flight
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    return [store.get(f"{benchmark.name}/{tid}/{k}") for tid, k in jobs]
