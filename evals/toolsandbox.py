"""Apple's ToolSandbox (github.com/apple/ToolSandbox at 165848b) as a built-in benchmark.

ToolSandbox pins packages trace-rl cannot share (pydantic 2.7, openai 1.17, numpy 1.26, ...), so
it lives in a venv of its own (`install`, i.e. `trace-rl benchmarks install toolsandbox`) and is
played by `toolsandbox_worker.py` there, behind `WorkerBenchmark`. Scenarios, tools, tool
execution and scoring are ToolSandbox's own; only the agent (and, with `user: simulator`, the
model answering ToolSandbox's user-simulator prompt) comes from trace-rl. The user simulator's
model is asked here, not in the worker: the worker hands over what ToolSandbox shows its user and
gets the answer back. docs/benchmarks.md ("Built-in: ToolSandbox") has the splits and the rules.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import threading
import zipfile
from pathlib import Path
from typing import Literal

from pydantic import Field

from trace_rl.models.llm import LLMConfig
from trace_rl.evals.benchmark import BenchmarkError, Observation, Task
from trace_rl.evals.venvs import STAMP, VenvRecipe, ensure_venv, venv_root
from trace_rl.evals.worker import WorkerBenchmark, WorkerEpisode, WorkerOptions

UPSTREAM = "https://github.com/apple/ToolSandbox.git"
COMMIT = "165848b9a78cead7ca7fe7c89c688b58e6501219"
VENDORED = "ToolSandbox-165848b.tar.gz"  # the upstream repository at COMMIT, unmodified (../shared/vendor/)
VENDORED_SHA256 = "c3146e6958f2d49c202a7196894d683ed20ac965283790178fbb565c9208f8cb"
SOURCE_ENV = "TRACE_RL_TOOLSANDBOX_SOURCE"
VENV = "toolsandbox"
PIN_FIXES = {"ccy==1.3.1": "ccy==1.4.0"}  # 1.3.1 is not on the package registry; 1.4.0 serves ToolSandbox's use
# What the worker path imports (scenarios and tools, execution environment, message and tool
# converters, the user-simulator view, evaluation), measured from the sys.modules of a worker that
# built its scenarios, played, answered the user and scored (run with -S, so no .pth file imports
# anything): the distributions to carry as wheels to a machine without a registry. Not imported:
# anthropic, huggingface_hub, jsonschema, langchain (only langchain-core), pyyaml, sentencepiece,
# transformers, tree-sitter(-languages), vertexai. The venv still gets every pin ToolSandbox names.
# Unpinned ones come with the pins above (docs/benchmarks.md lists the versions measured).
WORKER_DISTRIBUTIONS = (
    # ToolSandbox's own pins
    "ccy==1.4.0", "decorator==5.1.1", "dill==0.3.8", "geopy==2.4.1", "holidays==0.51", "networkx==3.2.1",
    "numpy==1.26.4", "openai==1.17.0", "phonenumbers==8.13.39", "pint==0.23", "polars==0.20.31", "pydantic==2.7.4",
    "rapidfuzz==3.9.3", "requests==2.32.3", "rouge-score==0.1.2", "scipy==1.13.1", "strenum==0.4.15",
    "tenacity==8.4.1", "typing-extensions==4.12.2",
    # what those import in turn (langchain-core is langchain==0.1.3's)
    "langchain-core==0.1.23", "absl-py", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-types", "anyio",
    "attrs", "certifi", "charset-normalizer", "click", "defusedxml", "distro", "frozenlist", "geographiclib", "httpx",
    "idna", "multidict", "nltk", "packaging", "propcache", "pycountry", "pydantic-core==2.18.4", "python-dateutil",
    "regex", "six", "sniffio", "tqdm", "urllib3", "yarl",
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _project(tree: Path) -> Path:
    """The folder holding ToolSandbox's pyproject.toml: `tree` or its one top-level folder."""
    if (tree / "pyproject.toml").is_file():
        return tree
    inner = [p for p in tree.iterdir() if p.is_dir()]
    if len(inner) == 1 and (inner[0] / "pyproject.toml").is_file():
        return inner[0]
    raise BenchmarkError(f"toolsandbox: {tree} holds no pyproject.toml (is it ToolSandbox's repository?)")


