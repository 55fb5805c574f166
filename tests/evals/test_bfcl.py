"""BFCL multi-turn built in (evals/bfcl.py + evals/bfcl_worker.py), with BFCL's own code in its own venv:
the ground truth, replayed as OpenAI tool calls through the agent loop, passes every task and every turn;
an empty agent gets BFCL's own verdict; a crash inside BFCL's code is a recorded episode; hostile calls
run nothing; the train/test split keeps a scenario (all its variants and turns) on one side."""
import hashlib
import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from doubles import ScriptedLLM
from trace_rl.agents.base_agent import run_episode
from trace_rl.models.chat import Reply, ToolCall
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.benchmark import BenchmarkError, load_benchmark
from trace_rl.evals.bfcl import BFCL_VERSION, recipe
from trace_rl.evals.rollout import rollout

EVALS = Path(__file__).resolve().parents[2] / "evals"
PY = recipe().python
needs_venv = pytest.mark.skipif(not PY.exists(), reason="bfcl-eval's venv is absent: "
                                "scripts/setup.sh --benchmarks bfcl (or trace-rl benchmarks install bfcl) makes it")


def in_bfcl(code: str, python: Path = PY):
    """Run `code` in bfcl-eval's venv (with the worker module importable) and return the JSON it prints last."""
    out = subprocess.run([str(python), "-c", f"import sys; sys.path.insert(0, {str(EVALS)!r})\n" + code],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gold():
    """{BFCL task id: ground-truth turns as [[{"name", "arguments"}]]} (parsed by the worker, which
    test_our_executor_matches_bfcls_eval_on_every_gold_call checks against BFCL's own path)."""
    return in_bfcl(textwrap.dedent("""
        import json, bfcl_worker as w
        out = {}
        for tid, (entry, gold) in w.BfclBench().entries().items():
            backends = w.Backends(entry)
            out[tid] = [[backends.parse_gold(c) for c in turn] for turn in gold]
        print(json.dumps(out))
    """))


@pytest.fixture(scope="module")
def classes():
    """{BFCL task id: its involved backend classes}."""
    return in_bfcl("import json, bfcl_worker as w\n"
                   "print(json.dumps({t: e['involved_classes'] for t, (e, _) in w.BfclBench().entries().items()}))")


@pytest.fixture(scope="module")
def benches():
    made = {}

    def get(mode: str, **options):
        key = (mode, *sorted(options.items()))
        if key not in made:
            made[key] = load_benchmark("bfcl", options={"mode": mode, **options})
        return made[key]

    yield get
    for bench in made.values():
        bench.close()


def bfcl_id(task_id: str) -> tuple[str, int | None]:
    base, _, turn = task_id.partition(".turn")
    return base, int(turn) if turn else None


def gold_script(turns: list[list[dict]]) -> list:
    """The gold agent: each turn's calls in one reply (a turn may hold 34, beyond BFCL's 20-step limit
    if sent one by one), then a reply without calls to end the turn."""
    script = []
    for t, calls in enumerate(turns):
        if calls:
            script.append(Reply(content="", tool_calls=[ToolCall(c["name"], c["arguments"], id=f"gold{t}_{i}")
                                                         for i, c in enumerate(calls)]))
        script.append("Done.")
    return script


def play(bench, task_id: str, script: list, policy: ScriptedLLM):
    policy.script, policy.requests = list(script), []
    return run_episode(policy, bench.episode(task_id), task_id=task_id, benchmark=bench.name)


@needs_venv
def test_our_executor_matches_bfcls_eval_on_every_gold_call():
    """Every ground-truth call (benchmark data, so BFCL's own eval path may run it) gives the same result
    text through `Backends.call`, and after each turn the backends' states are equal by BFCL's state check."""
    out = in_bfcl(textwrap.dedent("""
        import json, bfcl_worker as w
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import state_checker
        calls, differ = 0, []
        for tid, (entry, gold) in w.BfclBench().entries().items():
            ours = w.Backends(entry)
            for k, turn in enumerate(gold):
                theirs, instances = execute_multi_turn_func_call(
                    turn, entry["initial_config"], entry["involved_classes"], "xcheck", tid,
                    long_context="long_context" in tid)
                mine = [ours.call(c["name"], c["arguments"], ours.owner) for c in map(ours.parse_gold, turn)]
                calls += len(turn)
                if mine != theirs or not state_checker(ours.instances, instances)["valid"]:
                    differ.append([tid, k])
        print(json.dumps({"calls": calls, "differ": differ}))
    """))
    assert out["calls"] > 4000 and out["differ"] == []


@needs_venv
def test_the_left_out_turns_are_exactly_where_the_ground_truth_calls_an_unoffered_function(gold, benches):
    """BFCL's data: the ground truth of multi_turn_miss_func_49 calls `tail` at turn 1, held out until turn 3.
    Found by rule from the data here; the adapter leaves out exactly those turns and the tasks holding them."""
    out = in_bfcl(textwrap.dedent("""
        import ast, json, bfcl_worker as w
        bad = []
        for tid, (entry, gold) in w.BfclBench().entries().items():
            shown = {d["name"] for d in entry["function"]}
            for k, turn in enumerate(gold):
                shown |= {d["name"] for d in entry.get("missed_function", {}).get(str(k), [])}
                if any(ast.parse(c, mode="eval").body.func.id not in shown for c in turn):
                    bad.append(f"{tid}.turn{k}")
        print(json.dumps(bad))
    """))
    assert out == ["multi_turn_miss_func_49.turn1"]
    whole, per_turn = {t.id for t in benches("task").tasks("all")}, {t.id for t in benches("per_turn").tasks("all")}
    assert len(whole) == len(gold) - 1 and "multi_turn_miss_func_49" not in whole
    checked = {f"{tid}.turn{k}" for tid, turns in gold.items() for k, calls in enumerate(turns) if calls}
    assert per_turn == checked - set(out) and "multi_turn_miss_func_49.turn3" in per_turn


@needs_venv
@pytest.mark.parametrize("mode", ["task", "per_turn"])
def test_the_ground_truth_passes_every_task_and_turn_through_the_agent_loop(gold, benches, mode):
    bench, policy = benches(mode), ScriptedLLM([], name="gold")
    tasks = bench.tasks("all")
    assert len(tasks) == (799 if mode == "task" else 2923)
    failed = []
    for task in tasks:
        base, turn = bfcl_id(task.id)
        traj = play(bench, task.id, gold_script(gold[base] if turn is None else [gold[base][turn]]), policy)
        if not (traj.passed and traj.reward == 1.0 and traj.termination == "agent_stop"):
            failed.append((task.id, traj.termination, traj.reasons))
    assert not failed, failed[:5]


@needs_venv
def test_per_turn_history_is_bfcls_ground_truth_conversation(gold, benches):
    """Turn k opens with the earlier turns as BFCL's ground-truth conversation: the user turn, then one
    assistant call and its result per ground-truth call; tools are those offered at turn k."""
    bench = benches("per_turn")
    ep = bench.episode("multi_turn_miss_func_0.turn3")
    try:
        obs = ep.reset()
        calls = [m["tool_calls"][0]["function"] for m in obs.messages if m.get("tool_calls")]
        assert [c["name"] for c in calls] == [c["name"] for turn in gold["multi_turn_miss_func_0"][:3] for c in turn]
        assert json.loads(calls[0]["arguments"]) == {"folder": "document"}
        assert [m["role"] for m in obs.messages[:3]] == ["user", "assistant", "tool"]
        assert obs.messages[-1] == {"role": "user", "content": "I have updated some more functions you can "
                                                               "choose from. What about now?"}
        assert "sort" in {t["function"]["name"] for t in ep.tools}  # held out until this turn
        assert ep.max_steps == 22
    finally:
        ep.close()


@needs_venv
def test_a_miss_func_task_offers_the_held_out_function_from_its_turn_on(gold, benches):
    bench, seen = benches("task"), []

    def policy(messages, tools):
        seen.append({t["function"]["name"] for t in tools})
        return "I cannot do that with these functions."

    traj = run_episode(ScriptedLLM(policy), bench.episode("multi_turn_miss_func_0"),
                       task_id="multi_turn_miss_func_0", benchmark=bench.name)
    assert ["sort" in names for names in seen] == [False, False, False, True, True]
    assert traj.termination == "agent_stop" and not traj.passed
    assert bench.task_tools("multi_turn_miss_func_0")[-1] == "sort"
    assert "sort" not in benches("per_turn").task_tools("multi_turn_miss_func_0.turn1")


@needs_venv
def test_an_empty_agent_gets_bfcls_own_verdict(benches):
    """Replies without calls on every task and turn: the verdict is what BFCL's unmodified checker says for
    an empty model result (earlier turns of a per-turn task: the ground-truth strings, run by BFCL's eval)."""
    expected = in_bfcl(textwrap.dedent("""
        import json, bfcl_worker as w
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
        out, n = {}, 0
        for tid, (entry, gold) in w.BfclBench().entries().items():
            for k in [None] + [k for k, calls in enumerate(gold) if calls]:
                turns = gold if k is None else gold[: k + 1]
                model = [[] for _ in turns] if k is None else [[t] if t else [] for t in gold[:k]] + [[]]
                n += 1
                v = multi_turn_checker(model, turns, entry, tid.rsplit("_", 1)[0], f"empty{n}")
                out[tid if k is None else f"{tid}.turn{k}"] = [v["valid"], v.get("error_type"), v.get("error_message")]
                for name in [x for x in vars(multi_turn_utils) if x.startswith(f"empty{n}_")]:
                    delattr(multi_turn_utils, name)  # BFCL keeps each run's instances in its globals
        print(json.dumps(out))
    """))
    policy = ScriptedLLM(lambda m, t: "I cannot help with that.")
    for mode in ("task", "per_turn"):
        bench = benches(mode)
        for task in bench.tasks("all"):
            traj = run_episode(policy, bench.episode(task.id), task_id=task.id, benchmark=bench.name)
            policy.requests = []
            valid, error_type, message = expected[task.id]
            assert (traj.passed, traj.reward) == (valid, float(valid)), task.id
            assert (traj.reasons.get("error_type"), traj.reasons.get("error")) == (error_type, message), task.id


@needs_venv
def test_hostile_calls_execute_nothing_and_get_an_error_result(gold, benches):
    """Unknown names, attribute and dunder tricks, a private method, a method of a class the task does not
    involve and a function held out until a later turn: each an error result, and the ground truth
    that follows still passes, so none of them changed the backends' state."""
    bench, tid = benches("per_turn"), "multi_turn_miss_func_0.turn0"
    hostile = [ToolCall("rm_everything", {}), ToolCall("cd.__globals__", {}), ToolCall("__class__", {}),
               ToolCall("__init__", {}), ToolCall("_load_scenario", {"scenario": {"root": {}}}),
               ToolCall("_load_scenario", {}), ToolCall("get_ticket", {"ticket_id": 1}),
               ToolCall("sort", {"file_name": "final_report.pdf"}), ToolCall("__import__", {"name": "os"}),
               ToolCall("cd", {"folder": "document", "__class__": 1})]
    script = [Reply(content="", tool_calls=hostile), *gold_script([gold["multi_turn_miss_func_0"][0]])]
    traj = play(bench, tid, script, ScriptedLLM([]))
    results = [m["content"] for m in traj.messages if m["role"] == "tool"][: len(hostile)]
    assert all(r.startswith("Error during execution: ") for r in results), results
    assert "is not a function you can call here" in results[4] and "unexpected keyword" in results[-1]
    assert traj.passed and traj.termination == "agent_stop", traj.reasons


@needs_venv
def test_bfcls_step_limit_ends_a_turn_after_21_replies_with_calls(gold, benches):
    """Whole task: the turn that reaches the limit ends the task, which BFCL fails as force-terminated.
    Per turn: the forced end of its only turn is checked as it stands (the right calls pass, as in BFCL)."""
    pwd = Reply(content="", tool_calls=[ToolCall("pwd", {})])
    traj = play(benches("task"), "multi_turn_base_0", [pwd] * 30, ScriptedLLM([]))
    assert (traj.steps, traj.termination, traj.reasons["error_type"]) == (21, "max_steps", "multi_turn:force_terminated")
    script = [*gold_script([gold["multi_turn_base_0"][0]])[:1], *[pwd] * 25]
    traj = play(benches("per_turn"), "multi_turn_base_0.turn0", script, ScriptedLLM([]))
    assert (traj.steps, traj.termination, traj.passed) == (21, "max_steps", True)


@needs_venv
def test_calls_that_do_not_decode_run_nothing_and_end_the_turn(benches):
    """BFCL executes nothing of a reply it cannot decode and moves on to the next turn."""
    bench = benches("task")
    ep = bench.episode("multi_turn_base_0")
    try:
        ep.reset()
        obs = ep.step("", [{"id": "a", "type": "function", "function": {"name": "mkdir", "arguments": "{oops"}},
                           {"id": "b", "type": "function", "function": {"name": "cd",
                                                                       "arguments": '{"folder": "document"}'}}])
        assert [m["role"] for m in obs.messages] == ["tool", "tool", "user"] and not obs.done
        assert all("nothing in this reply was executed" in m["content"] for m in obs.messages[:2])
        obs = ep.step("", [{"id": "c", "type": "function", "function": {"name": "pwd", "arguments": "[1]"}}])
        assert "not a JSON object" in obs.messages[0]["content"]
        obs = ep.step("", [{"id": "d", "type": "function", "function": {"name": "pwd",
                                                                        "arguments": '{"__malformed__": "x"}'}}])
        assert "nothing in this reply was executed" in obs.messages[0]["content"] and not obs.done
        assert ep.step("Done.", []).done
        score = ep.score("agent_stop")  # no call ran in any turn: BFCL's verdict on an empty first turn
        assert not score.passed and score.reasons["error_type"] == "multi_turn:empty_turn_model_response"
    finally:
        ep.close()


@needs_venv
def test_a_crash_inside_bfcls_code_is_a_recorded_episode_and_the_run_goes_on(gold, classes, tmp_path):
    """BFCL's code patched in the worker (BFCL's files untouched): GorillaFileSystem.mkdir kills the process
    and TicketAPI's scenario loader raises. Those episodes end as env_error; the others pass on a new worker."""
    boot = tmp_path / "boot.py"
    boot.write_text(textwrap.dedent("""
        import os, runpy, sys
        from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import gorilla_file_system, ticket_api
        gorilla_file_system.GorillaFileSystem.mkdir = lambda self, dir_name: os._exit(3)
        def broken(self, scenario, long_context=False):
            raise RuntimeError("scenario loader broke")
        ticket_api.TicketAPI._load_scenario = broken
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    """))
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {PY} {boot} "$@"\n')
    python.chmod(0o755)
    calls = lambda tid: {c["name"] for turn in gold[tid] for c in turn}  # noqa: E731
    base = [t for t in gold if "_base_" in t]
    mkdir = next(t for t in base if "mkdir" in calls(t) and "TicketAPI" not in classes[t])
    ticket = next(t for t in base if "TicketAPI" in classes[t])
    plain = [t for t in base if "mkdir" not in calls(t) and "TicketAPI" not in classes[t]][:3]
    bench = load_benchmark("bfcl", options={"python": str(python), "max_restarts": 3})
    try:
        order = [plain[0], mkdir, plain[1], ticket, plain[2]]
        trajs = [play(bench, tid, gold_script(gold[tid]), ScriptedLLM([])) for tid in order]
        assert [t.termination for t in trajs] == ["agent_stop", "env_error", "agent_stop", "env_error", "agent_stop"]
        assert [t.passed for t in trajs] == [True, False, True, False, True]
        assert "crashed" in trajs[1].reasons["error"] and "scenario loader broke" in trajs[3].reasons["error"]
        assert bench.restarts == 1
        # through the rollout engine: a do-nothing agent still crashes the worker when BFCL's checker
        # replays the ground truth's mkdir to score it
        again = rollout(bench, ScriptedLLM(lambda m, t: "No."), [mkdir, ticket, *plain], TrajectoryStore(tmp_path),
                        concurrency=1, progress=False)
        assert [t.termination for t in again] == ["env_error", "env_error", "agent_stop", "agent_stop", "agent_stop"]
        assert "crashed" in again[0].reasons["score_error"] and bench.restarts == 2
    finally:
        bench.close()


@needs_venv
@pytest.mark.parametrize("mode", ["task", "per_turn"])
def test_train_and_test_split_by_scenario(benches, mode):
    bench = benches(mode)
    scenario = lambda tid: re.match(r"multi_turn_[a-z_]+_(\d+)", tid).group(1)  # noqa: E731
    train, test = bench.tasks("train"), bench.tasks("test")
    assert {scenario(t.id) for t in train}.isdisjoint(scenario(t.id) for t in test)
    assert {bfcl_id(t.id)[0] for t in train}.isdisjoint(bfcl_id(t.id)[0] for t in test)  # no task's turns split
    assert sorted(t.id for t in train + test) == sorted(t.id for t in bench.tasks("all"))
    assert 0.35 < len(test) / len(train + test) < 0.65
    rule = lambda n: "test" if int(hashlib.sha256(f"bfcl-multi-turn:{n}".encode()).hexdigest(), 16) % 2 else "train"
    assert all(rule(scenario(t.id)) == "train" for t in train) and all(rule(scenario(t.id)) == "test" for t in test)
    categories = {c: bench.tasks(c) for c in ("base", "miss_func", "miss_param", "long_context")}
    assert sum(map(len, categories.values())) == len(bench.tasks("all"))


@needs_venv
def test_a_category_narrows_every_split_and_spec_binds_each_tasks_tools(benches):
    bench = load_benchmark("bfcl:miss_param", options={"mode": "per_turn"})
    try:
        assert bench.splits() == ["miss_param", "all", "train", "test"] and bench.name == "bfcl:miss_param"
        assert all("_miss_param_" in t.id for t in bench.tasks("test")) and bench.tasks("test")
        spec = bench.spec()
        names = {t["function"]["name"] for t in spec["tools"]}
        assert len(names) == 128 and set(spec["task_tools"]) == {t.id for t in bench.tasks("all")}
        assert all(set(v) <= names and v for v in spec["task_tools"].values())
        assert "You are an expert in composing functions." in spec["system_prompt"]
        cd = next(t["function"] for t in spec["tools"] if t["function"]["name"] == "cd")
        assert cd["parameters"]["type"] == "object" and "response field" in cd["description"]
    finally:
        bench.close()
    with pytest.raises(BenchmarkError, match="disagree"):
        load_benchmark("bfcl:base", options={"category": "miss_func"})
    with pytest.raises(BenchmarkError, match="unknown category"):
        load_benchmark("bfcl:nope")


def test_without_its_venv_bfcl_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path))
    with pytest.raises(BenchmarkError) as err:
        load_benchmark("bfcl:base")
    assert str(err.value) == ("bfcl is not installed: run `trace-rl benchmarks install bfcl` "
                              "(or give --bench-opt python=/path/to/its/venv/bin/python)")


