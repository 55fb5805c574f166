"""Bad input to the CLI and damaged run directories: one line, exit code 2, no traceback,
nothing on disk changed."""
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from paths import SUPPORT

CLI = [sys.executable, "-m", "trace_rl.graph.cli"]
PYTHONPATH = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))  # children import what we do


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def run_dir(tmp_path: Path, damage: str) -> Path:
    """A run directory (config.json from the doubles' config) with one file damaged."""
    from graph_doubles import config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config().model_dump(), default=str))
    if damage == "garbage-sqlite":
        (run / "graph.sqlite").write_bytes(os.urandom(4096))
    elif damage == "empty-sqlite":
        (run / "graph.sqlite").write_bytes(b"")
    elif damage == "truncated-sqlite":
        con = sqlite3.connect(run / "graph.sqlite")
        con.execute("CREATE TABLE t (x TEXT)")
        con.executemany("INSERT INTO t VALUES (?)", [("x" * 500,)] * 2000)
        con.commit()
        con.close()
        data = (run / "graph.sqlite").read_bytes()
        (run / "graph.sqlite").write_bytes(data[: len(data) // 3])
    elif damage == "bad-config":
        (run / "config.json").write_text('{"benchmark": "cities", "grpo": {"stepz": 1}')
    elif damage == "bad-pending":
        (run / "pending.json").write_text("{not json")
    elif damage == "bad-approvals":
        (run / "approvals.json").write_text("[1, 2")
    return run


@pytest.mark.parametrize("damage, command", [
    ("garbage-sqlite", "status"), ("garbage-sqlite", "resume"), ("empty-sqlite", "status"),
    ("truncated-sqlite", "resume"), ("bad-config", "status"), ("bad-config", "resume"),
    ("bad-pending", "approve"), ("bad-approvals", "approve"), ("bad-approvals", "resume"),
])
def test_a_damaged_run_directory_is_one_line_and_untouched(tmp_path, damage, command):
    run = run_dir(tmp_path, damage)
    before = snapshot(run)
    out = subprocess.run(CLI + [command, str(run), "--no-wait"] if command == "resume" else CLI + [command, str(run)],
                         cwd=SUPPORT, env={**os.environ, "PYTHONPATH": PYTHONPATH}, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text, text[-3000:]
    assert text.strip().startswith("error:") and len(text.strip().splitlines()) <= 3, text
    assert snapshot(run) == before


@pytest.mark.parametrize("args, says", [
    (["run", "--set", "grpo=1", "--set", "grpo.steps=2"], "set either the section or fields inside it"),
    (["run", "--set", "benchmark=[1,2"], "not valid YAML"),
    (["run", "--set", "grpo.stepz=3"], "did you mean `grpo.steps`"),
    (["run", "--set", "verify.band=[0.9, 0.1]"], "band must be [low, high]"),
    (["run", "-c", "CONFIG"], "not UTF-8"),
    (["run", "--preset", "demo", "--run-dir", "FILE", "--no-wait"], "is a file, not a run directory"),
    (["eval", "--trials", "0"], "--trials"),
    (["eval", "--tasks", "-1"], "--tasks"),
])
def test_bad_cli_input_is_one_error_and_exit_2(tmp_path, args, says):
    (tmp_path / "bad.yaml").write_bytes(b"benchmark: \xff\xfe tau2\n")
    (tmp_path / "afile").write_text("not a directory")
    args = [str(tmp_path / "bad.yaml") if a == "CONFIG" else str(tmp_path / "afile") if a == "FILE" else a for a in args]
    before = snapshot(tmp_path)
    out = subprocess.run(CLI + args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text and says in text, text[-3000:]
    assert snapshot(tmp_path) == before and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["run", "resume"])
def test_an_unknown_until_node_is_one_line_naming_the_nodes(tmp_path, command):
    from trace_rl.graph.pipeline import NODES

    run = run_dir(tmp_path, "none")
    before = snapshot(tmp_path)
    args = ["resume", str(run)] if command == "resume" else ["run", "--run-dir", str(tmp_path / "new")]
    out = subprocess.run(CLI + args + ["--until", "nonsense"], cwd=SUPPORT, env={**os.environ, "PYTHONPATH": PYTHONPATH},
                         capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text and len(text.strip().splitlines()) == 1, text[-3000:]
    assert text.startswith("error: --until 'nonsense'") and ", ".join(NODES) in text
    assert snapshot(tmp_path) == before and not (tmp_path / "new").exists()
