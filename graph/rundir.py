"""A run directory's control files: checked before anything is written, read with errors that
name the file and the fix, written atomically."""
from __future__ import annotations

import hashlib
import io
import json
import sqlite3
import tarfile
from contextlib import closing
from pathlib import Path

from pydantic import ValidationError

from trace_rl.core.io import atomic_write, atomic_write_json
from trace_rl.graph.config import RunConfig


class RunDirError(ValueError):
    """A run directory that cannot be used as it is; the message names the file and the fix."""


# what each stage writes in a run directory (a stale stage's outputs are archived; a moved run finds them)
STAGE_OUTPUTS = {"rollout": ["iter_0/rollouts"], "analyse": ["iter_0/analysis"], "synthesise": ["envs"],
                 "train": ["train", "train_target"], "compose": ["composition"], "evaluate": ["iter_0/eval"]}


def here(path: str, run_dir: Path) -> str:
    """A path the state recorded, on this machine. A run packed on one machine and unpacked on
    another (the CPU machine builds, the GPU machine trains) keeps its layout, so a recorded path
    that is gone is the same stage output under `run_dir`."""
    p = Path(path)
    if p.exists():
        return path
    tops = {out.split("/")[0] for outs in STAGE_OUTPUTS.values() for out in outs}
    i = next((i for i in range(len(p.parts) - 1, -1, -1) if p.parts[i] in tops), None)
    moved = Path(run_dir).joinpath(*p.parts[i:]) if i is not None else p
    return str(moved) if moved.exists() else path


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
        if (run_dir / name).is_file() and not isinstance(read_json_file(run_dir / name, fix), dict):
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


# ---------------------------------------------------------------- moving a run between machines
PACK_SKIP = ("checkpoints", "stale", "tensorboard")  # resumable state others can rebuild, or history


def pack(run_dir: Path, out_dir: Path, part_mb: int = 15) -> list[Path]:
    """RUN_DIR as one gzipped tar in parts of <= part_mb MiB (a transfer may limit file sizes), with
    a manifest of their sha256. GRPO checkpoints, retired stages and TensorBoard logs stay behind:
    a finished adapter is in the run, and an unfinished GRPO restarts from its last checkpoint only
    where that checkpoint is."""
    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir)  # resolved: `pack .` has a name too
    check_run_dir(run_dir)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(run_dir, arcname=run_dir.name,
                filter=lambda ti: None if set(Path(ti.name).parts) & set(PACK_SKIP) else ti)
    data, size = buf.getvalue(), part_mb << 20
    parts = []
    for i in range(0, max(1, len(data)), size):
        part = out_dir / f"{run_dir.name}.tgz.{len(parts):02d}"
        atomic_write(part, lambda tmp, chunk=data[i:i + size]: tmp.write_bytes(chunk))
        parts.append(part)
    atomic_write_json(out_dir / f"{run_dir.name}.tgz.json", {
        "run": run_dir.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
        "parts": [p.name for p in parts]})
    return parts


def unpack(parts_dir: Path, into: Path) -> Path:
    """The inverse of `pack`: parts checked against their manifest, then extracted under `into`
    (an existing run of that name is refused, not overwritten)."""
    manifests = sorted(Path(parts_dir).glob("*.tgz.json"))
    if len(manifests) != 1:
        raise RunDirError(f"{parts_dir}: expected one *.tgz.json manifest from `trace-rl pack`, found {len(manifests)}")
    m = read_json_file(manifests[0], "pack the run again")
    data = b"".join((Path(parts_dir) / p).read_bytes() for p in m["parts"])
    if hashlib.sha256(data).hexdigest() != m["sha256"]:
        raise RunDirError(f"{parts_dir}: the parts do not match their manifest (incomplete transfer?); copy them again")
    dest = Path(into) / m["run"]
    if dest.exists():
        raise RunDirError(f"{dest} exists; move it away or unpack into another folder")
    Path(into).mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(into, filter="data")  # no absolute paths, links out of the tree or devices
    return dest