def _unpack(archive: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                z.extractall(tmp)
        else:
            with tarfile.open(archive) as t:
                t.extractall(tmp, filter="data")  # no links out, no absolute paths, no device files
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _clone(url: str, ref: str, dest: Path, log) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for cmd in (["git", "clone", "--quiet", url, str(tmp)], ["git", "-C", str(tmp), "checkout", "--quiet", ref]):
            log(f"toolsandbox: {' '.join(cmd[:2] + cmd[-2:])}")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                why = " ".join(proc.stderr.split())[-500:]  # git's lines folded into the one-line error
                raise BenchmarkError(f"toolsandbox: {' '.join(cmd)} failed: {why}; offline, name a source instead:"
                                     f" {SOURCE_ENV}=PATH or `trace-rl benchmarks install "
                                     f"toolsandbox --source PATH` (PATH: {VENDORED} or a checkout folder)")
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def source_tree(source: str, log=lambda _msg: None) -> Path:
    """ToolSandbox's source folder from `source`: a folder (used in place), an archive (.tar.gz /
    .zip; the vendored one must match its sha256) or a git URL (`URL` or `URL@ref`; the upstream
    URL without a ref means COMMIT), unpacked or cloned once into the cache."""
    root = venv_root() / "sources"
    path = Path(source).expanduser()
    if path.is_dir():
        return _project(path.resolve())
    if path.is_file():
        digest = _sha256(path)
        if path.name == VENDORED and digest != VENDORED_SHA256:
            raise BenchmarkError(f"toolsandbox: {path} has sha256 {digest}, not the vendored archive's "
                                 f"{VENDORED_SHA256}: fetch it again")
        dest = root / f"toolsandbox-{digest[:16]}"
        if not dest.exists():
            log(f"toolsandbox: unpacking {path} (sha256 {digest[:16]}...)")
            root.mkdir(parents=True, exist_ok=True)
            _unpack(path, dest)
        return _project(dest)
    url = source.removeprefix("git+")
    if not url.startswith(("https://", "http://", "ssh://", "git@", "file://")):
        raise BenchmarkError(f"toolsandbox: source {source!r} is neither a folder, an archive nor a git URL")
    head, at, ref = url.rpartition("@")
    if at and head and "/" not in ref and ":" not in ref:
        url = head
    else:
        ref = COMMIT if url.rstrip("/").removesuffix(".git") == UPSTREAM.removesuffix(".git") else "HEAD"
    dest = root / f"toolsandbox-git-{hashlib.sha256(f'{url}@{ref}'.encode()).hexdigest()[:16]}"
    if not dest.exists():
        root.mkdir(parents=True, exist_ok=True)
        _clone(url, ref, dest, log)
    return _project(dest)


def pins(tree: Path) -> list[str]:
    """ToolSandbox's own dependency pins, with the one the registry lacks replaced."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise BenchmarkError("toolsandbox: installing it needs Python 3.11+ (tomllib reads its pins)") from None
    deps = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["dependencies"]
    return [PIN_FIXES.get(d.replace(" ", ""), d) for d in deps]


def install(source: str | None = None, log=lambda _msg: None) -> Path:
    """ToolSandbox's venv (idempotent): its pins, then the package without dependencies."""
    tree = source_tree(source or os.environ.get(SOURCE_ENV) or f"{UPSTREAM}@{COMMIT}", log)
    recipe = VenvRecipe(VENV, steps=(tuple(pins(tree)), ("--no-deps", str(tree))),
                        check="import tool_sandbox.scenarios, tool_sandbox.roles.execution_environment")
    return ensure_venv(recipe, log)


def installed_python() -> Path | None:
    home = venv_root() / VENV
    return home / "bin" / "python" if (home / STAMP).is_file() and (home / "bin" / "python").exists() else None


class ToolSandboxOptions(WorkerOptions):
    python: str | None = Field(None, description="ToolSandbox's venv interpreter (default: the one "
                                                 "`trace-rl benchmarks install toolsandbox` made)")
    user: Literal["simulator", "end"] = Field(
        "simulator", description="simulator: ToolSandbox's user-simulator prompt answered by user_llm; end: the "
        "conversation ends after the agent's first reply to the user (multi-user-turn scenarios are excluded)")
    user_llm: LLMConfig | str | None = Field(None, description="the user simulator's model (an LLMConfig or its "
                                                               "fields, or a model name)")


class ToolSandboxEpisode(WorkerEpisode):
    """A worker episode whose user turns are answered here: ToolSandbox's user view goes to the
    user-simulator model (or, with user=end, the user ends the conversation)."""
    max_steps = 30  # ToolSandbox's limit is 30 messages after the scenario's own; the worker enforces it

    def step(self, content: str, tool_calls: list[dict]) -> Observation:
        out = self._call("step", content, tool_calls)
        while out.get("user_turn") is not None:
            if self.bench.user == "end":
                out = self._call("call", "end_conversation")
            else:
                view = out["user_turn"]
                reply = self.bench.user_client().chat(view["messages"], tools=view["tools"])
                out = self._call("call", "user_reply", reply.content, [tc.to_openai() for tc in reply.tool_calls])
        return Observation(out.get("messages", []), bool(out.get("done")), out.get("reason"))


class ToolSandboxBenchmark(WorkerBenchmark):
    """`toolsandbox` (every usable scenario of TRACE's set) or `toolsandbox:<subset>` (`base` or a
    ToolSandbox category): the subset every split is cut down to."""
    worker_target = "toolsandbox_worker.py:ToolSandboxBench"
    Options = ToolSandboxOptions

    def __init__(self, variant: str = "", python: str | None = None, user: str = "simulator", user_llm=None,
                 call_timeout_s: float = 120.0, max_restarts: int = 5):
        python = python or installed_python()
        if python is None or not Path(python).exists():
            raise BenchmarkError(f"toolsandbox: ToolSandbox's venv is not installed ({venv_root() / VENV}): "
                                 "run `trace-rl benchmarks install toolsandbox`")
        if user not in ("simulator", "end"):
            raise BenchmarkError(f"toolsandbox: user={user!r}: use simulator or end")
        super().__init__(python=str(python), call_timeout_s=call_timeout_s, max_restarts=max_restarts)
        self.variant, self.user, self.user_llm = variant, user, user_llm
        self.name = f"toolsandbox:{variant}" if variant else "toolsandbox"
        self._raw: dict[str, list[dict]] = {}
        self._user, self._user_lock = None, threading.Lock()
        if variant and variant not in self._worker_splits():
            self.close()
            raise BenchmarkError(f"toolsandbox: unknown subset {variant!r}; choose base or a category: "
                                 f"{', '.join(s for s in self._worker_splits() if s not in ('all', 'train', 'test'))}")

    def _worker_splits(self) -> list[str]:
        return WorkerBenchmark.splits(self)

    def _raw_tasks(self, split: str) -> list[dict]:
        if split not in self._raw:
            self._raw[split] = list(self.live_worker().call("tasks", split))
        return self._raw[split]

    def _playable(self) -> dict[str, dict]:
        """The variant's scenarios that this user mode can play, by id."""
        subset = self._raw_tasks(self.variant or "all")
        return {t["id"]: t for t in subset if self.user == "simulator" or "multiple_user_turn" not in t["categories"]}

    def splits(self) -> list[str]:
        playable = self._playable()
        return [s for s in self._worker_splits() if any(t["id"] in playable for t in self._raw_tasks(s))]

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            self._check_split(split)
            playable = self._playable()
            self._tasks[split] = [Task(t["id"], self.name, split, t.get("description", ""))
                                  for t in self._raw_tasks(split) if t["id"] in playable]
        return self._tasks[split]

    def excluded(self) -> dict[str, str]:
        """Scenarios of TRACE's set this benchmark does not play, with the reason: RapidAPI's (no
        internet or key), and with user=end the multi-user-turn ones."""
        out = dict(self.spec()["excluded"])
        if self.user == "end":
            out.update({t["id"]: "multiple user turns need user=simulator" for t in self._raw_tasks(self.variant or "all")
                        if "multiple_user_turn" in t["categories"]})
        return out

    def episode(self, task_id: str, hinted: bool = False) -> ToolSandboxEpisode:
        if task_id not in self._playable():
            why = self.excluded().get(task_id) or f"not in {self.name}"
            raise BenchmarkError(f"{self.name}: scenario {task_id!r} is not played here: {why}")
        return ToolSandboxEpisode(self, task_id)  # ToolSandbox has no hints: a hinted episode is the plain one

    def task_tools(self, task_id: str) -> list[str] | None:
        return self.spec()["task_tools"].get(task_id)

    def user_client(self):
        """One client of the user-simulator model for every episode (its server is shared)."""
        from trace_rl.evals.user_sim import user_llm

        with self._user_lock:
            if self._user is None:  # a client given as such (tests script the user) is used as it is
                self._user = self.user_llm if hasattr(self.user_llm, "chat") else user_llm(self.user_llm)
            return self._user


def toolsandbox_benchmark(variant: str = "", **options) -> ToolSandboxBenchmark:
    """`toolsandbox`, `toolsandbox:base`, `toolsandbox:canonicalization`, ..."""
    return ToolSandboxBenchmark(variant or "", **options)


toolsandbox_benchmark.Options = ToolSandboxOptions  # found by name through evals.benchmark.BUILTIN
