"""`trace-rl eval` reuses a stored episode only when every setting that changes its result is the same: a changed
model, temperature, step limit or benchmark option is a one-line error naming it (or a new default folder),
`--fresh` starts over, identical settings reuse every episode. Played on docs/benchmarks.md's own example."""
import glob
import json

import pytest

from doubles import ScriptedLLM, cli_main as cli
from test_benchmark_example import block, city_policy

import trace_rl.models.llm


@pytest.fixture
def city(tmp_path, monkeypatch):
    """The docs' example in tmp_path (the working directory); every model the CLI makes is a scripted city agent,
    whose calls are kept in `calls`."""
    (tmp_path / "city.py").write_text(block("# city.py"))
    monkeypatch.chdir(tmp_path)
    calls = []

    def policy(messages, tools):
        calls.append(messages)
        return city_policy(messages, tools)

    def scripted(config, **_):
        return ScriptedLLM(policy, name=config.model)
    monkeypatch.setattr(trace_rl.models.llm, "LLM", scripted)
    return calls


EVAL = ["eval", "--benchmark", "city.py:CityBench", "--split", "test", "--out", "r"]


def episodes(folder="r") -> list[dict]:
    return [json.loads(line) for line in open(f"{folder}/trajectories.jsonl")]


@pytest.mark.parametrize("first, second, setting", [
    ([], ["--model", "qwen2.5-coder-1.5b"], "agent.model"),
    ([], ["--temperature", "0.7"], "agent.temperature"),
    ([], ["--max-steps", "3"], "max_steps"),
    (["--bench-opt", "users=6"], ["--bench-opt", "users=8"], "options.users"),
])
def test_a_changed_setting_never_reuses_an_episode(city, first, second, setting):
    code, text = cli(*EVAL, *first)
    assert code == 0 and len(episodes()) == 3 and all(e["passed"] for e in episodes()), text
    made = len(city)
    code, text = cli(*EVAL, *second)
    assert code == 2 and text.startswith("error:") and len(text.strip().splitlines()) == 1, text
    assert f"({setting}:" in text and "--fresh" in text
    assert len(city) == made and len(episodes()) == 3  # nothing played, nothing written
    before = episodes()
    code, text = cli(*EVAL, *second, "--fresh")
    [aside] = glob.glob("r.old-*")
    assert code == 0 and "moved to" in text and episodes(aside) == before, text
    assert len(city) > made and all(e["settings"] != before[0]["settings"] for e in episodes())


def test_identical_settings_reuse_every_episode(city):
    args = [*EVAL, "--bench-opt", "users=8", "--temperature", "0.3", "--max-steps", "4", "--trials", "2"]
    assert cli(*args)[0] == 0
    asked = len(city)
    stored = episodes()
    code, text = cli(*args)
    assert code == 0 and "pass@1" in text and episodes() == stored and len(city) == asked
    assert len(stored) == 8 and stored[0]["settings"]["max_steps"] == 4


def test_the_default_folder_is_named_after_the_settings(city, tmp_path):
    base = ["eval", "--benchmark", "city.py:CityBench", "--split", "test"]
    assert cli(*base)[0] == 0 and cli(*base, "--temperature", "0.5")[0] == 0 and cli(*base)[0] == 0
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(folders) == 2 and all(f.startswith("eval-city.py_CityBench-test-qwen2.5-coder-0.5b-") for f in folders)


def test_episodes_made_before_settings_were_recorded_are_not_reused(city):
    assert cli(*EVAL)[0] == 0
    lines = [{**e, "settings": {}} for e in episodes()]
    open("r/trajectories.jsonl", "w").write("".join(json.dumps(e) + "\n" for e in lines))
    code, text = cli(*EVAL)
    assert code == 2 and "unrecorded there" in text


def test_the_eval_table_keeps_its_columns_in_a_log(city):
    code, text = cli(*EVAL)
    assert code == 0 and "terminations" in text and "agent_stop=3" in text and "…" not in text


def test_the_pipeline_plays_a_mismatched_episode_again_and_replaces_it(tmp_path):
    """`rollout(strict=False)` (the pipeline's rollout stage, resumed with other weights or benchmark code): the
    episodes made under other settings are played again and the store reads the new ones."""
    from trace_rl.core.trajectory import TrajectoryStore
    from trace_rl.evals.benchmark import load_benchmark
    from trace_rl.evals.rollout import episode_settings, rollout
    from trace_rl.models.llm import LLMConfig

    (tmp_path / "city.py").write_text(block("# city.py"))
    bench = load_benchmark(f"{tmp_path / 'city.py'}:CityBench")
    ids, agent = [t.id for t in bench.tasks("test")], ScriptedLLM(city_policy)
    old = episode_settings(bench, "city", LLMConfig(model="qwen2.5-coder-0.5b"), max_steps=None)
    new = episode_settings(bench, "city", LLMConfig(model="qwen2.5-coder-1.5b"), max_steps=None)
    assert old != new and old["agent"]["model_sha256"] != new["agent"]["model_sha256"]
    rollout(bench, agent, ids[:2], TrajectoryStore(tmp_path / "r"), settings=old, progress=False)
    trajs = rollout(bench, agent, ids, TrajectoryStore(tmp_path / "r"), settings=new, strict=False, progress=False)
    assert [t.settings for t in trajs] == [new] * 3 and len(agent.requests) == 2 * 2 + 3 * 2
    assert [t.settings for t in TrajectoryStore(tmp_path / "r").all()] == [new] * 3
