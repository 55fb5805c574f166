"""`trace-rl unpack` reads an archive it did not write: every refusal is one line naming the member and the
reason, made before anything is written; nothing lands outside the target, no run is replaced."""
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from trace_rl.core.rundir import RunDir, RunDirError, unpack

CLI = [sys.executable, "-m", "trace_rl.graph.cli"]


def archive(folder: Path, members: list[tuple[tarfile.TarInfo, bytes | None]] = (), run: str = "r",
            data: bytes | None = None, manifest: dict | None = None) -> Path:
    """Parts and a manifest as `trace-rl pack` writes them, of whatever the test puts in."""
    folder.mkdir(parents=True)
    if data is None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for ti, content in members:
                tar.addfile(ti, io.BytesIO(content) if content is not None else None)
        data = buf.getvalue()
    (folder / f"{run}.tgz.00").write_bytes(data)
    (folder / "x.tgz.json").write_text(json.dumps(manifest if manifest is not None else {
        "run": run, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "parts": [f"{run}.tgz.00"]}))
    return folder


def file(name: str, content: bytes = b"{}") -> tuple:
    ti = tarfile.TarInfo(name)
    ti.size = len(content)
    return ti, content


def special(name: str, kind: bytes, target: str = "") -> tuple:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = kind, target
    return ti, None


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


GOOD = [file("r/config.json")]


@pytest.mark.parametrize("extra, says", [
    ([file("other/config.json", b"overwritten")], "member 'other/config.json' is outside the run's root 'r'"),
    ([file("/tmp/abs-member")], "member '/tmp/abs-member' is an absolute path"),
    ([file("r/../../escaped")], "member 'r/../../escaped' is a '..' component"),
    ([special("r/l", tarfile.SYMTYPE, "/etc/passwd")], "member 'r/l' is a link"),
    ([special("r/h", tarfile.LNKTYPE, "r/config.json")], "member 'r/h' is a link"),
    ([special("r/dev", tarfile.CHRTYPE)], "member 'r/dev' is a device"),
    ([special("r/pipe", tarfile.FIFOTYPE)], "member 'r/pipe' is a fifo"),
])
def test_a_hostile_member_is_refused_before_anything_is_written(tmp_path, extra, says):
    parts = archive(tmp_path / "parts", GOOD + extra)
    into = tmp_path / "runs"
    (into / "other").mkdir(parents=True)
    (into / "other" / "config.json").write_text("precious")
    before = tree(tmp_path)
    with pytest.raises(RunDirError, match="refused, nothing was written") as err:
        unpack(parts, into)
    assert says in str(err.value) and "\n" not in str(err.value)
    assert tree(tmp_path) == before  # the other run's config.json intact, nothing beside it


@pytest.mark.parametrize("manifest, says", [
    ({"run": "../elsewhere", "bytes": 1, "sha256": "0" * 64, "parts": ["r.tgz.00"]}, "field run:"),
    ({"run": "r", "bytes": 1, "sha256": "0" * 64, "parts": ["../../etc/passwd"]}, "field parts:"),
    ({"run": "r", "sha256": "0" * 64, "parts": ["r.tgz.00"]}, "field bytes: Field required"),
    ({"run": "r", "bytes": "many", "sha256": "0" * 64, "parts": ["r.tgz.00"]}, "field bytes:"),
    ([1, 2], "field (top level):"),
])
def test_a_manifest_of_the_wrong_shape_names_its_field(tmp_path, manifest, says):
    parts = archive(tmp_path / "parts", GOOD, manifest=manifest)
    with pytest.raises(RunDirError, match="pack the run again") as err:
        unpack(parts, tmp_path / "runs")
    assert says in str(err.value) and not (tmp_path / "runs").exists()


