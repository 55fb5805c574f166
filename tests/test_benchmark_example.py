"""The worked example of docs/benchmarks.md runs as written."""
import re
import sys
from pathlib import Path

from doubles import ScriptedLLM
from trace_rl.agents.llm import ToolCall
from trace_rl.evals.rollout import TrajectoryStore, rollout

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def test_docs_example_benchmark(tmp_path, monkeypatch):
    code = re.search(r"```python\n# my_bench.py.*?\n(.*?)```", DOC.read_text(), re.S).group(1)
    (tmp_path / "my_bench.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_bench  # noqa: F401
    from trace_rl.evals.benchmark import load_benchmark

    bench = load_benchmark("city")

    def policy(messages, tools):
        if messages[-1]["role"] == "tool":
            return "They live in " + messages[-1]["content"].split('"city": "')[1].split('"')[0]
        uid = re.search(r"does (\S+) live", messages[-1]["content"]).group(1)
        return ToolCall("get_user", {"user_id": uid})
    trajs = rollout(bench, ScriptedLLM(policy), [t.id for t in bench.tasks("test")], TrajectoryStore(tmp_path / "r"),
                    split="test", progress=False)
    assert [t.passed for t in trajs] == [True, True, True]
    sys.modules.pop("my_bench", None)
