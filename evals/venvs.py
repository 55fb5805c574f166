"""A virtualenv of its own for a benchmark whose pins trace-rl cannot share, made once.

A `VenvRecipe` names the venv and its pip steps. `ensure_venv` builds it in a temporary folder
beside its home and renames it into place at the end, so a killed install leaves nothing that
looks finished; the recipe's hash is stamped inside, so the second call costs one file read and a
changed recipe builds a new venv. Pip runs as `python -m pip` (a renamed venv's scripts keep
their old shebangs; its interpreter does not care where it lives).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trace_rl.evals.benchmark import BenchmarkError

STAMP = ".trace-rl-recipe"


def venv_root() -> Path:
    return Path(os.environ.get("TRACE_RL_CACHE", "~/.cache/trace-rl")).expanduser() / "benchmarks"


@dataclass(frozen=True)
class VenvRecipe:
    name: str                                  # folder name, e.g. "toolsandbox-165848b"
    steps: tuple[tuple[str, ...], ...]         # each one `pip install` argument list, run in order
    check: str = "pass"                        # Python run in the finished venv: must exit 0
    env: dict[str, str] = field(default_factory=dict)  # extra environment for pip (e.g. PIP_CONSTRAINT="")

    @property
    def home(self) -> Path:
        return venv_root() / self.name

    @property
    def python(self) -> Path:
        return self.home / "bin" / "python"

    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.steps, self.check, sorted(self.env.items())]).encode()).hexdigest()[:16]

    def ready(self) -> bool:
        try:
            return (self.home / STAMP).read_text().strip() == self.digest() and self.python.exists()
        except OSError:
            return False


def _run(cmd: list[str], env: dict, what: str, log) -> None:
    log(f"{what}: {' '.join(cmd[3:])[:160]}")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise BenchmarkError(f"{what} failed (exit {proc.returncode}): {proc.stdout.strip()[-1500:]}")


def ensure_venv(recipe: VenvRecipe, log=lambda _msg: None) -> Path:
    """The recipe's interpreter, building the venv first if it is missing or stale."""
    if recipe.ready():
        return recipe.python
    root = venv_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{recipe.name}.lock", "w") as lock:  # two installers: the second waits, then finds it ready
        fcntl.flock(lock, fcntl.LOCK_EX)
        if recipe.ready():
            return recipe.python
        tmp = root / f".{recipe.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **recipe.env}
        base = getattr(sys, "_base_executable", None) or sys.executable
        try:
            _run([base, "-m", "venv", str(tmp)], env, f"{recipe.name}: creating the venv", log)
            pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q"]
            for i, step in enumerate(recipe.steps, 1):
                _run([*pip, *step], env, f"{recipe.name}: pip step {i}/{len(recipe.steps)}", log)
            _run([str(tmp / "bin" / "python"), "-c", recipe.check], env, f"{recipe.name}: checking the venv", log)
            (tmp / STAMP).write_text(recipe.digest())
            old = root / f".{recipe.name}.old-{os.getpid()}"
            if recipe.home.exists():
                recipe.home.rename(old)
            tmp.rename(recipe.home)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return recipe.python
