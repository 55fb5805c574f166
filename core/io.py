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


class Busy(RuntimeError):
    """Another live process holds the lock; the message names it."""


class WriterLock:
    """One writer per folder: an advisory `fcntl.flock` on `path` (a file that stays; it holds the holder's pid and
    start time). A second writer is refused at once with a `Busy` naming the holder; the kernel drops the lock of
    a process that died, so a later writer takes it over. Re-entrant within a process (the same path may be taken
    again by the holder, e.g. a pipeline stage writing a store under the run's lock)."""

    _held: dict[str, list] = {}  # realpath -> [fd, count]: flock is per open file, so one fd per process
    _mutex = threading.Lock()

    def __init__(self, path: str | Path, what: str):
        self.path, self.what = Path(path), what

    def __enter__(self) -> "WriterLock":
        import fcntl
        import time

        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = self._key = os.path.realpath(self.path)  # kept: a relative path means another file after a chdir
        with self._mutex:
            if key in self._held:
                self._held[key][1] += 1
                return self
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").split()
                os.close(fd)
                pid, since = (holder + ["?", "?"])[:2] if holder else ("?", "?")
                raise Busy(f"{self.what} is in use by pid {pid} (started {since.replace('T', ' ')}); wait for it "
                           f"to end or stop it; a lock left by a dead process is taken over ({self.path})") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0)
            self._held[key] = [fd, 1]
        return self

    def __exit__(self, *exc) -> None:
        key = self._key
        with self._mutex:
            entry = self._held[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[key]
                os.close(entry[0])  # closing the only fd releases the flock
