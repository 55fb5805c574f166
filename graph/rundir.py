"""A run directory's control files: checked before anything is written, read with errors that
name the file and the fix, written atomically."""
from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

from pydantic import ValidationError

from trace_rl.core.io import atomic_write_json
from trace_rl.graph.config import RunConfig


class RunDirError(ValueError):
    """A run directory that cannot be used as it is; the message names the file and the fix."""


def read_json_file(path: Path, what: str):
    """A run directory's JSON file, or a RunDirError naming it (never a traceback, nothing written)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise RunDirError(f"{path}: not valid JSON ({str(err)[:120]}); {what}") from None


def check_run_dir(run_dir: Path) -> None:
    """Refuse, before anything is written, a run directory that is a file or holds a damaged
    checkpoint or control file."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is a file, not a run directory; pass another --run-dir")
    db = run_dir / "graph.sqlite"
    if db.exists():
        with open(db, "rb") as f:
            header = f.read(16)
        if header != b"SQLite format 3\x00":
            raise RunDirError(f"{db} is not a checkpoint database ({'empty' if not header else 'damaged'}); "
                              "move it away to start this run over, or restore it from a backup")
        try:
            with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
                check = con.execute("PRAGMA quick_check").fetchall()
                con.execute("SELECT count(*) FROM sqlite_master").fetchall()
            if check != [("ok",)]:
                raise sqlite3.DatabaseError(str(check[:3]))
        except sqlite3.DatabaseError as err:
            raise RunDirError(f"{db} is damaged ({err}); move it away to start this run over") from None
    for name, fix in (("config.json", "restore it, or start a new run directory"),
                      ("approvals.json", "fix or remove it (decisions are asked again)"),
                      ("pending.json", "remove it (the run writes it again when it waits)")):
        if (run_dir / name).is_file():
            data = read_json_file(run_dir / name, fix)
            if not isinstance(data, dict):
                raise RunDirError(f"{run_dir / name}: must hold a JSON object; {fix}")


def save_config(run_dir: Path, cfg: RunConfig) -> None:
    atomic_write_json(run_dir / "config.json", cfg.model_dump())


def load_saved_config(run_dir: Path) -> RunConfig:
    p = Path(run_dir) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{run_dir} is not a trace-rl run directory (no config.json); start one with `trace-rl run`")
    try:
        return RunConfig.model_validate(read_json_file(p, "restore it, or start a new run directory"))
    except ValidationError as err:
        raise RunDirError(f"{p}: not a valid run configuration ({err.error_count()} problem(s), first: "
                          f"{'.'.join(map(str, err.errors()[0]['loc']))}: {err.errors()[0]['msg']}); "
                          "restore it, or start a new run directory") from None
