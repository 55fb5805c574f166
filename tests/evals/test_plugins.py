"""Benchmarks as plugins: a file, a module and an entry point, found by the CLI; options validated
by the benchmark's own model; a continuous score passed by the framework's threshold."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trace_rl.evals.benchmark import BenchmarkError, load_benchmark

PLUGIN = textwrap.dedent('''
    """A plugin benchmark: each task scores `quality` (continuous), no model call needed."""
    from pydantic import Field
    from trace_rl.evals.benchmark import Benchmark, BenchmarkOptions, Episode, Observation, Score, Task


    class Options(BenchmarkOptions):
        quality: float = Field(0.5, ge=0, le=1)


    class QualityEpisode(Episode):
        system_prompt, tools = "Nothing to do.", []

        def __init__(self, quality):
            self.quality = quality

        def reset(self):
            return Observation([{"role": "user", "content": "hi"}], done=True, reason="agent_stop")

        def step(self, content, tool_calls):
            raise AssertionError("never stepped")

        def score(self, termination):
            return Score(self.quality, self.quality >= 1.0)


    class QualityBench(Benchmark):
        name = "quality"
        Options = Options

        def __init__(self, quality=0.5):
            self.quality = quality

        def splits(self):
            return ["train", "test"]

        def tasks(self, split):
            return [Task(f"{split}-{i}", self.name, split) for i in range(3)]

        def episode(self, task_id):
            return QualityEpisode(self.quality)
''')


@pytest.fixture
def plugin(tmp_path):
    (tmp_path / "quality_bench.py").write_text(PLUGIN)
    return tmp_path


def cli(args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "trace_rl.graph.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_a_file_plugin_runs_under_trace_rl_eval_with_options_and_a_threshold(plugin):
    out = cli(["eval", "--benchmark", f"{plugin / 'quality_bench.py'}:QualityBench", "--split", "test", "--model",
               "smollm2-135m", "--bench-opt", "quality=0.6", "--passed-threshold", "0.55", "--out", "r"], cwd=plugin)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    report = json.loads((plugin / "r" / "report.json").read_text())
    group = next(iter(report["groups"].values()))
    assert group["episodes"] == 3 and group["passed"] == 3 and abs(group["mean_reward"] - 0.6) < 1e-9
    bad = cli(["eval", "--benchmark", f"{plugin / 'quality_bench.py'}:QualityBench", "--bench-opt", "qualty=1"],
              cwd=plugin)
    assert bad.returncode == 2 and "invalid benchmark options: qualty" in bad.stdout and "quality" in bad.stdout


def test_a_module_plugin_and_a_run_config_use_it(plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin))
    b = load_benchmark("quality_bench:QualityBench", options={"quality": "0.25"})
    assert b.quality == 0.25 and b.splits() == ["train", "test"]
    from trace_rl.graph.config import ConfigError, load_config

    cfg = load_config(overrides={"benchmark": "quality_bench:QualityBench", "benchmark_options": {"quality": 0.9}})
    assert cfg.benchmark_options == {"quality": 0.9}
    with pytest.raises(ConfigError, match="invalid benchmark options"):
        load_config(overrides={"benchmark": "quality_bench:QualityBench", "benchmark_options": {"quality": 7}})
    with pytest.raises(BenchmarkError, match="has no 'Nope'"):
        load_benchmark("quality_bench:Nope")


def test_an_entry_point_plugin_is_found_by_name(plugin):
    dist = plugin / "quality_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: quality-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[trace_rl.benchmarks]\nquality = quality_bench:QualityBench\n")
    env = {"PYTHONPATH": str(plugin)}
    code = "from trace_rl.evals.benchmark import load_benchmark; b = load_benchmark('quality'); print(b.name, len(b.tasks('test')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=plugin, capture_output=True, text=True, env={**os.environ, **env})
    assert out.stdout.strip() == "quality 3", out.stderr[-2000:]
    ev = cli(["eval", "--benchmark", "quality", "--model", "smollm2-135m", "--out", "r2"], cwd=plugin, env=env)
    assert ev.returncode == 0 and json.loads((plugin / "r2" / "report.json").read_text()), ev.stderr[-2000:]


def test_framework_options_are_offered_only_to_benchmarks_that_take_them(plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin))
    b = load_benchmark("quality_bench:QualityBench", offer={"max_steps": 5, "user_llm": "x"})
    assert b.quality == 0.5  # not given max_steps / user_llm, which it does not take
    t = load_benchmark("tau2:telecom", offer={"max_steps": 7})
    assert t.max_steps == 7


def test_spec_lists_per_task_tool_subsets(plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin))
    import quality_bench

    class Subsets(quality_bench.QualityBench):
        def task_tools(self, task_id):
            return ["search"] if task_id.endswith("0") else ["search", "book"]

    spec = Subsets().spec()
    assert spec["task_tools"]["test-0"] == ["search"] and spec["task_tools"]["train-2"] == ["search", "book"]
    assert "task_tools" not in quality_bench.QualityBench().spec()
