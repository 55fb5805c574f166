"""Writes a kill cannot leave half-done (a temp file beside the target, then one rename), and where
trace-rl keeps its caches."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Callable


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` fills a temp file beside `path` (unique per process and thread), then one
    rename puts it in place; a failed write leaves `path` as it was and no temp file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_json(path: str | Path, data) -> None:
    """JSON as the standard has it: a NaN or infinity is refused (ValueError naming the file), never written
    as `NaN`, which other readers reject."""
    try:
        text = json.dumps(data, indent=2, default=str, allow_nan=False)
    except ValueError as err:
        raise ValueError(f"{path}: refusing to write a non-finite number ({err})") from None
    atomic_write_text(path, text)


def fingerprint(data, salt: str = "") -> str:
    """The sha256 (hex) of `salt` + `data` as sorted JSON: what keys every cached result to the settings that
    made it (a pipeline stage's config, a stored episode's settings)."""
    return hashlib.sha256((salt + json.dumps(data, sort_keys=True, default=str)).encode()).hexdigest()


CACHE_ENV = "TRACE_RL_CACHE"


def cache_dir() -> Path:
    """Root of everything trace-rl caches (models, wheels, sandbox recipes, prompt states, logs)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trace-rl").expanduser()
