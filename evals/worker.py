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
import math
import os
import signal
import subprocess
import threading
from contextlib import suppress
from importlib import resources
from pathlib import Path

from pydantic import Field

from trace_rl.evals.benchmark import Benchmark, BenchmarkError, BenchmarkOptions, Episode, Observation, Score, Task
from trace_rl.sandbox.session import JsonLinesProcess, SandboxError, SessionLimits, contained


class WorkerError(BenchmarkError):
    """The worker crashed, hung or answered garbage; `kind` is crashed | timeout | protocol | error."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


class WorkerOptions(BenchmarkOptions):
    python: str = Field(description="the interpreter of the benchmark's own venv, e.g. /opt/tsb/venv/bin/python")
    call_timeout_s: float = Field(120.0, gt=0, description="longest a single worker call may take")
    max_restarts: int = Field(5, ge=0, description="worker restarts before the benchmark gives up")


class Worker(JsonLinesProcess):
    """One worker process behind the sandbox's JSON-lines client (reply ids, call timeouts, the
    stderr tail); `call` is serialised by a lock and raises WorkerError on any failure."""

    what = "the worker"
    KINDS = {"env_error": "error", "timeout": "timeout", "protocol": "protocol", "output_limit": "protocol"}

    def __init__(self, python: str, target: str, timeout: float):
        self.cmd = [python, str(resources.files("trace_rl.evals") / "worker_main.py"), target]
        self.lock = threading.Lock()
        try:  # no episode clock, and no cap that a benchmark's replies or logs could reach
            super().__init__(SessionLimits(call_timeout_s=timeout, episode_timeout_s=math.inf,
                                           max_reply_bytes=1 << 40, max_stderr_bytes=1 << 62))
        except OSError as err:
            raise BenchmarkError(f"cannot start the benchmark worker with python={python!r}: {err}") from None

    def _spawn(self) -> subprocess.Popen:
        # in a PID namespace of its own: a daemon the benchmark forks (setsid or not) ends with the worker
        return subprocess.Popen(contained(self.cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, bufsize=0, start_new_session=True)

    def _kill(self) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the namespace's holder, so everything in it
        super()._kill()

    def close(self) -> None:
        super().close()
        self._kill()  # also after a clean exit: what it forked may live on

    def call(self, op: str, *args):
        with self.lock:
            try:
                return self.request({"op": op, "args": list(args)})
            except SandboxError as err:
                kind = self.KINDS.get(err.kind, "crashed")
                tail = f" during {op}" + (f": {err.stderr[-1500:]}" if err.stderr else "") if kind == "crashed" else ""
                raise WorkerError(kind, err.message + tail) from None


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
        self.text_tool_calls = obs.get("text_tool_calls", True)  # checked at the boundary (Guarded)
        return Observation(obs.get("messages", []), bool(obs.get("done")), obs.get("reason"))

    def step(self, content: str, tool_calls: list[dict]) -> Observation:
        out = self._call("step", content, tool_calls)
        return Observation(out.get("messages", []), bool(out.get("done")), out.get("reason"))

    def score(self, termination: str) -> Score:
        r = self._call("score", termination)
        return Score(float(r["reward"]), bool(r["passed"]), dict(r.get("reasons") or {}))

    def close(self) -> None:
        if self.worker is not None and self.worker is self.bench.worker and self.worker.alive:
            with suppress(WorkerError):
                self.worker.call("close", self.eid)


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
        self._worker_spec: dict | None = None

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
            self._check_split(split)
            self._tasks[split] = [Task(str(t["id"]), self.name, split, t.get("description", ""))
                                  for t in self.live_worker().call("tasks", split)]
        return self._tasks[split]

    def episode(self, task_id: str, hinted: bool = False) -> WorkerEpisode:
        return WorkerEpisode(self, task_id)  # a worker benchmark has no hints

    def worker_spec(self) -> dict | None:
        """The worker side's spec(), asked once."""
        if self._worker_spec is None:
            self._worker_spec = self.live_worker().call("spec")
        return self._worker_spec

    def spec(self) -> dict:
        return self.worker_spec() or super().spec()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
