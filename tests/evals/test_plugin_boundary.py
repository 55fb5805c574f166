"""A benchmark plugin is untrusted: whatever its episode raises, returns or hangs on ends that episode as a
recorded termination, the rollout goes on with the next one, and nothing non-finite reaches a report.
(An episode whose step failed is still scored, with termination env_error: the plugin decides what that is
worth, as τ²'s evaluator does; one that hung is not asked again.)"""
import json
import math
import time

import pytest

from doubles import ScriptedLLM
from trace_rl.core.episode import Episode, EpisodeFault, Guarded, Observation, Score
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.benchmark import Benchmark, Task
from trace_rl.evals.rollout import rollout


class Plain(Episode):
    system_prompt, tools = "Answer.", []

    def reset(self):
        return Observation([{"role": "user", "content": "hi"}])

    def step(self, content, tool_calls):
        return Observation([], done=True, reason="agent_stop")

    def score(self, termination):
        return Score(1.0, True)


def broken(**overrides):
    """A Plain episode with some of its methods (or attributes) replaced."""
    ep = Plain()
    for name, value in overrides.items():
        setattr(ep, name, value)
    return ep


def _exit(*_):
    raise SystemExit(3)


def _hang(*_):
    time.sleep(30)


CASES = {
    "reset raises": (dict(reset=lambda: 1 / 0), "env_error", "ZeroDivisionError"),
    "step raises": (dict(step=lambda c, t: {}["x"]), "env_error", "KeyError"),
    "step exits": (dict(step=_exit), "env_error", "SystemExit"),
    "step returns None": (dict(step=lambda c, t: None), "env_error", "not an Observation"),
    "step returns a dict": (dict(step=lambda c, t: {"messages": []}), "env_error", "not an Observation"),
    "messages are strings": (dict(step=lambda c, t: Observation(["hello"])), "env_error", "not a list of"),
    "step hangs": (dict(step=_hang), "env_timeout", "did not return within"),
    "score raises": (dict(score=lambda term: 1 / 0), "env_error", "ZeroDivisionError"),
    "score is a dict": (dict(score=lambda term: {"reward": 1}), "env_error", "not a Score"),
    "reward is a string": (dict(score=lambda term: Score("1", True)), "env_error", "finite number"),
    "reward is NaN": (dict(score=lambda term: Score(math.nan, False)), "env_error", "finite number"),
    "passed is a string": (dict(score=lambda term: Score(1.0, "yes")), "env_error", "a bool is required"),
    "tools is a string": (dict(tools="search"), "env_error", "tools is str"),
    "max_steps is zero": (dict(max_steps=0), "env_error", "max_steps is 0"),
    "system_prompt is a number": (dict(system_prompt=3), "env_error", "system_prompt is int"),
    "text_tool_calls is a string": (dict(text_tool_calls="no"), "env_error", "text_tool_calls is str"),
}


class Misbehaving(Benchmark):
    """Task i plays CASES' i-th misbehaviour; task `ok` is well behaved."""
    name = "misbehaving"

    def splits(self):
        return ["test"]

    def tasks(self, split):
        return [Task(k, self.name, split) for k in [*CASES, "ok"]]

    def episode(self, task_id, hinted=False):
        return Plain() if task_id == "ok" else broken(**CASES[task_id][0])


def test_every_misbehaviour_is_a_recorded_termination_and_the_run_goes_on(tmp_path):
    store = TrajectoryStore(tmp_path)
    t0 = time.perf_counter()
    trajs = rollout(Misbehaving(), ScriptedLLM(lambda m, t: "done"), [*CASES, "ok"], store, progress=False,
                    concurrency=4, step_timeout_s=1.0)
    assert time.perf_counter() - t0 < 20  # the hung step cost its deadline, not its 30 s
    by_task = {t.task_id: t for t in trajs}
    for name, (_, termination, words) in CASES.items():
        t = by_task[name]
        assert t.termination == termination and words in t.reasons["error"], (name, t.termination, t.reasons)
        if name.startswith(("score", "reward", "passed", "step hangs")) or "reset" in name:
            assert not t.passed and t.reward == 0.0, name  # no score, or one that could not be read
    assert by_task["ok"].passed and by_task["ok"].termination == "agent_stop"
    assert len(store) == len(CASES) + 1
    for line in (tmp_path / "trajectories.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-finite {c} written"))


