"""Benchmarks that live in another Python: the framework runs the worker and speaks to it.

Many benchmarks pin packages trace-rl cannot share (an older pydantic, openai, transformers).
Subclass `WorkerBenchmark`, set `name` and `worker_target` (the worker-side class, as
`file.py:Class` next to your subclass's file or `package.module:Class` importable in that
Python; see `worker_main.py` for what it implements), and pass the other venv's interpreter as
the `python` option (`--bench-opt python=/path/to/venv/bin/python`). trace-rl then starts
the worker, speaks JSON lines to it (one request at a time, so the rollout engine's threads
are safe), and restarts it after a crash; an episode that was open in the crashed worker
fails as an `env_error` episode, the next one gets a fresh worker.
"""
from __future__ import annotations

import inspect
import json
import subprocess
import threading
from importlib import resources
from pathlib import Path

from pydantic import Field

from trace_rl.evals.benchmark import Benchmark, BenchmarkError, BenchmarkOptions, Episode, Observation, Score, Task


class WorkerError(BenchmarkError):
    """The worker crashed, hung or answered garbage; `kind` is crashed | timeout | protocol | error."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


class WorkerOptions(BenchmarkOptions):
    python: str = Field(description="the interpreter of the benchmark's own venv, e.g. /opt/tsb/venv/bin/python")
    call_timeout_s: float = Field(120.0, gt=0, description="longest a single worker call may take")
    max_restarts: int = Field(5, ge=0, description="worker restarts before the benchmark gives up")


class Worker:
    """One worker process; `call` is serialised by a lock and raises WorkerError on any failure."""

    def __init__(self, python: str, target: str, timeout: float):
        self.timeout = timeout
        script = str(resources.files("trace_rl.evals") / "worker_main.py")
        try:
            self.proc = subprocess.Popen([python, script, target], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, bufsize=1)
        except OSError as err:
            raise BenchmarkError(f"cannot start the benchmark worker with python={python!r}: {err}") from None
        self.lock = threading.Lock()
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self._ids = 0
        try:
            ready = self._read(0, "start")
            if ready != "ready":
                raise WorkerError("protocol", f"the worker did not start: {ready!r}")
        except BaseException:
            self.kill()
            raise

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr = (self.stderr + [line])[-50:]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self, rid: int, op: str):
        result: dict = {}

        def read():
            result["line"] = self.proc.stdout.readline()

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            self.kill()
            raise WorkerError("timeout", f"no answer to {op} within {self.timeout}s")
        line = result.get("line", "")
        if not line:
            self.proc.wait(timeout=10)
            raise WorkerError("crashed", f"the worker exited ({self.proc.returncode}) during {op}: "
                                         + "".join(self.stderr[-5:])[-1500:])
        try:
            reply = json.loads(line)
            ok = reply["ok"]
        except (ValueError, KeyError, TypeError):
            self.kill()
            raise WorkerError("protocol", f"garbage from the worker: {line[:200]!r}") from None
        if reply.get("id") != rid or not isinstance(ok, bool):
            self.kill()
            raise WorkerError("protocol", f"reply {str(reply)[:200]} does not answer request {rid}")
        if not ok:
            raise WorkerError("error", f"{reply.get('error')}: {reply.get('message')}")
        return reply.get("result")

    def call(self, op: str, *args):
        with self.lock:
            if not self.alive:
                raise WorkerError("crashed", f"the worker is not running ({op})")
            self._ids += 1
            try:
                self.proc.stdin.write(json.dumps({"id": self._ids, "op": op, "args": list(args)}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                raise WorkerError("crashed", f"the worker is gone ({op})") from None
            return self._read(self._ids, op)

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait(timeout=10)


class WorkerEpisode(Episode):
    def __init__(self, bench: "WorkerBenchmark", task_id: str):
        self.bench, self.task_id = bench, task_id
        self.system_prompt, self.tools, self.worker, self.eid = "", [], None, None

    def _call(self, op: str, *args):
        if self.worker is not self.bench.worker:  # restarted since this episode opened
            raise WorkerError("crashed", "the worker restarted during this episode")
        return self.worker.call(op, self.eid, *args)

    def reset(self) -> Observation:
        self.worker = self.bench.live_worker()
        self.eid = self.worker.call("open", self.task_id)
        obs = self._call("reset")
        self.system_prompt, self.tools = obs.get("system_prompt", ""), obs.get("tools", [])
        self.max_steps = int(obs.get("max_steps") or self.max_steps)
        return Observation(obs.get("messages", []), bool(obs.get("done")), obs.get("reason"))

    def step(self, content: str, tool_calls: list[dict]) -> Observation:
        out = self._call("step", content, tool_calls)
        return Observation(out.get("messages", []), bool(out.get("done")), out.get("reason"))

    def score(self, termination: str) -> Score:
        r = self._call("score", termination)
        return Score(float(r["reward"]), bool(r["passed"]), dict(r.get("reasons") or {}))

    def close(self) -> None:
        if self.worker is not None and self.worker is self.bench.worker and self.worker.alive:
            try:
                self.worker.call("close", self.eid)
            except WorkerError:
                pass


class WorkerBenchmark(Benchmark):
    """Subclass with `name` and `worker_target`; see the module docstring."""
    worker_target: str = ""  # e.g. "my_bench_side.py:MyBench" (next to the subclass's file) or "pkg.mod:MyBench"
    Options = WorkerOptions

    def __init__(self, python: str, call_timeout_s: float = 120.0, max_restarts: int = 5):
        if not self.worker_target:
            raise BenchmarkError(f"{type(self).__name__}: set worker_target = 'side.py:Class'")
        where, _, attr = self.worker_target.rpartition(":")
        if where.endswith(".py") and not Path(where).is_absolute():
            where = str(Path(inspect.getfile(type(self))).parent / where)
        self.target, self.python = f"{where}:{attr}", python
        self.timeout, self.max_restarts, self.restarts = call_timeout_s, max_restarts, 0
        self._lock = threading.Lock()
        self.worker: Worker | None = None
        self._splits: list[str] | None = None
        self._tasks: dict[str, list[Task]] = {}

    def live_worker(self) -> Worker:
        """The running worker, started or restarted as needed."""
        with self._lock:
            if self.worker is not None and self.worker.alive:
                return self.worker
            if self.worker is not None:
                if self.restarts >= self.max_restarts:
                    raise WorkerError("crashed", f"the worker crashed {self.restarts + 1} times; giving up")
                self.restarts += 1
            self.worker = Worker(self.python, self.target, self.timeout)
            return self.worker

    def splits(self) -> list[str]:
        if self._splits is None:
            self._splits = list(self.live_worker().call("splits"))
        return self._splits

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            if split not in self.splits():
                raise BenchmarkError(f"{self.name} has no split {split!r}; choose one of {', '.join(self.splits())}")
            self._tasks[split] = [Task(str(t["id"]), self.name, split, t.get("description", ""))
                                  for t in self.live_worker().call("tasks", split)]
        return self._tasks[split]

    def episode(self, task_id: str) -> WorkerEpisode:
        return WorkerEpisode(self, task_id)

    def spec(self) -> dict:
        got = self.live_worker().call("spec")
        return got if got else super().spec()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()
