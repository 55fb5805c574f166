"""A benchmark in its own venv (with a pin trace-rl's venv rules out) behind WorkerBenchmark:
tasks, episodes under the rollout engine's threads, a worker killed mid-run and restarted."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

SIDE = textwrap.dedent('''
    """Worker side: runs in the second venv, whose `pydantic` is a stand-in pinned at 1.10."""
    import time
    import pydantic


    class Episode:
        def __init__(self, task_id):
            self.task_id, self.answer = task_id, ""

        def reset(self):
            return {"system_prompt": "Say the task number.", "tools": [],
                    "messages": [{"role": "user", "content": f"task {self.task_id}"}]}

        def step(self, content, tool_calls):
            time.sleep(0.2)
            self.answer = content
            return {"messages": [], "done": True, "reason": "agent_stop"}

        def score(self, termination):
            ok = self.task_id in self.answer
            return {"reward": float(ok), "passed": ok, "reasons": {"pydantic": pydantic.VERSION}}


    class SideBench:
        def splits(self):
            return ["train", "test"]

        def tasks(self, split):
            return [{"id": str(i), "description": f"pydantic {pydantic.VERSION}"} for i in range(8)]

        def episode(self, task_id):
            return Episode(task_id)
''')


@pytest.fixture(scope="module")
def second_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("venv2")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    site = next((root / "venv" / "lib").glob("python3*/site-packages"))
    (site / "pydantic").mkdir()
    (site / "pydantic" / "__init__.py").write_text('VERSION = "1.10.0"  # the conflicting pin\n')
    (root / "side.py").write_text(SIDE)
    return root


def make_bench(root: Path):
    from trace_rl.evals.worker import WorkerBenchmark

    class SideBenchmark(WorkerBenchmark):
        name = "side"
        worker_target = f"{root / 'side.py'}:SideBench"

    return SideBenchmark(python=str(root / "venv" / "bin" / "python"), call_timeout_s=30)


def test_a_worker_benchmark_runs_in_its_own_venv(second_venv):
    import pydantic

    from doubles import ScriptedLLM
    from trace_rl.core.trajectory import TrajectoryStore
    from trace_rl.evals.rollout import rollout

    bench = make_bench(second_venv)
    try:
        tasks = bench.tasks("test")
        assert len(tasks) == 8 and tasks[0].description == "pydantic 1.10.0" != f"pydantic {pydantic.VERSION}"
        policy = ScriptedLLM(lambda m, t: f"It is {m[1]['content'].split()[-1]}.")
        trajs = rollout(bench, policy, [t.id for t in tasks], TrajectoryStore(second_venv / "run"), concurrency=4,
                        progress=False)
        assert all(t.passed for t in trajs) and trajs[0].reasons["pydantic"] == "1.10.0"
    finally:
        bench.close()


def test_a_killed_worker_fails_its_open_episodes_and_is_restarted(second_venv, tmp_path):
    from doubles import ScriptedLLM
    from trace_rl.core.trajectory import TrajectoryStore
    from trace_rl.evals.rollout import rollout

    bench = make_bench(second_venv)
    try:
        first = bench.live_worker().call("pid")

        def kill_soon():
            time.sleep(0.5)
            os.kill(first, signal.SIGKILL)

        threading.Thread(target=kill_soon, daemon=True).start()
        policy = ScriptedLLM(lambda m, t: f"It is {m[1]['content'].split()[-1]}.")
        trajs = rollout(bench, policy, [t.id for t in bench.tasks("test")], TrajectoryStore(tmp_path), trials=2,
                        concurrency=2, progress=False)
        lost = [t for t in trajs if t.termination == "env_error"]
        assert len(trajs) == 16 and lost and len(lost) < 16, [t.termination for t in trajs]
        assert all(t.passed for t in trajs if t.termination != "env_error")  # the others ran on a new worker
        assert bench.restarts >= 1 and bench.live_worker().call("pid") != first
    finally:
        bench.close()


def test_a_daemon_the_benchmark_forks_ends_with_the_worker(second_venv):
    """The benchmark's own code detaches a process (setsid, double fork): closing the benchmark ends it."""
    import uuid

    from processes import DETACH, alive_when

    marker = f"trace-rl-worker-daemon-{uuid.uuid4().hex[:8]}"
    side = second_venv / f"side_{marker[-8:]}.py"
    side.write_text(SIDE + "\n\nclass Forking(SideBench):\n    def __init__(self):\n        exec("
                    + repr(DETACH.format(marker=marker)) + ")\n")
    from trace_rl.evals.worker import WorkerBenchmark

    class ForkingBenchmark(WorkerBenchmark):
        name = "forking"
        worker_target = f"{side}:Forking"

    bench = ForkingBenchmark(python=str(second_venv / "venv" / "bin" / "python"), call_timeout_s=30)
    try:
        assert bench.splits() == ["train", "test"]
        assert len(alive_when(marker, lambda n: n >= 2, 10)) == 2
    finally:
        bench.close()
    assert alive_when(marker, lambda n: n == 0, 5) == []
