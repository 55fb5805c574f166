"""The examples of docs/benchmarks.md run as written: the same-venv file by name with an option, through
every command (eval, analyze, the builder's reading of it, train --target), and the worker form in a second
venv; the contract's one-line errors."""
import json
import re
import subprocess
import sys

import pytest

import trace_rl.models.hf_policy
import trace_rl.models.llm
from doubles import ScriptedLLM, cli_main
from trace_rl.models.scripted import ToolCall
from trace_rl.evals.benchmark import load_benchmark
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.rollout import rollout
from paths import ROOT

DOC = (ROOT / "docs" / "benchmarks.md").read_text()


def block(first_line: str) -> str:
    return re.search(r"```python\n" + re.escape(first_line) + r".*?\n(.*?)```", DOC, re.S).group(1)


def city_policy(messages, tools):
    if messages[-1]["role"] == "tool":
        return "They live in " + messages[-1]["content"].split('"city": "')[1].split('"')[0]
    uid = re.search(r"does (\S+) live", messages[-1]["content"]).group(1)
    return ToolCall("get_user", {"user_id": uid}) if tools else f"{uid}? " + {
        "u0": "Paris", "u1": "Lima", "u2": "Oslo", "u3": "Rome"}[uid]


def test_docs_example_benchmark_by_file_name_with_an_option(tmp_path):
    (tmp_path / "city.py").write_text(block("# city.py"))
    bench = load_benchmark(f"{tmp_path / 'city.py'}:CityBench", options={"users": 8})
    assert [t.id for t in bench.tasks("test")] == ["u4", "u5", "u6", "u7"]
    trajs = rollout(bench, ScriptedLLM(city_policy), [t.id for t in bench.tasks("test")], TrajectoryStore(tmp_path / "r"),
                    split="test", progress=False)
    assert [t.passed for t in trajs] == [True] * 4


def test_docs_example_worker_in_a_second_venv(tmp_path):
    (tmp_path / "city_side.py").write_text(block("# city_side.py"))
    (tmp_path / "city_worker.py").write_text(block("# city_worker.py"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    bench = load_benchmark(f"{tmp_path / 'city_worker.py'}:CityWorker",
                           options={"python": str(tmp_path / "venv" / "bin" / "python")})
    try:
        trajs = rollout(bench, ScriptedLLM(city_policy), [t.id for t in bench.tasks("test")],
                        TrajectoryStore(tmp_path / "r"), split="test", concurrency=2, progress=False)
        assert [t.passed for t in trajs] == [True] * 4
    finally:
        bench.close()


def test_docs_example_passes_every_command(tmp_path, monkeypatch):
    """eval (a scripted agent that guesses for odd users), analyze (a scripted analyst), the environment
    builder's reading of the target, and GRPO on the target (a tiny random model): the file as the docs give it."""
    from graph_doubles import agent_script, analyst_script
    from tiny import tiny_model, tiny_tokenizer
    from trace_rl.agents.builders import Target

    (tmp_path / "city.py").write_text(block("# city.py"))
    monkeypatch.chdir(tmp_path)
    roles = {"agent": agent_script, "analyst": analyst_script}
    monkeypatch.setattr(trace_rl.models.llm, "LLM", lambda config, **_: ScriptedLLM(roles[config.model], config.model))
    code, text = cli_main("eval", "--benchmark", "city.py:CityBench", "--split", "train", "--bench-opt", "users=8",
                          "--model", "agent", "--out", "r")
    assert code == 0 and "agent_stop=4" in text and "50.0%" in text, text

    code, text = cli_main("analyze", "r", "--model", "analyst", "--set", "n_candidates=2", "--set", "n_runs=3",
                          "--set", "k=2", "--set", "concurrency=1")
    caps = json.loads(next((tmp_path / "r").rglob("capabilities.json")).read_text())
    assert code == 0 and "lookup_before_answering" in text and caps["trajectories"] == 4, text
    assert "facts without schema checks" not in text  # the benchmark was found by the spec its episodes recorded

    target = Target.of(load_benchmark("city.py:CityBench"))
    assert target.name == "city" and [t["function"]["name"] for t in target.tools] == ["get_user"]
    assert target.system_prompt_format == "Answer with the user's city. Use the tools."

    tok = tiny_tokenizer()
    monkeypatch.setattr(trace_rl.models.hf_policy, "load_model", lambda name: (tiny_model(tok), tok))
    code, text = cli_main("train", "--target", "city.py:CityBench", "--preset", "tiny", "--out", "t")
    assert code == 0 and "grpo_target" in text and "GRPO steps on 3 train tasks" in text, text


@pytest.mark.parametrize("plugin, args, says", [
    ("class Broken(CityBench):\n    def __init__(self, users=6):\n        raise RuntimeError('no data at /x')\n",
     [], "city.py:Broken: building it raised RuntimeError: no data at /x"),
    ("class Fixed(CityBench):\n    fixed_max_steps = 'its rules allow 5 steps'\n",
     ["--max-steps", "3"], "city.py:Fixed: max_steps cannot apply: its rules allow 5 steps"),
])
def test_the_contract_errors_are_one_line(tmp_path, monkeypatch, plugin, args, says):
    (tmp_path / "city.py").write_text(block("# city.py") + "\n\n" + plugin)
    monkeypatch.chdir(tmp_path)
    name = plugin.split("(")[0].split()[-1]
    code, text = cli_main("eval", "--benchmark", f"city.py:{name}", *args)
    assert code == 2 and text.strip() == f"error: {says}", text


def test_the_docs_plugin_test_with_a_scripted_gold_agent_passes(tmp_path, monkeypatch):
    (tmp_path / "city.py").write_text(block("# city.py"))
    monkeypatch.chdir(tmp_path)
    first = "from trace_rl.core.trajectory import TrajectoryStore"
    scope: dict = {}
    exec(first + "\n" + block(first), scope)  # block() leaves its first line out
    scope["test_gold_agent_passes_every_task"](tmp_path / "store")