def test_guarded_passes_a_good_episode_through_unchanged():
    ep = Guarded(Plain(), timeout_s=5)
    assert ep.reset().messages == [{"role": "user", "content": "hi"}]
    assert ep.system_prompt == "Answer." and ep.tools == [] and ep.max_steps == 30
    assert ep.step("x", []).reason == "agent_stop"
    assert ep.score("agent_stop") == Score(1.0, True, {})
    with pytest.raises(EpisodeFault) as err:
        Guarded(broken(score=lambda term: Score(math.inf, True))).score("agent_stop")
    assert err.value.termination == "env_error"


def test_a_close_that_hangs_or_raises_does_not_hold_the_episode():
    t0 = time.perf_counter()
    Guarded(broken(close=_hang), timeout_s=0.5).close()
    Guarded(broken(close=_exit)).close()
    assert time.perf_counter() - t0 < 5


def test_no_non_finite_number_is_written_or_aggregated(tmp_path):
    from trace_rl.core.io import atomic_write_json
    from trace_rl.core.reward import aggregate

    with pytest.raises(ValueError, match="overflow"):
        aggregate({"a": 1.0, "b": 0.5}, {"a": 1e308, "b": 1e308})
    assert aggregate({"a": 1.0, "b": 0.0}, {"a": 1e300, "b": 1e300}) == 0.5
    with pytest.raises(ValueError, match="report.json: refusing to write a non-finite number"):
        atomic_write_json(tmp_path / "report.json", {"mean_reward": math.nan})
    assert not (tmp_path / "report.json").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("body,words", [
    ("def splits(self):\n        return None", "splits() returned None"),
    ("def tasks(self, split):\n        return ['a', 'b']", "not a list of Task"),
    ("def tasks(self, split):\n        raise RuntimeError('db down')", "raised RuntimeError: db down"),
])
def test_a_plugins_splits_and_tasks_of_the_wrong_shape_are_one_line_errors(tmp_path, body, words):
    from trace_rl.evals.benchmark import BenchmarkError, load_benchmark

    (tmp_path / "odd.py").write_text(
        "from trace_rl.evals.benchmark import Benchmark, Task\n\n\nclass Odd(Benchmark):\n    name = 'odd'\n\n"
        "    def splits(self):\n        return ['test']\n\n    def tasks(self, split):\n        return [Task('t', 'odd', split)]\n\n"
        "    def episode(self, task_id, hinted=False):\n        raise NotImplementedError\n\n    " + body + "\n")
    bench = load_benchmark(f"{tmp_path / 'odd.py'}:Odd")
    with pytest.raises(BenchmarkError, match=words.replace("(", r"\(").replace(")", r"\)")):
        bench.tasks(bench.splits()[0]) if "tasks" in body else bench.splits()


def test_an_episode_that_cannot_be_made_is_recorded_and_a_plugin_without_hints_trains(tmp_path):
    from trace_rl.evals.benchmark import hinted_episode

    class NoEpisode(Misbehaving):
        def episode(self, task_id, hinted=False):
            raise OSError("no such fixture")
    (t,) = rollout(NoEpisode(), ScriptedLLM(lambda m, t: "x"), ["ok"], TrajectoryStore(tmp_path), progress=False)
    assert t.termination == "env_error" and "no such fixture" in t.reasons["error"]

    class NoHints(Misbehaving):
        def episode(self, task_id):  # the docs' example: no `hinted` parameter
            return Plain()
    assert isinstance(hinted_episode(NoHints(), "ok", hinted=True), Plain)
