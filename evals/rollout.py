"""Rollout engine: N tasks x k trials, bounded concurrency, resumable trajectory store.

The store is one JSONL file of finished trajectories (one line = one episode, written
with a single append + fsync, so a killed run leaves at most a torn last line, which
is dropped on load) and an index.json rewritten atomically after each episode.
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Iterable

from trace_rl.agents.base_agent import Policy, Trajectory, run_episode
from trace_rl.evals.benchmark import Benchmark


def atomic_write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


class TrajectoryStore:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "trajectories.jsonl"
        self.index_path = self.dir / "index.json"
        self._lock = threading.Lock()
        self._items: dict[str, Trajectory] = {}
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        good = 0
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    t = Trajectory.from_dict(json.loads(line))
                except (ValueError, TypeError):
                    break  # a torn tail from a killed run: everything after is dropped
                self._items[t.key] = t
                good += len(line)
        if good != self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Trajectory:
        return self._items[key]

    def all(self) -> list[Trajectory]:
        return list(self._items.values())

    def add(self, traj: Trajectory) -> None:
        line = (json.dumps(traj.to_dict(), default=str) + "\n").encode()
        with self._lock:
            if traj.key in self._items:
                return
            with open(self.path, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self._items[traj.key] = traj
            atomic_write_json(self.index_path, {
                "count": len(self._items), "passed": sum(t.passed for t in self._items.values()),
                "episodes": {k: {"passed": t.passed, "reward": t.reward, "termination": t.termination}
                             for k, t in self._items.items()}})


def rollout(benchmark: Benchmark, policy: Policy | Callable[[], Policy], task_ids: Iterable[str],
            store: TrajectoryStore, trials: int = 1, concurrency: int = 2, split: str = "",
            progress: bool = True, **chat_kw) -> list[Trajectory]:
    """Run every (task, trial) not already in `store`; returns all trajectories for them."""
    jobs = [(tid, k) for tid in task_ids for k in range(trials)]
    todo = [(tid, k) for tid, k in jobs if f"{benchmark.name}/{tid}/{k}" not in store]
    get_policy = policy if callable(policy) and not hasattr(policy, "chat") else (lambda: policy)

    def one(tid: str, k: int) -> Trajectory:
        traj = run_episode(get_policy(), benchmark.episode(tid), task_id=tid, benchmark=benchmark.name,
                           trial=k, split=split, **chat_kw)
        store.add(traj)
        return traj

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold]rollout[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("pass {task.fields[passed]}"), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task(benchmark.name, total=len(jobs), completed=len(jobs) - len(todo),
                            passed=sum(store.get(f"{benchmark.name}/{t}/{k}").passed
                                       for t, k in jobs if f"{benchmark.name}/{t}/{k}" in store))
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            futures = [pool.submit(one, tid, k) for tid, k in todo]
            for fut in as_completed(futures):
                traj = fut.result()
                bar.update(task, advance=1, passed=bar.tasks[0].fields["passed"] + int(traj.passed))
    return [store.get(f"{benchmark.name}/{tid}/{k}") for tid, k in jobs]
