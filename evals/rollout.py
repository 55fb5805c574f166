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
    """trajectories.jsonl + index.json. Readers never change the store: a bad line is skipped,
    kept verbatim (with its line number) in quarantine.jsonl next to it and reported once; a
    torn tail (a killed writer's last, unterminated line) is moved to quarantine only by the
    writer, when it next appends; the writer rewrites index.json after every append, from
    what it loaded plus what it added, so the index lists exactly the readable episodes."""

    def __init__(self, directory: str | Path, log: Callable[[str], None] | None = None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "trajectories.jsonl"
        self.index_path = self.dir / "index.json"
        self.quarantine_path = self.dir / "quarantine.jsonl"
        self._lock = threading.Lock()
        self._items: dict[str, Trajectory] = {}
        self._torn = 0  # bytes of a torn last line, repaired at the next append
        self._unterminated = 0  # the last line is a whole episode without its newline
        self._log = log or (lambda msg: print(msg, file=__import__("sys").stderr))
        self._load()

    def _quarantined(self) -> set[tuple[int, str]]:
        if not self.quarantine_path.is_file():
            return set()
        out = set()
        for line in self.quarantine_path.read_text(errors="replace").splitlines():
            try:
                q = json.loads(line)
                out.add((q["line"], q["text"]))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def _quarantine(self, entries: list[dict]) -> None:
        with open(self.quarantine_path, "a") as f:
            for e in entries:
                f.write(json.dumps(e) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline; else a torn (or unterminated) last line
        self._torn = self._unterminated = 0
        if tail:
            try:
                t = Trajectory.from_dict(json.loads(tail))
                self._items[t.key] = t
                self._unterminated = 1  # a whole episode, only its newline missing: kept, terminated at append
            except Exception:
                self._torn = len(tail)
        bad = []
        for n, raw in enumerate(lines, 1):
            try:
                t = Trajectory.from_dict(json.loads(raw))
            except Exception:  # any line that is not a trajectory: skipped and kept aside, never dropped
                bad.append({"line": n, "text": raw.decode(errors="replace"), "store": self.path.name})
                continue
            self._items[t.key] = t
        seen = self._quarantined()
        new = [b for b in bad if (b["line"], b["text"]) not in seen]
        if new:
            try:
                self._quarantine(new)
            except OSError:  # a read-only run directory: report, keep nothing
                pass
            self._log(f"{self.path}: {len(new)} unreadable line(s) skipped (lines "
                      f"{', '.join(str(b['line']) for b in new[:10])}), kept in {self.quarantine_path.name}")


    def _write_index(self) -> None:
        atomic_write_json(self.index_path, {
            "count": len(self._items), "passed": sum(t.passed for t in self._items.values()),
            "episodes": {k: {"passed": t.passed, "reward": t.reward, "termination": t.termination}
                         for k, t in self._items.items()}})

    def _repair_torn_tail(self) -> None:
        """Writer only: move an unterminated last line to quarantine, then cut it off the store."""
        size = self.path.stat().st_size
        with open(self.path, "r+b") as f:
            f.seek(size - self._torn)
            torn = f.read()
            self._quarantine([{"line": "torn-tail", "text": torn.decode(errors="replace"), "store": self.path.name}])
            f.truncate(size - self._torn)
        self._log(f"{self.path}: a torn last line ({self._torn} bytes) moved to {self.quarantine_path.name}")
        self._torn = 0

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
            if self._torn:
                self._repair_torn_tail()
            with open(self.path, "ab") as f:
                if self._unterminated:
                    f.write(b"\n")
                    self._unterminated = 0
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self._items[traj.key] = traj
            self._write_index()


def rollout(benchmark: Benchmark, policy: Policy | Callable[[], Policy], task_ids: Iterable[str],
            store: TrajectoryStore, trials: int = 1, concurrency: int = 2, split: str = "",
            progress: bool = True, passed_threshold: float | None = None, **chat_kw) -> list[Trajectory]:
    """Run every (task, trial) not already in `store`; returns all trajectories for them.
    `passed_threshold`: an episode passes when its reward reaches it (continuous scores)."""
    jobs = [(tid, k) for tid in task_ids for k in range(trials)]
    todo = [(tid, k) for tid, k in jobs if f"{benchmark.name}/{tid}/{k}" not in store]
    get_policy = policy if callable(policy) and not hasattr(policy, "chat") else (lambda: policy)

    def one(tid: str, k: int) -> Trajectory:
        traj = run_episode(get_policy(), benchmark.episode(tid), task_id=tid, benchmark=benchmark.name,
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
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            futures = [pool.submit(one, tid, k) for tid, k in todo]
            for fut in as_completed(futures):
                traj = fut.result()
                bar.update(task, advance=1, passed=bar.tasks[0].fields["passed"] + int(traj.passed))
    return [store.get(f"{benchmark.name}/{tid}/{k}") for tid, k in jobs]
