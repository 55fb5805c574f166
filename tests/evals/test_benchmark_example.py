"""The examples of docs/benchmarks.md run as written: the same-venv file by name with an option,
and the worker form in a second venv."""
import re
import subprocess
import sys

from doubles import ScriptedLLM
from trace_rl.models.chat import ToolCall
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
