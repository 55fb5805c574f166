import pytest
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from doubles import ScriptedLLM, endpoint_error
from tau2_gold import gold_actions
from trace_rl.agents.base_agent import run_episode
from trace_rl.models.chat import ToolCall
from trace_rl.evals.benchmark import load_benchmark
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.rollout import rollout
from trace_rl.evals.tau2_bench import Tau2Benchmark
from paths import ROOT


class TaggedTelecom(Tau2Benchmark):
    """telecom with the task id appended to the system prompt, so a scripted policy can
    look up that task's gold actions (tickets alone repeat across tasks)."""

    def __init__(self):
        super().__init__("telecom")

    def episode(self, task_id, **kw):
        ep = super().episode(task_id, **kw)
        ep.system_prompt += f"\n<task_id>{task_id}</task_id>"
        return ep


def gold_policy(bench):
    """Replays a task's gold actions, then calls `done` (a test double of a perfect agent)."""
    def script(messages, tools):
        tid = messages[0]["content"].rsplit("<task_id>", 1)[1].split("</task_id>")[0]
        n_done = sum(1 for m in messages if m["role"] == "assistant")
        gold = gold_actions(bench, tid)
        if n_done < len(gold):
            fn = gold[n_done]["function"]
            return ToolCall(fn["name"], json.loads(fn["arguments"]))
        return ToolCall("done", {})
    return ScriptedLLM(script, name="gold")


def test_run_episode_records_everything():
    b = TaggedTelecom()
    tid = b.tasks("test")[0].id
    traj = run_episode(gold_policy(b), b.episode(tid), task_id=tid, benchmark=b.name)
    assert traj.passed and traj.reward == 1.0 and traj.termination == "agent_stop"
    assert traj.messages[0]["role"] == "system" and traj.tool_calls == traj.steps
    assert traj.prompt_tokens == 10 * traj.steps


def test_max_steps_and_malformed_are_outcomes_not_crashes():
    b = load_benchmark("tau2:telecom")
    tid = b.tasks("test")[0].id
    loop = ScriptedLLM(lambda m, t: ToolCall("get_customer_by_phone", {"__malformed__": "{bad"}))
    traj = run_episode(loop, b.episode(tid), task_id=tid, benchmark=b.name, max_steps=4)
    assert traj.termination == "max_steps" and traj.steps == 4 and traj.malformed_tool_calls == 4
    assert not traj.passed

    def overflow(code):  # llama-cpp-python's server sets the code; vLLM's 400 has only the message
        def boom(m, t):
            raise endpoint_error(400, "This model's maximum context length is 4096 tokens", code)
        return ScriptedLLM(boom)
    for code in ("context_length_exceeded", None):
        traj = run_episode(overflow(code), b.episode(tid), task_id=tid, benchmark=b.name)
        assert traj.termination == "context_length" and "maximum context" in traj.reasons["error"]

    def refused(m, t):
        raise endpoint_error(500, "This model's maximum context length is 4096 tokens")
    traj = run_episode(ScriptedLLM(refused), b.episode(tid), task_id=tid, benchmark=b.name)
    assert traj.termination == "llm_error"  # only a 400 is a context overflow

    text = run_episode(ScriptedLLM(["I think it is fixed."]), b.episode(tid), task_id=tid, benchmark=b.name)
    assert text.termination == "agent_error"  # solo agents may only call tools


