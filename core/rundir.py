"""Every path of a run directory, named here once: its control files, its iterations, each stage's
folder and the files in it that another module reads. Stage functions get their folder from here (a
`RunDir` method, or a folder class wrapping the path they were given), so the pipeline, the CLI and
a run moved to another machine all find the same files.

    RUN/config.json stages.json graph.sqlite approvals.json pending.json report.json report.md
    RUN/iter_<i>/rollouts/  analysis/  eval/<mode>/     one per iteration of the autonomous loop
    RUN/envs/<capability>/attempt_<round>/  library/  result.json
    RUN/train/<capability>/tools.json  heldout_before/  grpo/  heldout_after/  report.json
    RUN/train_target/  composition/  stale/<time>/     (the GRPO-on-target baseline, the MoE, retired stages)
"""
from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import shutil
import sqlite3
import tarfile
import time
import zlib
from contextlib import closing, suppress
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from trace_rl.core.io import WriterLock, atomic_write, atomic_write_json
from trace_rl.core.trajectory import STORE_LOCK


class RunDirError(ValueError):
    """A run directory that cannot be used as it is; the message names the file and the fix."""


def read_json_file(path: Path, what: str):
    """A run directory's JSON file, or a RunDirError naming it (never a traceback, nothing written)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise RunDirError(f"{path}: not valid JSON ({str(err)[:120]}); {what}") from None


def read_control(path: Path, shape, fix: str):
    """A control file of a run directory (config.json, approvals.json, pending.json, stages.json,
    capabilities.json, a pack manifest) read through its pydantic model `shape` (a model or a type such as
    dict[str, Model]); anything else is one RunDirError naming the file, the field and `fix`."""
    data = read_json_file(path, fix)
    try:
        return TypeAdapter(shape).validate_python(data)
    except ValidationError as err:
        e = err.errors()[0]
        field = ".".join(map(str, e["loc"])) or "(top level)"
        more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
        got = json.dumps(e.get("input"), default=str)[:60]
        raise RunDirError(f"{path}: field {field}: {e['msg']} (got {got}){more}; {fix}") from None


class Folder(os.PathLike):
    """A folder of known layout; usable wherever a path is (`Path(folder)`, `open`)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __fspath__(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"


class AnalysisDir(Folder):
    """The analyst's folder: facts, candidates, labelling runs, the aggregated capabilities."""

    capabilities = property(lambda self: self.root / "capabilities.json")
    plot = property(lambda self: self.root / "cov_delta.png")
    facts = property(lambda self: self.root / "facts.json")
    candidates = property(lambda self: self.root / "candidates.json")
    error = property(lambda self: self.root / "analyst_error.json")

    def read_capabilities(self) -> dict:
        """capabilities.json checked against its model (the records with every field, the figures as written)."""
        from trace_rl.core.records import CapabilitiesFile

        return read_control(self.capabilities, CapabilitiesFile, "move it away and run the analysis again "
                            "(`trace-rl analyze RUN`, or `trace-rl resume RUN` after moving away the analysis)").model_dump()

    def labels(self, run: int, evidence: bool = False) -> Path:
        return self.root / "labels" / f"run_{run:02d}{'_evidence' if evidence else ''}.json"


class EvalDir(Folder):
    """The final evaluation: one trajectory store per mode (base, router, moe, an adapter), the table, its plot."""

    def mode(self, name: str) -> Path:
        return self.root / name

    def modes(self) -> list[Path]:
        return sorted(p.parent for p in self.root.glob("*/trajectories.jsonl"))

    report = property(lambda self: self.root / "report.json")
    plot = property(lambda self: self.root / "report.png")


class Attempt(Folder):
    """One builder round (or the library substitute): what the model wrote, what code made of it, the
    module, and the verifier's report."""

    env = property(lambda self: self.root / "env.py")
    spec = property(lambda self: self.root / "spec.json")  # spec and pattern mode: what the module was rendered from
    builder_spec = property(lambda self: self.root / "builder_spec.json")  # spec mode: the model's spec as written
    builder_choice = property(lambda self: self.root / "builder_choice.json")  # pattern mode: the model's choice
    difficulty = property(lambda self: self.root / "difficulty.json")  # pattern mode: the level code expanded it at
    builder_error = property(lambda self: self.root / "builder_error.json")
    builder_reply = property(lambda self: self.root / "builder_reply.txt")
    repairs = property(lambda self: self.root / "repairs.json")
    verifier_report = property(lambda self: self.root / "verifier_report.json")
    manifest = property(lambda self: self.root / "manifest.json")


class EnvDir(Folder):
    """One capability's synthesis: a folder per builder round, the library substitute, the outcome."""

    def attempt(self, rnd: int) -> Attempt:
        return Attempt(self.root / f"attempt_{rnd:02d}")

    library = property(lambda self: Attempt(self.root / "library"))
    result = property(lambda self: self.root / "result.json")


class GRPODir(Folder):
    """One GRPO training: the adapter, its log and curve, the episodes, trl's checkpoints."""

    adapter = property(lambda self: self.root / "adapter")
    log = property(lambda self: self.root / "train_log.json")
    curve = property(lambda self: self.root / "curve.png")

    def rollouts(self, rank: int | None = None) -> Path:
        return self.root / "rollouts" / (f"rank{rank}" if rank is not None else "")

    checkpoints = property(lambda self: self.root / "checkpoints")
    tensorboard = property(lambda self: self.root / "tensorboard")

    report = property(lambda self: self.root / "report.json")  # the GRPO-on-target baseline's record

    def finished(self) -> bool:
        return (self.adapter / "adapter_config.json").is_file() and self.log.is_file()


class TrainDir(Folder):
    """One adapter's training (train stage): held-out episodes before and after, GRPO, the target's tools."""

    tools = property(lambda self: self.root / "tools.json")

    def heldout(self, when: str) -> Path:
        return self.root / f"heldout_{when}"

    grpo = property(lambda self: GRPODir(self.root / "grpo"))
    report = property(lambda self: self.root / "report.json")


class CompositionDir(Folder):
    """The composed model: the adapters and gates (one file), and its manifest (written last: whole)."""

    weights = property(lambda self: self.root / "moe.pt")
    manifest = property(lambda self: self.root / "manifest.json")


# what each stage writes (a stale stage's outputs are archived; a moved run finds them): per iteration, or per run
ITERATION_OUTPUTS = {"rollout": "rollouts", "analyse": "analysis", "evaluate": "eval"}
RUN_OUTPUTS = {"synthesise": ["envs"], "train": ["train", "train_target"], "compose": ["composition"]}
CHECKPOINT = ("graph.sqlite", "graph.sqlite-wal", "graph.sqlite-shm")
LOCK = "run.lock"  # held by the one process writing a run directory (or an `eval --out` folder)
APPROVALS_LOCK = "approvals.lock"  # held while a decision is recorded (a waiting run holds LOCK meanwhile)


class RunDir(Folder):
    """A run directory: every path in it comes from here."""

    config = property(lambda self: self.root / "config.json")
    stages = property(lambda self: self.root / "stages.json")  # the fingerprint of each stage's output
    checkpoint = property(lambda self: self.root / CHECKPOINT[0])  # LangGraph's state
    approvals = property(lambda self: self.root / "approvals.json")
    pending = property(lambda self: self.root / "pending.json")
    report_json = property(lambda self: self.root / "report.json")
    report_md = property(lambda self: self.root / "report.md")
    train_target = property(lambda self: GRPODir(self.root / "train_target"))
    composition = property(lambda self: CompositionDir(self.root / "composition"))
    lock = property(lambda self: self.root / LOCK)
    approvals_lock = property(lambda self: self.root / APPROVALS_LOCK)

    def writer(self) -> WriterLock:
        """`with run.writer():` this process is the run directory's one writer (run, resume, `eval --out`);
        another live one is refused with a one-line `Busy` naming its pid and start time."""
        return WriterLock(self.lock, str(self.root))

    def iteration(self, i: int = 0) -> Path:
        return self.root / f"iter_{i}"

    def iterations(self) -> list[int]:
        """The loop iterations that have a folder, in order."""
        return sorted(int(p.name[5:]) for p in self.root.glob("iter_*") if p.name[5:].isdigit())

    def rollouts(self, i: int = 0) -> Path:
        return self.iteration(i) / ITERATION_OUTPUTS["rollout"]

    def analysis(self, i: int = 0) -> AnalysisDir:
        return AnalysisDir(self.iteration(i) / ITERATION_OUTPUTS["analyse"])

    def rollout_stores(self, i: int = 0) -> list[Path]:
        """The trajectory stores the analysis of iteration `i` reads: its rollouts; in a folder that is no
        pipeline run (`trace-rl eval --out`, analysed on its own), every store under it."""
        if self.rollouts(i).is_dir() or not self.root.is_dir():
            return [self.rollouts(i)]
        return sorted(p.parent for p in self.root.rglob("trajectories.jsonl"))

    def eval(self, i: int = 0) -> EvalDir:
        return EvalDir(self.iteration(i) / ITERATION_OUTPUTS["evaluate"])

    def latest(self, has) -> int:
        """The last iteration for which `has(i)` holds (0 when none does)."""
        return next((i for i in reversed(self.iterations()) if has(i)), 0)

    def env(self, capability: str) -> EnvDir:
        return EnvDir(self.root / RUN_OUTPUTS["synthesise"][0] / capability)

    def train(self, name: str) -> TrainDir:
        return TrainDir(self.root / RUN_OUTPUTS["train"][0] / name)

    def archive(self) -> Path:
        """A new folder for retired stage outputs (never deleted)."""
        return self.root / "stale" / time.strftime("%Y%m%d-%H%M%S")

    def stage_outputs(self, stage: str) -> list[str]:
        """What `stage` wrote, relative to the run (the first iteration's, for a stage run per iteration)."""
        if stage in ITERATION_OUTPUTS:
            return [f"{self.iteration(0).name}/{ITERATION_OUTPUTS[stage]}"]
        return list(RUN_OUTPUTS[stage])

    def here(self, path: str) -> str:
        """A path the state recorded, on this machine. A run packed on one machine and unpacked on
        another (the CPU machine builds, the GPU machine trains) keeps its layout, so a recorded path
        that is gone is the same stage output under this run."""
        p = Path(path)
        if p.exists():
            return path
        tops = {out for outs in RUN_OUTPUTS.values() for out in outs} | {self.iteration(0).name}
        i = next((i for i in range(len(p.parts) - 1, -1, -1) if p.parts[i] in tops), None)
        moved = self.root.joinpath(*p.parts[i:]) if i is not None else p
        return str(moved) if moved.exists() else path

    def check(self) -> None:
        """Refuse, before anything is written, a run directory that is a file or holds a damaged
        checkpoint or control file."""
        if self.root.exists() and not self.root.is_dir():
            raise RunDirError(f"{self.root} is a file, not a run directory; pass another --run-dir")
        db = self.checkpoint
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
        for path, fix in ((self.config, "restore it, or start a new run directory"),
                          (self.approvals, "fix or remove it (decisions are asked again)"),
                          (self.pending, "remove it (the run writes it again when it waits)")):
            if path.is_file() and not isinstance(read_json_file(path, fix), dict):
                raise RunDirError(f"{path}: must hold a JSON object; {fix}")

    # ------------------------------------------------------------ moving a run between machines
    PACK_SKIP = ("checkpoints", "stale", "tensorboard", LOCK, APPROVALS_LOCK, STORE_LOCK)  # resumable state others can rebuild, or history

    def pack(self, out_dir: Path, part_mb: int = 15) -> list[Path]:
        """The run as one gzipped tar in parts of <= part_mb MiB (a transfer may limit file sizes), with
        a manifest of their sha256. GRPO checkpoints, retired stages and TensorBoard logs stay behind:
        a finished adapter is in the run, and an unfinished GRPO restarts from its last checkpoint only
        where that checkpoint is."""
        run_dir, out_dir = self.root.resolve(), Path(out_dir)  # resolved: `pack .` has a name too
        RunDir(run_dir).check()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(run_dir, arcname=run_dir.name,
                    filter=lambda ti: None if set(Path(ti.name).parts) & set(self.PACK_SKIP) else ti)
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


def plain_name(name: str) -> str:
    """One path component: no separator, not '.' or '..', not empty."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\x00"):
        raise ValueError(f"must be a plain file name, got {name!r}")
    return name


class PackManifest(BaseModel):
    """RUN.tgz.json, written by `RunDir.pack`."""
    model_config = ConfigDict(extra="forbid")
    run: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    parts: list[str] = Field(min_length=1)

    @field_validator("run")
    @classmethod
    def _run(cls, run: str) -> str:
        return plain_name(run)

    @field_validator("parts")
    @classmethod
    def _parts(cls, parts: list[str]) -> list[str]:
        return [plain_name(p) for p in parts]


def _checked_members(tar: tarfile.TarFile, run: str, where: Path) -> tuple[list[tarfile.TarInfo], int]:
    """Every member of a packed run, refused (one line naming it and why) unless it is a plain file or
    folder under the one root `run`; with the bytes they unpack to."""
    members, size = tar.getmembers(), 0
    for m in members:
        parts = PurePosixPath(m.name).parts
        why = ("an absolute path" if m.name.startswith("/") else
               "a '..' component" if ".." in parts else
               f"outside the run's root {run!r}" if not parts or parts[0] != run else
               "a link" if m.issym() or m.islnk() else
               "a device" if m.ischr() or m.isblk() else
               "a fifo" if m.isfifo() else
               "a sparse file" if m.issparse() else
               "not a plain file or folder" if not (m.isreg() or m.isdir()) else None)
        if why:
            raise RunDirError(f"{where}: member {m.name!r} is {why}; refused, nothing was written")
        size += m.size
    return members, size


def _remove_killed_unpacks(into: Path, run: str) -> None:
    """A killed `unpack` leaves its hidden `.RUN.unpacking-PID` folder (never a half-written run): the next
    unpack of that run removes the ones whose process is gone, and leaves a live one's alone."""
    for left in into.glob(f".{glob.escape(run)}.unpacking-*"):
        pid = left.name.rpartition("-")[2]
        if not pid.isdigit() or left.is_symlink() or not left.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(left, ignore_errors=True)
        except (PermissionError, OverflowError):
            pass  # alive under another user, or no such pid at all: not ours to judge


def unpack(parts_dir: Path, into: Path) -> Path:
    """The inverse of `RunDir.pack`. The archive is untrusted: its manifest is validated, its parts checked
    against their sha256, every member checked (one root named as the manifest's run, plain files and folders
    only) and its size against the free space, all before anything is written; it is extracted into a hidden
    folder beside the target and renamed into place at the end (a failure leaves nothing). An existing run of
    that name is refused, never replaced."""
    parts_dir, into = Path(parts_dir), Path(into)
    manifests = sorted(parts_dir.glob("*.tgz.json"))
    if len(manifests) != 1:
        raise RunDirError(f"{parts_dir}: expected one *.tgz.json manifest from `trace-rl pack`, found {len(manifests)}")
    m = read_control(manifests[0], PackManifest, "pack the run again")
    dest = into / m.run
    if dest.exists() or dest.is_symlink():
        raise RunDirError(f"{dest} exists and is never replaced; move it away, or unpack with --into another folder")
    missing = [p for p in m.parts if not (parts_dir / p).is_file()]
    if missing:
        raise RunDirError(f"{parts_dir}: part {missing[0]} is missing; copy every part listed in {manifests[0].name}")
    data = b"".join((parts_dir / p).read_bytes() for p in m.parts)
    if len(data) != m.bytes or hashlib.sha256(data).hexdigest() != m.sha256:
        raise RunDirError(f"{parts_dir}: the parts do not match their manifest (incomplete transfer?); copy them again")
    unreadable = (tarfile.TarError, EOFError, zlib.error, OSError)  # a truncated or non-gzip archive
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
        members, size = _checked_members(tar, m.run, parts_dir)
    except unreadable as err:
        raise RunDirError(f"{parts_dir}: not a readable gzipped tar ({type(err).__name__}: {str(err)[:100]}); "
                          "nothing was written; pack the run again") from None
    with tar:
        free_at = next(p for p in (into, *into.absolute().parents) if p.exists())
        free = shutil.disk_usage(free_at).free
        if size + (1 << 20) > free:
            raise RunDirError(f"{parts_dir}: the run unpacks to {size / 1e6:.1f} MB, {free_at} has "
                              f"{free / 1e6:.1f} MB free; free some space or unpack with --into elsewhere")
        made = not into.exists()
        into.mkdir(parents=True, exist_ok=True)
        _remove_killed_unpacks(into, m.run)
        tmp = into / f".{m.run}.unpacking-{os.getpid()}"
        try:
            tar.extractall(tmp, members=members, filter="data")
            if dest.exists():
                raise RunDirError(f"{dest} appeared while unpacking; it is left as it was")
            os.rename(tmp / m.run, dest)
        except unreadable as err:
            raise RunDirError(f"{parts_dir}: unpacking failed ({type(err).__name__}: {str(err)[:100]}); "
                              f"nothing was written under {into}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if made and not dest.exists():
                with suppress(OSError):
                    into.rmdir()  # the folder made for it, empty again
    return dest
