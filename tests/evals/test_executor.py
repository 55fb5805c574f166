"""executor=ray (evals/executor.py) on a simulated cluster: 3 nodes of one machine (ray.cluster_utils.Cluster), each
offering one `sandbox`, 1 CPU and a small object store. The same trajectories as local on a hand-written env and on a
benchmark plugin (the docs' city.py, loaded by file name), a driver killed mid-rollout and resumed ends with one record
per episode, and (last: it takes nodes away) a node lost mid-episode loses no episode and duplicates none."""
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from doubles import ScriptedLLM, cli_main
from paths import ROOT, SUPPORT
from ray_doubles import SlowLetters, city_script, letters_agent
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.benchmark import load_benchmark
from trace_rl.evals.executor import INFRA_ERROR
from trace_rl.evals.rollout import rollout

ray = pytest.importorskip("ray")
NODE = {"num_cpus": 1, "resources": {"sandbox": 1}, "object_store_memory": 100 * 2**20}


@pytest.fixture(scope="module")
def cluster():
    """A head and two workers, one sandbox each; this process is the driver."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        workers = [c.add_node(**NODE) for _ in range(2)]
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


def city_plugin() -> str:
    """The plugin file of docs/benchmarks.md, as written there."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    return re.search(r"```python\n# city.py.*?\n(.*?)```", doc, re.S).group(1)


def lines(store_dir) -> Counter:
    """How many times each episode's key is written in the store's file."""
    raw = (store_dir / "trajectories.jsonl").read_text().splitlines()
    return Counter("{benchmark}/{task_id}/{trial}".format(**json.loads(x)) for x in raw if x.strip())


def same(ray_trajs, local_trajs):
    shown = lambda t: (t.key, t.reward, t.passed, t.termination, t.steps, t.tool_calls,  # noqa: E731
                       [m.get("content") for m in t.messages])  # tool-call ids are random per call
    assert [shown(t) for t in ray_trajs] == [shown(t) for t in local_trajs]


def test_a_hand_written_env_gives_the_same_trajectories_as_local(cluster, tmp_path):
    ids = [str(i) for i in range(8)]
    there = rollout(SlowLetters(8), letters_agent(), ids, TrajectoryStore(tmp_path / "ray"), trials=2,
                    progress=False, executor="ray")
    here = rollout(SlowLetters(8), letters_agent(), ids, TrajectoryStore(tmp_path / "local"), trials=2,
                   progress=False)
    same(there, here)
    assert sorted({t.reward for t in there}) == [i / 8 for i in range(8)]  # rewards that differ per task
    assert set(lines(tmp_path / "ray").values()) == {1} and len(lines(tmp_path / "ray")) == 16


def test_a_benchmark_plugin_by_file_name_gives_the_same_trajectories_as_local(cluster, tmp_path):
    (tmp_path / "city.py").write_text(city_plugin())
    bench = load_benchmark(f"{tmp_path / 'city.py'}:CityBench", options={"users": 8})
    assert bench.loaded_from[0] == f"{tmp_path / 'city.py'}:CityBench"  # how each node builds it again
    ids = [t.id for t in bench.tasks("train") + bench.tasks("test")]
    there = rollout(bench, ScriptedLLM(city_script), ids, TrajectoryStore(tmp_path / "ray"), progress=False,
                    executor="ray")
    here = rollout(bench, ScriptedLLM(city_script), ids, TrajectoryStore(tmp_path / "local"), progress=False)
    same(there, here)
    assert [t.passed for t in there] == [i % 2 == 0 for i in range(8)]


def test_a_registered_benchmark_is_registered_on_each_node_too(cluster, tmp_path):
    """`register()` ran in a module of this process (as a run's `components` module does): a node imports that
    module before it builds the benchmark by name."""
    import ray_registered  # noqa: F401

    bench = load_benchmark("slow-letters")
    assert bench.loaded_from[3] == "ray_registered"
    there = rollout(bench, letters_agent(), ["1", "2"], TrajectoryStore(tmp_path / "ray"), progress=False,
                    executor="ray")
    assert [t.reward for t in there] == [0.125, 0.25]


def test_the_pipelines_rollout_stage_plays_on_the_cluster(cluster, tmp_path, monkeypatch):
    """`trace-rl run --executor ray` up to the analysis, on the pipeline's doubles (graph_doubles): the same
    episodes as a local run, and none of the agent's calls made in this process (its call log stays empty)."""
    from graph_doubles import config
    from trace_rl.graph.pipeline import drive

    def stage(run, executor):
        monkeypatch.setenv("TRACE_RL_CALL_LOG", str(tmp_path / f"{executor}.log"))
        out = drive(tmp_path / run, config(executor=executor), resume=False, until="analyse", log=lambda *a: None)
        assert out["status"] == "stopped"
        store = next((tmp_path / run).rglob("trajectories.jsonl")).parent
        return sorted(TrajectoryStore(store).all(), key=lambda t: t.key)

    there, here = stage("ray", "ray"), stage("local", "local")
    same(there, here)
    assert len(there) == 12 and {t.passed for t in there} == {True, False}
    assert not (tmp_path / "ray.log").exists() and "agent" in (tmp_path / "local.log").read_text()


