"""Control files of a run directory are read through their models: a file of the wrong shape, a decision that
names a capability that is not pending, a damaged checkpoint, a config naming an unknown benchmark — each is one
line naming the file, the field and the fix, and never a silent PENDING, a traceback or a finished-looking run."""
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from paths import SUPPORT

from graph_doubles import config
from trace_rl.core.rundir import RunDirError
from trace_rl.graph.pipeline import drive

CLI = [sys.executable, "-m", "trace_rl.graph.cli"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))}
CAP = "lookup_before_answering"


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(a) for a in args], cwd=SUPPORT, env=ENV, capture_output=True, text=True,
                          timeout=300)


def one_line_error(out: subprocess.CompletedProcess) -> str:
    text = (out.stdout + out.stderr).strip()
    assert out.returncode == 2 and "Traceback" not in text and len(text.splitlines()) == 1, text[-3000:]
    assert text.startswith("error:"), text
    return text


def files(run: Path) -> dict:
    """What is in the run (SQLite's shared-memory index, rewritten by any reader, left out)."""
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and not p.name.endswith("-shm")}


def cfg():
    return config(auto_approve=False, approvals=["capabilities"])


@pytest.fixture(scope="module")
def waiting(tmp_path_factory) -> Path:
    """A run stopped at the capability approval (rollout and analysis on scripted models; no Docker)."""
    run = tmp_path_factory.mktemp("waiting") / "run"
    out = drive(run, cfg(), resume=False, wait=False, log=lambda *a: None)
    assert out["status"] == "waiting" and out["pending"]["id"] == "capabilities@0"
    return run


@pytest.fixture
def run(waiting, tmp_path) -> Path:
    shutil.copytree(waiting, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("decision, says", [
    ({"approve": ["ghost"], "reject": {}}, "names 'ghost', which is not pending (pending: lookup_before_answering)"),
    ({"approve": [CAP], "reject": {"ghost": "x"}}, "names 'ghost', which is not pending"),
    ({"approve": []}, f"neither approves nor rejects '{CAP}'"),
    ({"action": "approve"}, "has no approve list"),
])
def test_an_approval_naming_no_pending_capability_stops_the_run(run, decision, says):
    (run / "approvals.json").write_text(json.dumps({"capabilities@0": decision}))
    with pytest.raises(RunDirError) as err:
        drive(run, cfg(), resume=True, wait=False, log=lambda *a: None)
    assert f"approvals.json: the decision on capabilities@0 {says}" in str(err.value)
    assert "fix or remove that entry, then `trace-rl approve" in str(err.value)
    assert json.loads((run / "approvals.json").read_text()) == {"capabilities@0": decision}  # kept as written
    assert not (run / "envs").exists()  # nothing went on as if decided


@pytest.mark.parametrize("decision, says", [
    ({"approve": "all"}, "field capabilities@0."),
    ("yes", "field capabilities@0."),
    ({"action": "maybe"}, "field capabilities@0."),
])
def test_a_decision_that_cannot_be_read_is_one_line_before_anything_changes(run, decision, says):
    (run / "approvals.json").write_text(json.dumps({"capabilities@0": decision}))
    before = files(run)
    text = one_line_error(cli("resume", run, "--no-wait"))
    assert "approvals.json: " + says in text and "fix or remove that entry" in text
    assert files(run) == before


def test_a_wrong_pending_file_and_stages_file_name_their_field(run):
    (run / "pending.json").write_text(json.dumps({"id": 7, "kind": "capabilities", "title": "t"}))
    text = one_line_error(cli("approve", run))
    assert "pending.json: field id: Input should be a valid string" in text and "remove it" in text
    (run / "pending.json").unlink()
    (run / "stages.json").write_text(json.dumps(["rollout"]))
    text = one_line_error(cli("resume", run, "--no-wait"))
    assert "stages.json: field (top level): Input should be a valid dictionary" in text
    assert not (run / "stale").exists()


def test_a_capabilities_file_of_the_wrong_shape_names_its_field(run):
    caps = run / "iter_0" / "analysis" / "capabilities.json"
    data = json.loads(caps.read_text())
    data["capabilities"][0]["cov_mean"] = "high"
    caps.write_text(json.dumps(data))
    text = one_line_error(cli("build", run))
    assert "capabilities.json: field capabilities.0.cov_mean: Input should be a valid number" in text
    assert "run the analysis again" in text


def test_resume_refuses_a_config_naming_an_unknown_benchmark_before_retiring_anything(run):
    config_json = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config_json, "benchmark": "nope:x"}))
    text = one_line_error(cli("resume", run, "--no-wait"))
    assert "config.json: benchmark: unknown benchmark 'nope:x'" in text
    assert not (run / "stale").exists() and (run / "iter_0" / "rollouts").is_dir()


def test_a_checkpoint_with_damaged_state_is_one_line_saying_how_to_recover(run):
    con = sqlite3.connect(run / "graph.sqlite")
    con.execute("UPDATE checkpoints SET checkpoint = X'c1c1c1ff00'")
    con.commit()
    con.close()
    for command in (["status", run], ["resume", run, "--no-wait"]):
        text = one_line_error(cli(*command))
        assert "graph.sqlite: the checkpoint cannot be read" in text and "move graph.sqlite* away" in text


def test_status_never_calls_an_empty_or_missing_checkpoint_finished(tmp_path, run):
    for f in run.glob("graph.sqlite*"):  # the database and its WAL files (a WAL left beside it would be replayed)
        f.unlink()
    con = sqlite3.connect(run / "graph.sqlite")  # a database holding no state at all
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    out = cli("status", run)
    assert out.returncode == 0 and "not started (the checkpoint holds no state)" in out.stdout, out.stdout + out.stderr
    assert "finished" not in out.stdout
    for f in run.glob("graph.sqlite*"):
        f.unlink()
    out = cli("status", run)
    assert "not started (no checkpoint)" in out.stdout and "finished" not in out.stdout
    assert not (run / "graph.sqlite").exists()  # status reads; it made no checkpoint