def test_the_run_name_must_be_the_archives_root(tmp_path):
    parts = archive(tmp_path / "parts", [file("s/config.json")], run="r")
    with pytest.raises(RunDirError, match="member 's/config.json' is outside the run's root 'r'"):
        unpack(parts, tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_truncated_or_non_gzip_parts_are_one_line_and_leave_nothing(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for ti, c in GOOD + [file("r/big", os.urandom(200_000))]:
            tar.addfile(ti, io.BytesIO(c))
    for name, data in (("truncated", buf.getvalue()[:100_000]), ("plain", b"not gzip" * 100)):
        parts = archive(tmp_path / name, data=data)  # a manifest that matches: only the archive is bad
        with pytest.raises(RunDirError, match="not a readable gzipped tar .*nothing was written") as err:
            unpack(parts, tmp_path / "runs")
        assert "\n" not in str(err.value)
        assert not (tmp_path / "runs").exists()


def test_an_archive_larger_than_the_free_space_is_refused_first(tmp_path, monkeypatch):
    import shutil

    parts = archive(tmp_path / "parts", GOOD + [file("r/big", b"x" * 3_000_000)])
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 20, 9 << 20, 1 << 20))
    with pytest.raises(RunDirError, match="unpacks to 3.0 MB, .* has 1.0 MB free; free some space"):
        unpack(parts, tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_failure_while_extracting_leaves_no_half_run(tmp_path, monkeypatch):
    parts = archive(tmp_path / "parts", GOOD + [file("r/a"), file("r/b")])
    real = tarfile.TarFile.extractall

    def disk_full(self, path, members=None, **kw):  # the first member written, then the disk is full
        real(self, path, members=members[:1], **kw)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tarfile.TarFile, "extractall", disk_full)
    (tmp_path / "runs").mkdir()
    with pytest.raises(RunDirError, match="unpacking failed .*No space left"):
        unpack(parts, tmp_path / "runs")
    assert list((tmp_path / "runs").iterdir()) == []  # no temp folder, no half run


def test_an_existing_run_is_never_replaced_and_the_cli_says_how_to_proceed(tmp_path):
    parts = archive(tmp_path / "parts", GOOD)
    assert unpack(parts, tmp_path / "runs") == tmp_path / "runs" / "r"
    assert (tmp_path / "runs" / "r" / "config.json").read_text() == "{}"
    (tmp_path / "runs" / "r" / "config.json").write_text("mine")
    out = subprocess.run(CLI + ["unpack", str(parts), "--into", str(tmp_path / "runs")], capture_output=True,
                         text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert "exists and is never replaced; move it away, or unpack with --into another folder" in text
    assert (tmp_path / "runs" / "r" / "config.json").read_text() == "mine"


def test_a_hostile_archive_through_the_cli_is_one_line_exit_2(tmp_path):
    parts = archive(tmp_path / "parts", GOOD + [special("r/l", tarfile.SYMTYPE, "/etc/passwd")])
    out = subprocess.run(CLI + ["unpack", str(parts), "--into", str(tmp_path / "runs")], capture_output=True,
                         text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert "member 'r/l' is a link" in text and not (tmp_path / "runs").exists()


def test_a_packed_run_round_trips_without_its_lock(tmp_path):
    run = RunDir(tmp_path / "r")
    (run.root / "iter_0").mkdir(parents=True)
    (run.root / "iter_0" / "x.txt").write_text("kept")
    with run.writer():
        run.pack(tmp_path / "parts")
    moved = unpack(tmp_path / "parts", tmp_path / "there")
    assert (moved / "iter_0" / "x.txt").read_text() == "kept" and not (moved / "run.lock").exists()


def test_a_killed_unpacks_hidden_folder_is_removed_by_the_next_and_a_live_ones_kept(tmp_path):
    runs = tmp_path / "runs"
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()  # its pid is gone: the folder it left is debris
    (runs / f".r.unpacking-{killed.pid}" / "r").mkdir(parents=True)
    live = runs / f".r.unpacking-{os.getppid()}"  # a process that is alive: an unpack still under way
    live.mkdir()
    other = runs / f".q.unpacking-{killed.pid}"  # another run's: not this unpack's to judge
    other.mkdir()
    assert unpack(archive(tmp_path / "parts", GOOD), runs) == runs / "r"
    assert sorted(p.name for p in runs.iterdir()) == sorted(["r", live.name, other.name])