def test_a_reader_never_changes_the_store_and_the_writer_repairs_a_torn_tail(tmp_path):
    b = TaggedTelecom()
    ids = [t.id for t in b.tasks("test")[:2]]
    store = TrajectoryStore(tmp_path)
    rollout(b, gold_policy(b), ids, store, progress=False)
    with open(store.path, "ab") as f:
        f.write(b'{"task_id": "half-writ')
    before = store.path.read_bytes()
    again = TrajectoryStore(tmp_path)
    assert len(again) == 2 and store.path.read_bytes() == before  # the reader kept every byte
    rollout(b, gold_policy(b), [t.id for t in b.tasks("test")[2:3]], again, progress=False)  # the writer appends
    text = store.path.read_bytes()
    assert b"half-writ" not in text and len(text.splitlines()) == 3
    quarantined = [json.loads(l) for l in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert quarantined == [{"line": "torn-tail", "text": '{"task_id": "half-writ', "store": "trajectories.jsonl"}]
    assert json.loads(store.index_path.read_text())["count"] == 3 == len(TrajectoryStore(tmp_path))


@pytest.mark.parametrize("bad", [b"not json at all", b"[]", b'{"task_id": 1}', b"\xff\xfe binary"])
def test_a_bad_line_is_skipped_quarantined_once_and_nothing_is_lost(tmp_path, bad):
    """A corrupt line 2 of 6: the other 5 load, the file keeps all 6 lines, the line is kept
    verbatim in quarantine.jsonl once however often the store is read, and index.json agrees."""
    b = TaggedTelecom()
    store = TrajectoryStore(tmp_path)
    rollout(b, gold_policy(b), [t.id for t in b.tasks("test")[:3]], store, trials=2, progress=False)
    lines = store.path.read_bytes().splitlines(keepends=True)
    lines[1] = bad + b"\n"
    store.path.write_bytes(b"".join(lines))
    damaged = store.path.read_bytes()
    logged = []
    for _ in range(3):
        again = TrajectoryStore(tmp_path, log=logged.append)
    assert len(again) == 5 and store.path.read_bytes() == damaged
    assert len(logged) == 1 and "line" in logged[0] and "2" in logged[0]  # reported once
    q = [json.loads(l) for l in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert len(q) == 1 and q[0]["line"] == 2 and q[0]["text"] == bad.decode(errors="replace")
    rollout(b, gold_policy(b), [t.id for t in b.tasks("test")[:4]], again, trials=2, progress=False)  # resume
    index = json.loads(store.index_path.read_text())
    assert index["count"] == 8 == len(TrajectoryStore(tmp_path)) and len(store.path.read_bytes().splitlines()) == 9


KILLABLE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_rollout import TaggedTelecom, gold_policy
    from trace_rl.core.trajectory import TrajectoryStore
    from trace_rl.evals.rollout import rollout
    b = TaggedTelecom()
    pol = gold_policy(b)
    inner = pol._complete
    def slow(*a, **k):
        time.sleep(0.05)
        return inner(*a, **k)
    pol._complete = slow
    ids = [t.id for t in b.tasks("test")[:{n}]]
    rollout(b, pol, ids, TrajectoryStore({out!r}), trials=2, concurrency=2, progress=False)
""")


def test_resume_after_kill_loses_and_duplicates_nothing(tmp_path):
    n = 6
    script = KILLABLE.format(tests=str(Path(__file__).parent), n=n, out=str(tmp_path))  # support: on PYTHONPATH
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.time() + 300
    jsonl = tmp_path / "trajectories.jsonl"
    while time.time() < deadline and (not jsonl.exists() or jsonl.read_text().count("\n") < 3):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = TrajectoryStore(tmp_path).all()
    assert 3 <= len(done_before) < 2 * n, "kill landed mid-run"
    before = {t.key: t.started_at for t in done_before}
    b = TaggedTelecom()
    ids = [t.id for t in b.tasks("test")[:n]]
    out = rollout(b, gold_policy(b), ids, TrajectoryStore(tmp_path), trials=2, progress=False)
    assert len(out) == 2 * n and all(t.passed for t in out)
    lines = [json.loads(l) for l in jsonl.read_text().splitlines()]
    keys = [f"{l['benchmark']}/{l['task_id']}/{l['trial']}" for l in lines]
    assert len(keys) == len(set(keys)) == 2 * n  # nothing lost, nothing twice
    assert all(t.started_at == before[t.key] for t in out if t.key in before)  # finished ones not rerun


def test_report_figures(tmp_path):
    from trace_rl.core.trajectory import Trajectory
    from trace_rl.evals.report import pass_hat_k, summarize, wilson, write_report

    def t(task, trial, ok):
        return Trajectory(task_id=task, benchmark="b", trial=trial, model="m", messages=[], reward=float(ok),
                          passed=ok, termination="agent_stop", split="test")
    trajs = [t("a", 0, True), t("a", 1, True), t("b", 0, True), t("b", 1, False)]
    figs = summarize(trajs)["b[test]"]
    assert figs["pass@1"] == 0.75 and figs["tasks"] == 2
    assert figs["pass^k"][2] == 0.5  # only task a passes both trials
    assert pass_hat_k({"x": [True, False, True]}, 2) == 1 / 3
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and 0.2 < hi < 0.35
    write_report(trajs, tmp_path, "t")
    assert (tmp_path / "report.png").stat().st_size > 1000
    assert json.loads((tmp_path / "report.json").read_text())["groups"]["b[test]"]["passed"] == 3


def test_demo_sample_shows_real_model_turns():
    """The committed demo run holds real model output, and the demo prints it."""
    from trace_rl.core.rundir import RunDir
    from trace_rl.graph.cli import rollout_trajectories, sample_turns

    trajs = rollout_trajectories(RunDir(ROOT / "docs" / "examples" / "telecom"))
    assert len(trajs) == 3 and all(t.model == "qwen2.5-coder-0.5b" and t.steps > 0 for t in trajs)
    text = sample_turns(trajs[0])
    assert "agent> get_customer_by_phone(" in text


class BrokenEpisode:
    """An environment that fails: at reset, or at its first step."""
    system_prompt, tools, max_steps = "s", [], 5

    def __init__(self, fail_at):
        self.fail_at, self.closed = fail_at, False

    def reset(self):
        from trace_rl.evals.benchmark import Observation

        if self.fail_at == "reset":
            raise ConnectionError("user simulator unreachable")
        return Observation([{"role": "user", "content": "hi"}])

    def step(self, content, tool_calls):
        raise ConnectionError("user simulator unreachable")

    def score(self, termination):
        from trace_rl.evals.benchmark import Score

        return Score(0.0, False, {"termination": termination})

    def close(self):
        self.closed = True


def test_environment_failures_are_recorded_outcomes():
    for where in ("reset", "step"):
        ep = BrokenEpisode(where)
        traj = run_episode(ScriptedLLM(["hello"] * 3), ep, task_id="t", benchmark="b")
        assert traj.termination == "env_error" and not traj.passed and ep.closed
        assert "user simulator unreachable" in traj.reasons["error"]


def test_a_whole_last_episode_without_its_newline_is_kept(tmp_path):
    b = TaggedTelecom()
    store = TrajectoryStore(tmp_path)
    rollout(b, gold_policy(b), [t.id for t in b.tasks("test")[:2]], store, progress=False)
    store.path.write_bytes(store.path.read_bytes().rstrip(b"\n"))  # e.g. a hand-edited file
    again = TrajectoryStore(tmp_path)
    assert len(again) == 2
    rollout(b, gold_policy(b), [t.id for t in b.tasks("test")[:3]], again, progress=False)
    assert len(TrajectoryStore(tmp_path)) == 3 and not (tmp_path / "quarantine.jsonl").exists()


def test_mean_reward_interval_resamples_tasks_and_brackets_the_mean():
    """A graded benchmark reports its mean similarity with a 95% interval: a task's trials move together
    (task-level bootstrap), one task's interval is that task's mean, and identical rewards give a point."""
    from trace_rl.evals.report import mean_ci

    assert mean_ci({"a": [0.4, 0.4], "b": [0.4]}) == pytest.approx((0.4, 0.4))
    assert mean_ci({"only": [0.2, 0.6]}) == pytest.approx((0.4, 0.4))
    rewards = {f"t{i}": [i / 20] for i in range(20)}  # 0.00 .. 0.95, mean 0.475
    lo, hi = mean_ci(rewards)
    assert lo < 0.475 < hi and 0.3 < lo and hi < 0.65
    assert mean_ci(rewards) == (lo, hi)  # fixed seed


@pytest.mark.parametrize("field,value", [("reward", "1"), ("reward", float("nan")), ("passed", "yes"),
                                         ("messages", ["hello"]), ("trial", None), ("reasons", [])])
def test_a_stored_line_of_the_wrong_shape_is_quarantined_and_its_episode_redone(tmp_path, field, value):
    """A line that is JSON but not a trajectory (a string reward, NaN, bare-string messages...) would crash a
    later stage: it is quarantined like garbage, and the resume plays that episode again."""
    b = TaggedTelecom()
    store = TrajectoryStore(tmp_path)
    rollout(b, gold_policy(b), [t.id for t in b.tasks("test")[:2]], store, progress=False)
    lines = store.path.read_text().splitlines()
    d = json.loads(lines[0])
    d[field] = value
    lines[0] = json.dumps(d)
    store.path.write_text("\n".join(lines) + "\n")
    logged = []
    again = TrajectoryStore(tmp_path, log=logged.append)
    assert len(again) == 1 and len(logged) == 1
    trajs = rollout(b, gold_policy(b), [t.id for t in b.tasks("test")[:2]], again, progress=False)
    assert [t.passed for t in trajs] == [True, True] and len(TrajectoryStore(tmp_path)) == 2


def test_one_process_appends_to_a_store_and_a_second_is_refused_in_one_line(tmp_path):
    from trace_rl.core.io import Busy
    from trace_rl.core.trajectory import Trajectory

    episode = lambda tid: Trajectory(task_id=tid, benchmark="b", trial=0, model="m", messages=[], reward=1.0,  # noqa: E731
                                     passed=True, termination="agent_stop")
    mine = TrajectoryStore(tmp_path)
    mine.add(episode("a"))
    TrajectoryStore(tmp_path).add(episode("b"))  # this process again (a stage's second view): the same writer
    other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from trace_rl.core.trajectory import Trajectory, TrajectoryStore
        TrajectoryStore({str(tmp_path)!r}).add(Trajectory(task_id="c", benchmark="b", trial=0, model="m", messages=[],
                                                          reward=0.0, passed=False, termination="agent_stop"))""")],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode != 0 and f"the trajectory store {tmp_path} is in use by pid {os.getpid()}" in other.stderr
    assert Busy.__name__ in other.stderr.strip().splitlines()[-1]
    assert [t.task_id for t in TrajectoryStore(tmp_path).all()] == ["a", "b"]  # reading needs no lock
    del mine
    import gc
    gc.collect()  # every store of this process gone: the lock goes with them
    after = subprocess.run(other.args, capture_output=True, text=True, timeout=120)
    assert after.returncode == 0, after.stderr
    assert [t.task_id for t in TrajectoryStore(tmp_path).all()] == ["a", "b", "c"]
