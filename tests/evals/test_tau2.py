import pytest
from tau2_gold import gold_actions, gold_say, replay

from trace_rl.evals.benchmark import BenchmarkError, load_benchmark

FLOORS = {"airline": (50, 19), "retail": (114, 7), "telecom": (114, 0),
          # τ³-bench 1.0.0's fixed tasks (evals/data/tau3/): measured here, DB part only for retail's NL tasks
          "airline@tau3": (50, 23), "retail@tau3": (114, 11)}


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


def test_tau3_task_sets_load_the_fixed_tasks_and_the_new_tool():
    b = load_benchmark("tau2:retail@tau3")
    assert b.name == "tau2:retail@tau3" and (len(b.tasks("train")), len(b.tasks("test"))) == (74, 40)
    ep = b.episode(b.tasks("base")[0].id, with_user=False)
    assert "get_item_details" in {t["function"]["name"] for t in ep.tools}
    assert "get_item_details" not in {t["function"]["name"] for t in
                                      load_benchmark("tau2:retail").episode(b.tasks("base")[0].id, with_user=False).tools}
    with pytest.raises(BenchmarkError, match="τ³ has tasks for airline, retail only"):
        load_benchmark("tau2:telecom@tau3")
    with pytest.raises(BenchmarkError, match="invalid benchmark options: nl_judgee"):
        load_benchmark("tau2:retail@tau3", options={"nl_judgee": True})


def test_tau3_nl_assertions_are_judged_only_when_asked():
    """Off: the DB part alone is scored, and the score says so. On: a judge (here scripted) decides."""
    import json

    from doubles import ScriptedLLM

    b = load_benchmark("tau2:retail@tau3")
    tid = next(t.id for t in b.tasks("base") if t.id == "21")
    ep = b.episode(tid, with_user=False)
    off = replay(ep, gold_actions(b, tid), gold_say(ep))
    assert off.passed and off.reasons["nl_assertions"].startswith("not judged")
    n = len(ep.task.evaluation_criteria.nl_assertions)
    for met, passed in ((True, True), (False, False)):
        ep = b.episode(tid, with_user=False)
        ep.nl_judge = ScriptedLLM(lambda m, t, met=met: json.dumps({"results": [
            {"assertion": "x", "met": met, "reasoning": ""}] * n}))
        sc = replay(ep, gold_actions(b, tid), gold_say(ep))
        assert sc.passed is passed and sc.reasons["nl_assertions"]["reward"] == float(met)


def test_unknown_split_and_task_errors():
    b = load_benchmark("tau2:telecom")
    with pytest.raises(BenchmarkError, match="no split 'dev'.*train"):
        b.tasks("dev")
    with pytest.raises(BenchmarkError, match="unknown task id 'nope'"):
        b.episode("nope")
    with pytest.raises(BenchmarkError, match="no solo mode"):
        load_benchmark("tau2:airline", options={"solo": True})


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


def test_ticket_after_tools_gives_every_task_one_prompt_prefix_and_scores_alike():
    """ticket=after_tools: the system prompt and tools (what the chat template renders before the
    first user turn) are the same for every task, the ticket comes in the first user turn, and
    tau2 scores the gold replay as it does in upstream's layout."""
    upstream, moved = load_benchmark("tau2:telecom"), load_benchmark("tau2:telecom", options={"ticket": "after_tools"})
    a, b = (moved.episode(t.id) for t in moved.tasks("test")[:2])
    assert a.system_prompt == b.system_prompt and a.tools == b.tools and "<ticket>" not in a.system_prompt
    assert a.task.ticket not in a.system_prompt and a.task.ticket in a.reset().messages[0]["content"]
    assert a.task.ticket in upstream.episode(a.task.id).system_prompt
    for t in moved.tasks("base")[:3]:
        ep = moved.episode(t.id, with_user=False)
        assert replay(ep, gold_actions(moved, t.id), gold_say(ep)).passed
    with pytest.raises(BenchmarkError, match="ticket=after_tools moves a solo-mode ticket"):
        load_benchmark("tau2:airline", options={"ticket": "after_tools"})
    with pytest.raises(BenchmarkError, match="ticket"):
        load_benchmark("tau2:telecom", options={"ticket": "first"})


def _replay_domain(domain):
    b = load_benchmark(f"tau2:{domain}")  # domain may carry a task set: airline@tau3
    tasks = b.tasks("base")
    gold = floor = 0
    for t in tasks:
        ep = b.episode(t.id, with_user=False)
        gold += replay(ep, gold_actions(b, t.id), gold_say(ep)).passed
        floor += replay(b.episode(t.id, with_user=False), []).passed
    return len(tasks), gold, floor


@pytest.mark.ci
@pytest.mark.slow
@pytest.mark.parametrize("domain", sorted(FLOORS))
def test_scorer_agrees_with_tau2_gold_and_floors(domain):
    """Gold-action replay scores 100%; a do-nothing agent scores tau2's known floors."""
    n, gold, floor = _replay_domain(domain)
    assert (n, floor) == FLOORS[domain]
    assert gold == n


@pytest.mark.parametrize("task_index", [0, 7])
def test_grpo_plays_a_telecom_task_turn_by_turn_and_tau2_scores_it_as_the_gold_replay(task_index):
    """τ² as a GRPO environment: GRPO's token rollout plays the gold actions as the model's turns
    (one tool call a turn, then `done`); τ²'s own evaluator scores the episode as it scores the
    scripted replay of the same actions (1.0), and a hinted episode is the plain one."""
    import json

    from tiny import tiny_tokenizer
    from trace_rl.models.engine import stop_ids
    from trace_rl.training.grpo import PRESETS, TokenRollout
    from trace_rl.models.hf_policy import encode

    bench = load_benchmark("tau2:telecom")
    tid = bench.tasks("test")[task_index].id
    gold = gold_actions(bench, tid)
    want = replay(bench.episode(tid, with_user=False), gold)
    tok = tiny_tokenizer()
    turns = [f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}\n</tool_call>'
             for c in gold] + ['<tool_call>\n{"name": "done", "arguments": {}}\n</tool_call>']
    script = iter(turns)
    end = stop_ids(tok)[0]

    def generate(seqs, n):
        text = next(script)
        return [encode(tok, text) + [end] for _ in seqs]

    settings = PRESETS["tiny"].model_copy(update={"max_steps": len(turns) + 1, "max_seq_len": 60000})
    ep = bench.episode(tid, hinted=True)
    assert ep.plain_system_prompt == ep.system_prompt  # τ² has no hints
    [played] = TokenRollout(bench, tok, settings).run(generate, [tid], [True])
    assert want.passed and played.success and played.reward == want.reward == 1.0
    assert played.termination == "agent_stop" and played.turns == len(turns)
    calls = [json.loads(json.dumps(m["tool_calls"][0]["function"]["name"])) for m in played.messages
             if m.get("tool_calls")]
    assert calls == [c["function"]["name"] for c in gold] + ["done"]
    script = iter(turns[1:])  # the first gold action left out: τ² must not pass it
    [short] = TokenRollout(bench, tok, settings).run(generate, [tid], [False])
    assert len(gold) >= 1 and not short.success and short.reward < 1.0
