import pytest

from trace_rl.evals.benchmark import BenchmarkError, load_benchmark

FLOORS = {"airline": (50, 19), "retail": (114, 7), "telecom": (114, 0)}


def test_splits_and_task_counts():
    b = load_benchmark("tau2:airline")
    assert {"train", "test", "base"} <= set(b.splits())
    assert (len(b.tasks("train")), len(b.tasks("test")), len(b.tasks("base"))) == (30, 20, 50)
    t = load_benchmark("tau2:telecom")
    assert (len(t.tasks("train")), len(t.tasks("test"))) == (74, 40) and t.solo


@pytest.mark.parametrize("spec,match", [
    ("tau2:nowhere", "unknown tau2 domain 'nowhere'"),
    ("swebench:x", "unknown benchmark 'swebench:x'"),
])
def test_unknown_benchmark_errors(spec, match):
    with pytest.raises(BenchmarkError, match=match):
        load_benchmark(spec)


def test_unknown_split_and_task_errors():
    b = load_benchmark("tau2:telecom")
    with pytest.raises(BenchmarkError, match="no split 'dev'.*train"):
        b.tasks("dev")
    with pytest.raises(BenchmarkError, match="unknown task id 'nope'"):
        b.episode("nope")
    with pytest.raises(BenchmarkError, match="no solo mode"):
        load_benchmark("tau2:airline", solo=True)


def test_solo_episode_tools_and_stop():
    b = load_benchmark("tau2:telecom")
    tid = b.tasks("test")[0].id
    ep = b.episode(tid)
    names = {t["function"]["name"] for t in ep.tools}
    assert "done" in names and len(names) > 5 and "<ticket>" in ep.system_prompt
    ep.reset()
    obs = ep.step("", [{"id": "c1", "type": "function", "function": {"name": "no_such_tool", "arguments": "{}"}}])
    assert obs.messages[0]["role"] == "tool" and "Error" in obs.messages[0]["content"] and not obs.done
    obs = ep.step("", [{"id": "c2", "type": "function", "function": {"name": "done", "arguments": "{}"}}])
    assert obs.done and obs.reason == "agent_stop"
    assert ep.score("agent_stop").passed is False  # telecom's do-nothing floor is 0


def _replay_domain(domain):
    b = load_benchmark(f"tau2:{domain}")
    tasks = b.tasks("base")
    gold = floor = 0
    for t in tasks:
        ep = b.episode(t.id, with_user=False)
        gold += ep.replay(b.gold_actions(t.id), ep.gold_say()).passed
        floor += b.episode(t.id, with_user=False).replay([]).passed
    return len(tasks), gold, floor


@pytest.mark.ci
@pytest.mark.slow
@pytest.mark.parametrize("domain", sorted(FLOORS))
def test_scorer_agrees_with_tau2_gold_and_floors(domain):
    """Gold-action replay scores 100%; a do-nothing agent scores tau2's known floors."""
    n, gold, floor = _replay_domain(domain)
    assert (n, floor) == FLOORS[domain]
    assert gold == n
