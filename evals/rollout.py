"""Rollout engine: N tasks x k trials, bounded concurrency, resumable through the trajectory store."""
from __future__ import annotations

import json
import sys
from contextlib import closing
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Iterable

from trace_rl.agents.base_agent import Policy, run_episode
from trace_rl.core.io import fingerprint
from trace_rl.core.trajectory import SettingsMismatch, Trajectory, TrajectoryStore, settings_change
from trace_rl.evals.benchmark import Benchmark, BenchmarkError, benchmark_version
from trace_rl.evals.executor import EXECUTORS, INFRA_ERROR, ray_episodes
from trace_rl.models.llm import LLM, LLMConfig, result_settings


def episode_settings(bench: Benchmark, benchmark: str, agent: LLMConfig | str, *, max_steps: int | None,
                     options: dict | None = None, user: LLMConfig | None = None,
                     passed_threshold: float | None = None) -> dict:
    """Everything that changes an episode's result, as each stored episode records it: the benchmark (its spec,
    version, options, and the prompt and tools it shows), the agent's model (its weights' hash where cheap) and
    sampling, the user simulator's, the step limit (None: the episode's own) and the pass mark. An episode is
    reused only where all of these match (`rollout`)."""
    try:
        spec = bench.spec()
        prompt = fingerprint([spec.get("system_prompt"), spec.get("tools")])[:12]
    except BenchmarkError:
        raise
    except Exception as err:  # a plugin whose spec() fails still runs; its prompt is then not compared
        prompt = f"unread ({type(err).__name__})"
    plain = lambda v: result_settings(v) if isinstance(v, LLMConfig) else v  # noqa: E731
    out = {"benchmark": benchmark, "benchmark_version": benchmark_version(bench), "prompt": prompt,
           "options": {k: plain(v) for k, v in (options or {}).items()}, "agent": plain(agent), "user": plain(user),
           "max_steps": max_steps, "passed_threshold": passed_threshold}
    return json.loads(json.dumps(out, default=str, sort_keys=True))  # as a stored episode reads them back


def rollout(benchmark: Benchmark, policy: Policy, task_ids: Iterable[str],
            store: TrajectoryStore, trials: int = 1, concurrency: int = 2, split: str = "",
            progress: bool = True, passed_threshold: float | None = None, settings: dict | None = None,
            strict: bool = True, executor: str = "local", ray_address: str | None = None, ray_retries: int = 3,
            **chat_kw) -> list[Trajectory]:
    """Run every (task, trial) not already in `store` (nor stored as an infra_error); returns all trajectories.
    `passed_threshold`: an episode passes when its reward reaches it (continuous scores).
    `settings` (episode_settings): each new episode records them, and a stored one is reused only when its own
    are the same; one made under others is a SettingsMismatch naming the first difference (`strict`), or is
    played again and replaces it (not strict: the pipeline). Without `settings`, a stored key is reused.
    `executor`: local (`concurrency` threads here) or ray (evals/executor.py: Ray tasks on the cluster at
    `ray_address` or $RAY_ADDRESS, its `sandbox` resources bounding how many run at once; a lost node's episodes
    are retried `ray_retries` times). A policy that is not an endpoint client (weights in this process) plays here."""
    jobs = [(tid, k) for tid in task_ids for k in range(trials)]
    key = lambda tid, k: f"{benchmark.name}/{tid}/{k}"  # noqa: E731
    stale = {key(t, k): None for t, k in jobs
             if settings is not None and key(t, k) in store and store.get(key(t, k)).settings != settings}
    if stale and strict:
        raise SettingsMismatch(f"{store.dir} holds {len(stale)} episode(s) made under other settings "
                               f"({settings_change(store.get(next(iter(stale))).settings, settings)}); start over with "
                               "--fresh, or use another output folder")
    lost = lambda t, k: store.get(key(t, k)).termination == INFRA_ERROR  # noqa: E731  (played again)
    todo = [(t, k) for t, k in jobs if key(t, k) not in store or key(t, k) in stale or lost(t, k)]
    done = set(jobs) - set(todo)

    def record(traj: Trajectory) -> Trajectory:
        if passed_threshold is not None:
            traj.passed = traj.reward >= passed_threshold - 1e-9
        traj.settings = settings or {}
        store.add(traj, replace=True)
        return traj

    def one(tid: str, k: int) -> Trajectory:
        return record(run_episode(policy, lambda: benchmark.episode(tid), task_id=tid, benchmark=benchmark.name,
                                  trial=k, split=split, **chat_kw))

    if executor not in EXECUTORS:
        raise ValueError(f"executor {executor!r}: use one of {', '.join(EXECUTORS)}")
    if executor == "ray" and not isinstance(policy, LLM):
        print(f"rollout: {policy.name} decodes in this process: its episodes play here, not on the Ray cluster",
              file=sys.stderr)
        executor = "local"

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold]rollout[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("pass {task.fields[passed]}"), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task(benchmark.name, total=len(jobs), completed=len(jobs) - len(todo),
                            passed=sum(store.get(key(t, k)).passed for t, k in done))
        advance = lambda traj: bar.update(task, advance=1, passed=bar.tasks[0].fields["passed"] + int(traj.passed))  # noqa: E731
        if executor == "ray" and todo:  # stopped (KeyboardInterrupt, an error): its episodes in flight are cancelled
            with closing(ray_episodes(benchmark, policy, todo, split=split, address=ray_address, retries=ray_retries,
                                      **chat_kw)) as played:
                for traj in played:
                    advance(record(traj))
        else:
            pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
            try:
                for fut in as_completed([pool.submit(one, tid, k) for tid, k in todo]):
                    advance(fut.result())
            except KeyboardInterrupt:  # stopped: start nothing more, do not wait for the episodes in flight
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            pool.shutdown()
    return [store.get(key(tid, k)) for tid, k in jobs]