def test_the_install_recipe_takes_the_registry_a_wheel_or_a_folder_of_wheels(tmp_path):
    assert recipe().steps == (("--no-deps", f"bfcl-eval=={BFCL_VERSION}", "mpmath==1.3.0", "filelock==3.20.0"),)
    wheel = tmp_path / f"bfcl_eval-{BFCL_VERSION}-py3-none-any.whl"
    wheel.write_bytes(b"")
    assert recipe(str(wheel)).steps[0][:4] == ("--no-deps", "--find-links", str(tmp_path), str(wheel))
    assert recipe(str(tmp_path)).steps[0][:4] == ("--no-deps", "--no-index", "--find-links", str(tmp_path))
    with pytest.raises(BenchmarkError, match="does not exist"):
        recipe(str(tmp_path / "missing.whl"))


@needs_venv
@pytest.mark.slow
def test_the_embedded_model_plays_two_turns_end_to_end(benches, tmp_path):
    from trace_rl.models.llm import LLM, LLMConfig

    bench = benches("per_turn", category="base")
    # the two first-turn tasks with the fewest tools and the same ones (a shared prompt prefix): CPU minutes
    first = sorted((t.id for t in bench.tasks("test") if t.id.endswith(".turn0")),
                   key=lambda tid: (len(bench.task_tools(tid)), tid))
    ids = [tid for tid in first if bench.task_tools(tid) == bench.task_tools(first[0])][:2]
    trajs = rollout(bench, LLM(LLMConfig(model="qwen2.5-coder-0.5b", max_tokens=256)), ids,
                    TrajectoryStore(tmp_path), concurrency=1, progress=False)
    for traj in trajs:
        assert traj.termination in ("agent_stop", "max_steps") and traj.steps >= 1, traj.reasons
        assert traj.reasons.get("checker") == "valid" or traj.reasons["error_type"].startswith("multi_turn:")
        assert traj.messages[0]["role"] == "system" and any(m["role"] == "assistant" for m in traj.messages)