def test_a_driver_killed_mid_rollout_and_resumed_ends_with_one_record_per_episode(cluster, tmp_path):
    c, _ = cluster
    out, n = tmp_path / "store", 6
    driver = subprocess.Popen([sys.executable, str(SUPPORT / "ray_driver.py"), c.address, str(out), str(n), "0.4"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 90
        while not ((out / "trajectories.jsonl").is_file() and sum(lines(out).values()) >= 3):
            assert driver.poll() is None, driver.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "the driver stored no 3 episodes in 90 s"
            time.sleep(0.05)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    before = lines(out)
    assert 3 <= sum(before.values()) < 2 * n  # killed mid-way
    trajs = rollout(SlowLetters(n, 0.4), letters_agent(), [str(i) for i in range(n)], TrajectoryStore(out), trials=2,
                    progress=False, executor="ray")
    after = lines(out)
    assert len(after) == 2 * n and set(after.values()) == {1}, after  # each episode once, none played twice
    assert all(t.termination == "agent_stop" for t in trajs)


def test_eval_with_executor_ray_plays_on_the_cluster(cluster, tmp_path, monkeypatch):
    """`trace-rl eval --executor ray` with a plugin named by a relative file path: each node builds it from its
    absolute path, and the agent's copy on this machine is asked nothing."""
    import trace_rl.models.llm

    (tmp_path / "city.py").write_text(city_plugin())
    monkeypatch.chdir(tmp_path)
    made = []
    monkeypatch.setattr(trace_rl.models.llm, "LLM", lambda config, **_: made.append(ScriptedLLM(city_script)) or made[-1])
    code, text = cli_main("eval", "--benchmark", "city.py:CityBench", "--split", "test", "--bench-opt", "users=8",
                          "--model", "agent", "--out", "r", "--executor", "ray")
    assert code == 0 and "agent_stop=4" in text and "50.0%" in text, text
    assert len(made) == 1 and made[0].requests == []  # played by the copies on the nodes


def test_a_model_no_node_can_reach_is_refused_and_an_in_process_one_plays_here(cluster, tmp_path, capsys):
    from trace_rl.models.llm import LLM, LLMConfig

    with pytest.raises(ValueError, match="has no base_url"):  # it would start a llama.cpp server on every node
        rollout(SlowLetters(2), LLM(LLMConfig(model="qwen2.5-coder-0.5b")), ["0"], TrajectoryStore(tmp_path / "a"),
                progress=False, executor="ray")

    class InProcess:  # a policy whose weights are in this process (HFPolicy, a composition)
        name = "in-process"
        chat = letters_agent().chat

    trajs = rollout(SlowLetters(2), InProcess(), ["0", "1"], TrajectoryStore(tmp_path / "b"), progress=False,
                    executor="ray")
    assert [t.reward for t in trajs] == [0.0, 0.125] and "play here" in capsys.readouterr().err


def process_gone(pid: int) -> bool:
    """Exited (a zombie no one reaps counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_node_lost_mid_episode_loses_no_episode_and_duplicates_none(cluster, tmp_path):
    """Runs last: it removes the worker nodes. First with retries (the episode is played again elsewhere), then
    with none (it is recorded as infra_error, and the next run of the rollout plays it again)."""
    c, workers = cluster
    log, ids = tmp_path / "episodes.log", [str(i) for i in range(6)]

    def lost_mid_episode(store, retries):
        """Roll out in a thread; once an episode is in flight on a worker node, take that node away. Every step
        waits while `hold` exists, so the victim's episode cannot end between seeing it start and the removal."""
        hold = tmp_path / "hold"
        bench, box = SlowLetters(6, 0.5, str(log), str(hold)), {}
        run = threading.Thread(target=lambda: box.update(out=rollout(
            bench, letters_agent(), ids, TrajectoryStore(store), trials=2, progress=False, executor="ray",
            ray_retries=retries)))
        log.write_text("")
        hold.write_text("")
        run.start()
        alive = {w.node_id: w for w in workers if w in c.worker_nodes}
        deadline, victim = time.time() + 60, None
        while victim is None:
            assert time.time() < deadline, "no episode started on a worker node"
            started = [line.split() for line in log.read_text().splitlines()]
            victim, pid = next(((alive[node], int(pid)) for what, _, node, pid in started
                                if what == "start" and node in alive), (None, None))
            time.sleep(0.05)
        c.remove_node(victim, allow_graceful=False)
        while not process_gone(pid):  # a worker outlives its raylet a moment, and could still send its result
            assert time.time() < deadline + 60, f"the removed node's worker {pid} is still running"
            time.sleep(0.05)
        hold.unlink()
        run.join(120)
        assert not run.is_alive()
        return box["out"], victim.node_id

    trajs, gone = lost_mid_episode(tmp_path / "retried", retries=3)
    starts = [line.split() for line in log.read_text().splitlines() if line.startswith("start")]
    assert any(node == gone for _, _, node, _ in starts)  # an episode was in flight there
    assert len(starts) > 12  # ... and was started again
    assert [t.termination for t in trajs] == ["agent_stop"] * 12
    same(trajs, rollout(SlowLetters(6), letters_agent(), ids, TrajectoryStore(tmp_path / "local"), trials=2,
                        progress=False))
    assert set(lines(tmp_path / "retried").values()) == {1} and len(lines(tmp_path / "retried")) == 12

    trajs, _ = lost_mid_episode(tmp_path / "unretried", retries=0)
    lost = [t for t in trajs if t.termination == INFRA_ERROR]
    assert lost and all(t.reasons["error_kind"] == INFRA_ERROR and not t.passed for t in lost)
    assert len(trajs) == 12 and set(lines(tmp_path / "unretried").values()) == {1}
    again = rollout(SlowLetters(6), letters_agent(), ids, TrajectoryStore(tmp_path / "unretried"), trials=2,
                    progress=False, executor="ray")  # the next run plays the lost ones again, on the head
    assert [t.termination for t in again] == ["agent_stop"] * 12
    assert {k for k, n in lines(tmp_path / "unretried").items() if n > 1} == {t.key for t in lost}  # replaced once
