"""The benchmark adapter protocol: what trace-rl needs from any agent benchmark.

A new benchmark is one file: subclass `Benchmark` (tasks + splits) and `Episode`
(reset / step / score). trace-rl finds it as `--benchmark path/to/file.py:Class`,
`--benchmark package.module:Class`, through the `trace_rl.benchmarks` entry-point group,
or by a `register("name", factory)` call. See docs/benchmarks.md.
The episode types (`Episode`, `Observation`, `Score`, `Task`) live in `trace_rl.core.episode`
(the agent loop below this layer uses them) and are re-exported here: a plugin imports all it
needs from this module.

Thread safety: `rollout()` runs episodes in threads, so `episode()` must return independent
objects and a benchmark's shared state must be safe to read from several threads.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from abc import ABC, abstractmethod
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, ValidationError

from trace_rl.core.episode import Episode, Observation, Score, Task, decode_tool_calls

__all__ = ["Benchmark", "BenchmarkError", "BenchmarkOptions", "Episode", "Observation", "Score", "Task",
           "benchmark_version", "decode_tool_calls", "load_benchmark", "register", "resolve"]


class BenchmarkOptions(BaseModel):
    """Base of a benchmark's own options (`--bench-opt key=value`, `benchmark_options:` in a config):
    unknown keys are errors."""
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class Benchmark(ABC):
    """`splits()`, `tasks(split)`, `episode(task_id)`; `trace-rl run` also needs a `train` and a
    `test` split (or the ones named in the config) and `spec()` for the environment builder."""
    name: str
    Options: type[BaseModel] | None = None  # the benchmark's options, validated before construction
    version: str | None = None  # what changes its episodes (data, rules); unset: a hash of the file defining the class
    fixed_max_steps: str | None = None  # why an episode's length is the benchmark's own rule: then a user's
                                        # max_steps cannot apply (an error, not silence)

    @abstractmethod
    def splits(self) -> list[str]: ...

    @abstractmethod
    def tasks(self, split: str) -> list[Task]: ...

    @abstractmethod
    def episode(self, task_id: str, hinted: bool = False) -> Episode:
        """A fresh episode of one task. With `hinted` (GRPO on the target asks for it) the system
        prompt carries a hint and `Episode.plain_system_prompt` is the prompt without it; a
        benchmark that has no hints ignores it."""

    def task_tools(self, task_id: str) -> list[str] | None:
        """Names of the tools this task offers, when tasks offer different subsets (None: all of spec()'s)."""
        return None

    def spec(self) -> dict:
        """What a synthesized environment must imitate: {"tools", "policy", "system_prompt"}.
        The default reads one episode of the first split; adapters may answer more cheaply."""
        first = self.tasks(self.splits()[0])[0].id
        ep = self.episode(first)
        try:
            ep.reset()
            out = {"tools": ep.tools, "policy": ep.system_prompt, "system_prompt": ep.system_prompt}
        finally:
            ep.close()
        if self.task_tools(first) is not None:  # tasks offer subsets: which task offers which tools
            out["task_tools"] = {t.id: self.task_tools(t.id) for split in self.splits() for t in self.tasks(split)}
        return out

    def task(self, task_id: str, split: str | None = None) -> Task:
        for s in [split] if split else self.splits():
            for t in self.tasks(s):
                if t.id == task_id:
                    return t
        raise BenchmarkError(f"{self.name}: unknown task id {task_id!r}" + (f" in split {split!r}" if split else ""))

    def _check_split(self, split: str) -> None:
        if split not in self.splits():
            raise BenchmarkError(f"{self.name} has no split {split!r}; choose one of {', '.join(self.splits())}")


class BenchmarkError(ValueError):
    """A problem with a benchmark or its input: the CLI prints it as one line (exit code 2). A plugin raises it
    (in its constructor, `splits()`, `tasks()`) for what its user must fix."""


def benchmark_version(bench: Benchmark) -> str:
    """`bench.version`, else the sha256 (12 hex) of the source file that defines its class."""
    if bench.version:
        return str(bench.version)
    try:  # the class of the object `episode` is bound to: a proxy in front of the benchmark reads the same
        return hashlib.sha256(Path(inspect.getfile(type(bench.episode.__self__))).read_bytes()).hexdigest()[:12]
    except (OSError, TypeError, AttributeError):
        return "unknown"


def hinted_episode(bench: Benchmark, task_id: str, hinted: bool) -> Episode:
    """`bench.episode(task_id, hinted=True)` where the benchmark takes hints; a plugin whose `episode()`
    has no `hinted` parameter has none, and gets the task id alone."""
    if hinted and "hinted" in inspect.signature(bench.episode).parameters:
        return bench.episode(task_id, hinted=True)
    return bench.episode(task_id)


_REGISTRY: dict[str, Callable[..., Benchmark]] = {}
BUILTIN = {  # prefix -> module:factory shipped with trace-rl
    "tau2": "trace_rl.evals.tau2_bench:tau2_benchmark",
    "bfcl": "trace_rl.evals.bfcl:bfcl_benchmark",
    "toolsandbox": "trace_rl.evals.toolsandbox:toolsandbox_benchmark",
}
ENTRY_POINTS = "trace_rl.benchmarks"


def installer(prefix: str) -> Callable[..., Path]:
    """The `install(source=None, log=...)` of a built-in benchmark that lives in a venv of its own."""
    if prefix not in BUILTIN:
        raise BenchmarkError(f"unknown built-in benchmark {prefix!r}; built in: {', '.join(sorted(BUILTIN))}")
    install = getattr(importlib.import_module(BUILTIN[prefix].partition(":")[0]), "install", None)
    if install is None:
        raise BenchmarkError(f"{prefix} needs no installing: it runs in trace-rl's own venv")
    return install


def register(prefix: str, factory: Callable[..., Benchmark]) -> None:
    _REGISTRY[prefix] = factory


def _from_file(path: Path):
    """Import a benchmark file once (by its absolute path) and return the module."""
    path = path.resolve()
    name = f"trace_rl_plugin_{abs(hash(str(path)))}"
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise BenchmarkError(f"benchmark file {path} does not exist")
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise BenchmarkError(f"{path}: cannot import: {type(err).__name__}: {err}") from None
    return module


def resolve(spec: str) -> tuple[Callable[..., Benchmark], str]:
    """`spec` -> (factory or Benchmark class, variant). Looked up in order: a registered prefix
    (`tau2:airline`), an entry point of the `trace_rl.benchmarks` group (`toolsandbox`,
    `toolsandbox:variant`), a file (`path/to/bench.py:Class`), a module (`pkg.mod:Class`)."""
    prefix, _, rest = spec.partition(":")
    if prefix in BUILTIN and prefix not in _REGISTRY:  # by name, not import: the adapters import this module
        module, _, attr = BUILTIN[prefix].partition(":")
        register(prefix, getattr(importlib.import_module(module), attr))
    if prefix in _REGISTRY:
        return _REGISTRY[prefix], rest
    eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}
    known = ", ".join(sorted(set(_REGISTRY) | set(BUILTIN) | set(eps)))
    if prefix in eps:
        try:
            return eps[prefix].load(), rest
        except Exception as err:
            raise BenchmarkError(f"entry point {prefix!r} ({eps[prefix].value}) cannot load: {err}") from None
    if rest and (prefix.endswith(".py") or "/" in prefix):
        module = _from_file(Path(prefix))
    elif rest and prefix.replace(".", "").replace("_", "").isalnum():
        try:
            module = importlib.import_module(prefix)
        except ImportError as err:
            raise BenchmarkError(f"unknown benchmark {spec!r}; known: {known}; as package.module:Class it does "
                                 f"not import ({err})") from None
    else:
        raise BenchmarkError(f"unknown benchmark {spec!r}; known: {known}; or give path/to/file.py:Class "
                             "or package.module:Class")
    attr, _, variant = rest.partition("@")
    if not hasattr(module, attr):
        raise BenchmarkError(f"benchmark {spec!r}: {prefix} has no {attr!r}")
    return getattr(module, attr), variant


