"""A trajectory (one finished episode, every stage's currency) and the store that keeps them.

The store is one JSONL file of finished trajectories (one line = one episode, written
with a single append + fsync, so a killed run leaves at most a torn last line) and an
index.json rewritten atomically after each episode.
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import weakref
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from trace_rl.core.io import WriterLock, atomic_write_json

STORE_LOCK = "store.lock"  # held by the one process that appends to a store


@dataclass
class Trajectory:
    task_id: str
    benchmark: str
    trial: int
    model: str
    messages: list[dict]
    reward: float
    passed: bool
    termination: str
    reasons: dict = field(default_factory=dict)
    steps: int = 0
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    text_tool_calls: int = 0  # tool calls recovered from plain text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    started_at: float = 0.0
    split: str = ""
    settings: dict = field(default_factory=dict)  # what made it (evals/rollout.py episode_settings): reused only on a match

    @property
    def key(self) -> str:
        return f"{self.benchmark}/{self.task_id}/{self.trial}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        """A stored line back as a trajectory; a field of the wrong type (a string reward, a NaN, messages
        that are not role dicts) is a ValueError, so the store quarantines the line instead of a later
        stage crashing on it."""
        if not isinstance(d, dict):
            raise ValueError(f"a trajectory is a JSON object, got {type(d).__name__}")
        t = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        for name, kind in (("task_id", str), ("benchmark", str), ("model", str), ("termination", str), ("split", str),
                           ("passed", bool), ("reasons", dict), ("messages", list), ("settings", dict)):
            if not isinstance(getattr(t, name), kind):
                raise ValueError(f"field {name!r} is {type(getattr(t, name)).__name__}, not {kind.__name__}")
        for name in ("trial", "steps", "tool_calls", "malformed_tool_calls", "text_tool_calls", "prompt_tokens",
                     "completion_tokens"):
            if isinstance(getattr(t, name), bool) or not isinstance(getattr(t, name), int):
                raise ValueError(f"field {name!r} is not an int")
        for name in ("reward", "seconds", "started_at"):
            value = getattr(t, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"field {name!r} is {value!r:.40}, not a finite number")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in t.messages):
            raise ValueError("field 'messages' holds an entry that is not a {'role': ...} object")
        return t


class SettingsMismatch(ValueError):
    """A store holds episodes made under other settings than the ones asked for."""


def settings_change(stored: dict, wanted: dict, prefix: str = "") -> str | None:
    """The first setting on which a stored episode and a new run differ, as `name: X there, Y now` (a nested
    one by its dotted name); None when they agree."""
    shown = lambda d, key: json.dumps(d[key], default=str)[:80] if key in d else "unrecorded"  # noqa: E731
    for key in sorted(set(stored) | set(wanted)):
        old, new = stored.get(key), wanted.get(key)
        if isinstance(old, dict) and isinstance(new, dict) and old != new:
            return settings_change(old, new, f"{prefix}{key}.")
        if key not in stored or key not in wanted or old != new:
            return f"{prefix}{key}: {shown(stored, key)} there, {shown(wanted, key)} now"
    return None


class TrajectoryStore:
    """trajectories.jsonl + index.json. Readers never change the store: a bad line is skipped,
    kept verbatim (with its line number) in quarantine.jsonl next to it and reported once; a
    torn tail (a killed writer's last, unterminated line) is moved to quarantine only by the
    writer, when it next appends; the writer rewrites index.json after every append, from
    what it loaded plus what it added, so the index lists exactly the readable episodes. One process
    writes a store: its first append takes store.lock (held while it lives), and an append from a
    second process is refused in one line naming the holder (`core.io.Busy`)."""

    def __init__(self, directory: str | Path, log: Callable[[str], None] | None = None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "trajectories.jsonl"
        self.index_path = self.dir / "index.json"
        self.quarantine_path = self.dir / "quarantine.jsonl"
        self._lock = threading.Lock()
        self._writer: WriterLock | None = None
        self._items: dict[str, Trajectory] = {}
        self._torn = 0  # bytes of a torn last line, repaired at the next append
        self._unterminated = 0  # the last line is a whole episode without its newline
        self._log = log or (lambda msg: print(msg, file=sys.stderr))
        self._load()

    def _quarantined(self) -> set[tuple[int, str]]:
        if not self.quarantine_path.is_file():
            return set()
        out = set()
        for line in self.quarantine_path.read_text(errors="replace").splitlines():
            with suppress(ValueError, KeyError, TypeError):
                q = json.loads(line)
                out.add((q["line"], q["text"]))
        return out

    def _quarantine(self, entries: list[dict]) -> None:
        with open(self.quarantine_path, "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in entries)
            f.flush()
            os.fsync(f.fileno())

    def _load(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_bytes().split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline; else a torn (or unterminated) last line
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
            with suppress(OSError):  # a read-only run directory: report, keep nothing
                self._quarantine(new)
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

    def add(self, traj: Trajectory, replace: bool = False) -> None:
        """Append one episode; one already stored under its key stays, unless `replace` (the later line then
        wins when the store is read: the earlier one is kept in the file as history)."""
        line = (json.dumps(traj.to_dict(), default=str, allow_nan=False) + "\n").encode()  # NaN: not JSON
        with self._lock:
            if traj.key in self._items and not replace:
                return
            if self._writer is None:  # another process appending here would tear lines and race on index.json
                self._writer = WriterLock(self.dir / STORE_LOCK, f"the trajectory store {self.dir}").__enter__()
                weakref.finalize(self, self._writer.__exit__, None, None, None)  # released with the store
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
