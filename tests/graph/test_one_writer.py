"""One writer per run directory and per `eval --out`: a second `run`/`resume`/`eval` is refused in one line naming
the holder's pid and start time, with nothing changed; a lock left by a dead process is taken over; a decision
is recorded once. A stopped `eval` still reports what it finished."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from paths import SUPPORT

from trace_rl.core.io import Busy
from trace_rl.core.rundir import RunDir, RunDirError

CLI = [sys.executable, "-m", "trace_rl.graph.cli"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))}
BENCH = '''
from trace_rl.evals.benchmark import Benchmark, Episode, Observation, Score, Task


class Hi(Episode):
    system_prompt = "Say hi."
    tools = []
    max_steps = 2

    def reset(self):
        return Observation([{"role": "user", "content": "hi"}])

    def step(self, content, tool_calls):
        return Observation([], done=True, reason="agent_stop")

    def score(self, termination):
        return Score(1.0, True, {})


class Six(Benchmark):
    name = "six"

    def splits(self):
        return ["test"]

    def tasks(self, split):
        return [Task(f"t{i}", self.name, split) for i in range(6)]

    def episode(self, task_id, **_):
        return Hi()
'''


def holder(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s writer lock until killed."""
    code = ("import sys, time; from trace_rl.core.rundir import RunDir\n"
            f"with RunDir({str(folder)!r}).writer():\n    print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def files(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_ones_lock_is_taken_over(tmp_path):
    proc = holder(tmp_path / "run")
    try:
        with pytest.raises(Busy, match=rf"in use by pid {proc.pid} \(started 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d\)"):
            with RunDir(tmp_path / "run").writer():
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RunDir(tmp_path / "run").writer():  # the dead process's lock: taken over
        assert (tmp_path / "run" / "run.lock").read_text().split()[0] == str(os.getpid())
        with RunDir(tmp_path / "run").writer():  # re-entrant in the holder
            pass


def test_resume_and_eval_out_are_refused_while_another_process_writes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    from graph_doubles import config

    (run / "config.json").write_text(json.dumps(config().model_dump(), default=str))
    (tmp_path / "six.py").write_text(BENCH)
    out = tmp_path / "eval-out"
    procs = [holder(run), holder(out)]
    try:
        before = files(tmp_path)
        for args, pid in ((["resume", run, "--no-wait"], procs[0].pid),
                          (["eval", "--benchmark", f"{tmp_path / 'six.py'}:Six", "--base-url", "http://127.0.0.1:9/v1",
                            "--model", "m", "--out", out], procs[1].pid)):
            res = subprocess.run(CLI + [str(a) for a in args], cwd=SUPPORT, env=ENV, capture_output=True, text=True,
                                 timeout=300)
            text = (res.stdout + res.stderr).strip()
            assert res.returncode == 2 and "Traceback" not in text and len(text.splitlines()) == 1, text[-3000:]
            assert f"is in use by pid {pid} (started " in text
        assert files(tmp_path) == before
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


def test_a_decision_is_recorded_once(tmp_path):
    from trace_rl.graph.approvals import read_decisions, record_decision

    record_decision(tmp_path, "env:x@0", {"action": "approve", "by": "cli"})
    with pytest.raises(RunDirError, match="env:x@0 is already decided .* never overwritten"):
        record_decision(tmp_path, "env:x@0", {"action": "reject", "by": "web"})
    assert read_decisions(tmp_path)["env:x@0"]["action"] == "approve"


def test_a_stopped_eval_reports_the_episodes_it_finished(tmp_path, monkeypatch):
    """Ctrl-C in the middle of `trace-rl eval`: report.json (valid JSON) for the episodes that finished, exit 130;
    the same command finishes the rest."""
    import trace_rl.models.llm as llm
    from doubles import ScriptedLLM
    from typer.testing import CliRunner

    from trace_rl.graph.cli import app

    calls = []

    def agent(messages, tools):
        calls.append(1)
        if len(calls) == 3:  # the third episode: the user presses Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
        return "hi"

    monkeypatch.setattr(llm, "served", lambda cfg, *a, **kw: cfg)
    monkeypatch.setattr(llm, "LLM", lambda cfg: ScriptedLLM(agent))
    # a shell's background job starts with SIGINT ignored (nohup, `&`): Ctrl-C is what this test sends
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    (tmp_path / "six.py").write_text(BENCH)
    args = ["eval", "--benchmark", f"{tmp_path / 'six.py'}:Six", "--model", "m", "--out", str(tmp_path / "out")]
    try:
        res = CliRunner().invoke(app, args)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert res.exit_code == 130, res.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["stopped"].startswith("interrupted after") and "of 6 episodes" in report["stopped"]
    assert 2 <= report["groups"]["six[test]"]["episodes"] < 6
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["groups"]["six[test]"]["episodes"] == 6 and "stopped" not in report