def load_benchmark(spec: str, options: dict | None = None, offer: dict | None = None) -> Benchmark:
    """The benchmark named by `spec`, built with its validated `options`.

    `offer` holds what the framework can supply (max_steps, user_llm): each is passed only if the
    benchmark's Options has that field, so a benchmark never receives options it does not take; a max_steps
    offered to a benchmark with `fixed_max_steps` is an error. A constructor that raises is a BenchmarkError."""
    factory, variant = resolve(spec)
    options, model = dict(options or {}), getattr(factory, "Options", None)
    fields = model.model_fields if model is not None else {}
    if model is not None:
        options = {**{k: v for k, v in (offer or {}).items() if k in fields and v is not None}, **options}
        try:
            validated = model.model_validate(options)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(options)'}: {e['msg']}" for e in err.errors())
            raise BenchmarkError(f"{spec}: invalid benchmark options: {problems} "
                                 f"(its options: {', '.join(fields) or 'none'})") from None
        options = {k: getattr(validated, k) for k in fields if k in validated.model_fields_set or k in options}
    elif options and isinstance(factory, type):
        raise BenchmarkError(f"{spec} takes no options, got {', '.join(sorted(options))}")
    if isinstance(factory, type) and issubclass(factory, Benchmark):
        if variant and "variant" not in fields:
            raise BenchmarkError(f"{spec}: {factory.__name__} takes no @variant (its options: "
                                 f"{', '.join(fields) or 'none'})")
        if variant and "variant" in options:
            raise BenchmarkError(f"{spec}: the variant is given twice (@{variant} and the variant option)")
        make = lambda: factory(**({"variant": variant} if variant else {}), **options)  # noqa: E731
    else:
        make = lambda: factory(variant, **options)  # noqa: E731
    try:
        bench = make()
    except BenchmarkError:
        raise
    except Exception as err:  # a plugin's constructor: one line, not a traceback
        raise BenchmarkError(f"{spec}: building it raised {type(err).__name__}: {str(err)[:300]}") from None
    if not isinstance(bench, Benchmark):
        raise BenchmarkError(f"{spec} built a {type(bench).__name__}, not a trace_rl Benchmark")
    if (offer or {}).get("max_steps") is not None and bench.fixed_max_steps:
        raise BenchmarkError(f"{spec}: max_steps cannot apply: {bench.fixed_max_steps}")
    # how another process (a node under executor=ray, evals/executor.py) builds it again: a file by its absolute
    # path, a registered name after importing the module that registered it
    prefix, _, rest = spec.partition(":")
    where = f"{Path(prefix).resolve()}:{rest}" if rest and (prefix.endswith(".py") or "/" in prefix) else spec
    registered_in = getattr(factory, "__module__", None) if prefix in _REGISTRY and prefix not in BUILTIN else None
    bench.loaded_from = (where, dict(options), dict(offer or {}), registered_in)
    return _checked(bench, spec)


