"""BFCL multi-turn (the Berkeley Function-Calling Leaderboard's `bfcl-eval`, Apache-2.0) built in.

`--benchmark bfcl` (all four categories) or `bfcl:<category>` (base, miss_func, miss_param,
long_context). Played on BFCL's own backend classes and scored by BFCL's own multi-turn checker
in bfcl-eval's own venv (`trace-rl benchmarks install bfcl`), behind the worker mechanism
(`evals/worker.py`); the worker side is `bfcl_worker.py`, which also says how calls execute.

Options: `mode` task (every user turn of a task) or per_turn (each checked turn is a task, the
turns before it replayed from the ground truth), `category`, and the worker's (`python`,
`call_timeout_s`, `max_restarts`). Splits: the categories, `all`, `train` and `test` (by scenario,
see `bfcl_worker.split_of`). docs/benchmarks.md has the rest.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from trace_rl.evals.benchmark import BenchmarkError, Observation, Task
from trace_rl.evals.venvs import VenvRecipe, ensure_venv
from trace_rl.evals.worker import WorkerBenchmark, WorkerEpisode, WorkerOptions

BFCL_VERSION = "2026.3.23"
CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
# Everything the worker imports besides bfcl-eval and the standard library (its checker, backends and
# loaders): installed with --no-deps, so the venv holds these three pure-Python wheels and nothing else.
WORKER_DEPS = ("mpmath==1.3.0", "filelock==3.20.0")
CHECK = ("import os, shutil, tempfile; root = os.environ['BFCL_PROJECT_ROOT'] = tempfile.mkdtemp(); "
         "import bfcl_eval.utils, bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker, "
         "bfcl_eval.eval_checker.multi_turn_eval.func_source_code.math_api; shutil.rmtree(root)")


def recipe(source: str | None = None) -> VenvRecipe:
    """bfcl-eval with --no-deps plus WORKER_DEPS. `source`: a wheel, a source folder, or a folder of
    wheels holding bfcl-eval and WORKER_DEPS (installed with no package index: a machine offline)."""
    package = f"bfcl-eval=={BFCL_VERSION}"
    if source is None:
        step = ("--no-deps", package, *WORKER_DEPS)
    else:
        where = Path(source).expanduser().resolve()
        if where.is_dir() and not (where / "pyproject.toml").exists() and not (where / "setup.py").exists():
            step = ("--no-deps", "--no-index", "--find-links", str(where), package, *WORKER_DEPS)
        elif where.exists():
            step = ("--no-deps", "--find-links", str(where.parent if where.is_file() else where), str(where),
                    *WORKER_DEPS)
        else:
            raise BenchmarkError(f"bfcl source {source!r} does not exist: give a bfcl-eval wheel, its source "
                                 "folder, or a folder of wheels (or no source: the package registry)")
    return VenvRecipe(name=f"bfcl-{BFCL_VERSION}", steps=(step,), check=CHECK)


def install(source: str | None = None, log=lambda _msg: None) -> Path:
    """bfcl-eval's own venv (idempotent); returns its interpreter. `source` defaults to
    $TRACE_RL_BFCL_SOURCE, then the package registry."""
    return ensure_venv(recipe(source or os.environ.get("TRACE_RL_BFCL_SOURCE") or None), log)


class BfclOptions(WorkerOptions):
    python: str | None = Field(None, description="bfcl-eval's venv interpreter (default: the one "
                                                 "`trace-rl benchmarks install bfcl` made)")
    mode: Literal["task", "per_turn"] = Field("task", description="task: every user turn of a task; per_turn: "
                                              "each checked turn a task, earlier turns replayed from the ground truth")
    category: Literal[CATEGORIES] | None = Field(None, description="only this category (also bfcl:<category>)")


class BfclEpisode(WorkerEpisode):
    """A worker episode whose tools can grow mid-episode (a miss_func turn adds the held-out functions)."""

    def step(self, content: str, tool_calls: list[dict]) -> Observation:
        out = self._call("step", content, tool_calls)
        if "tools" in out:
            self.tools = out["tools"]
        return Observation(out.get("messages", []), bool(out.get("done")), out.get("reason"))


class BfclBenchmark(WorkerBenchmark):
    """See the module docstring."""
    worker_target = "bfcl_worker.py:BfclBench"
    Options = BfclOptions
    fixed_max_steps = "BFCL's own rule is 20 steps with calls per user turn"

    def __init__(self, python: str | None = None, mode: str = "task", category: str | None = None,
                 call_timeout_s: float = 120.0, max_restarts: int = 5):
        if mode not in ("task", "per_turn"):
            raise BenchmarkError(f"bfcl: mode={mode!r}; use task or per_turn")
        if category is not None and category not in CATEGORIES:
            raise BenchmarkError(f"bfcl: unknown category {category!r}; choose one of {', '.join(CATEGORIES)}")
        if python is None:
            python = str(recipe().python)
            if not Path(python).exists():
                raise BenchmarkError("bfcl is not installed: run `trace-rl benchmarks install bfcl` "
                                     "(or give --bench-opt python=/path/to/its/venv/bin/python)")
        super().__init__(python, call_timeout_s=call_timeout_s, max_restarts=max_restarts)
        self.mode, self.category = mode, category
        self.name = "bfcl" + (f":{category}" if category else "")
        self._records: dict[str, dict] = {}  # task id -> {"max_steps", "of": BFCL's id, "upto": its turn or None}

    def splits(self) -> list[str]:
        return [self.category, "all", "train", "test"] if self.category else super().splits()

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            self._check_split(split)
            out = []
            for rec in self.live_worker().call("tasks", split):
                if self.category and rec["category"] != self.category:
                    continue
                if self.mode == "task" and rec["whole"]:
                    out.append(Task(rec["id"], self.name, split, rec["description"]))
                    self._records[rec["id"]] = {"max_steps": rec["max_steps"], "of": rec["id"], "upto": None}
                for turn in rec["turns"] if self.mode == "per_turn" else []:
                    tid = f"{rec['id']}.turn{turn['turn']}"
                    out.append(Task(tid, self.name, split, turn["description"]))
                    self._records[tid] = {"max_steps": turn["max_steps"], "of": rec["id"], "upto": turn["turn"]}
            self._tasks[split] = out
        return self._tasks[split]

    def _record(self, task_id: str) -> dict:
        if task_id not in self._records:
            self.tasks("all")
        if task_id not in self._records:
            raise BenchmarkError(f"{self.name}: unknown task id {task_id!r} (mode={self.mode})")
        return self._records[task_id]

    def episode(self, task_id: str, hinted: bool = False) -> BfclEpisode:
        ep = BfclEpisode(self, task_id)
        ep.max_steps = self._record(task_id)["max_steps"]  # the agent loop reads it before reset
        return ep

    def task_tools(self, task_id: str) -> list[str]:
        """The functions the task offers, held-out ones included (a whole task: by its last turn)."""
        rec = self._record(task_id)
        added = self.worker_spec()["task_functions"][rec["of"]]
        return [name for turn, names in sorted(added.items(), key=lambda kv: int(kv[0]))
                if rec["upto"] is None or int(turn) <= rec["upto"] for name in names]

    def spec(self) -> dict:
        spec = self.worker_spec()
        return {"tools": spec["tools"], "policy": spec["policy"], "system_prompt": spec["system_prompt"],
                "task_tools": {t.id: self.task_tools(t.id) for t in self.tasks("all")}}


def bfcl_benchmark(variant: str = "", **options) -> BfclBenchmark:
    """`bfcl` (every category) or `bfcl:<category>`."""
    if variant and options.get("category") not in (None, variant):
        raise BenchmarkError(f"bfcl:{variant} and category={options['category']} disagree: give one of them")
    return BfclBenchmark(**{**options, "category": variant or options.get("category")})


bfcl_benchmark.Options = BfclOptions  # found by name through evals.benchmark.BUILTIN