def _checked(bench: Benchmark, spec: str) -> Benchmark:
    """`splits()` and `tasks()` as the framework reads them: what a plugin raises or returns of the wrong
    shape (None, strings instead of Tasks, ids that are not strings) is a one-line BenchmarkError."""
    splits, tasks = bench.splits, bench.tasks

    def call(what: str, fn, *args):
        try:
            return fn(*args)
        except BenchmarkError:
            raise
        except Exception as err:
            raise BenchmarkError(f"{spec}: {what} raised {type(err).__name__}: {str(err)[:300]}") from None

    def checked_splits() -> list[str]:
        out = call("splits()", splits)
        if not isinstance(out, (list, tuple)) or not all(isinstance(x, str) for x in out):
            raise BenchmarkError(f"{spec}: splits() returned {out!r:.80}, not a list of split names")
        return list(out)

    def checked_tasks(split: str) -> list[Task]:
        out = call(f"tasks({split!r})", tasks, split)
        if not isinstance(out, (list, tuple)) or not all(isinstance(t, Task) and isinstance(t.id, str) for t in out):
            raise BenchmarkError(f"{spec}: tasks({split!r}) returned {out!r:.80}, not a list of Task with str ids")
        return list(out)

    bench.splits, bench.tasks = checked_splits, checked_tasks
    return bench
