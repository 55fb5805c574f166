"""ToolSandbox as a built-in benchmark, played and scored by ToolSandbox's own code in its own venv
(`scripts/setup.sh --benchmarks toolsandbox` makes it): gold agents score 1, an empty agent scores
what ToolSandbox's own loop scores for its UnhelpfulAgent, crashes are recorded episodes, hostile
tool calls execute nothing, and the splits keep a scenario's variants together."""
import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from doubles import ScriptedLLM
from trace_rl.agents.base_agent import run_episode
from trace_rl.models.llm import LLM, LLMConfig
from trace_rl.models.chat import Reply, ToolCall
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.benchmark import BenchmarkError, load_benchmark
from trace_rl.evals.rollout import rollout
from trace_rl.evals.toolsandbox import (VENDORED, VENDORED_SHA256, ToolSandboxBenchmark, installed_python, pins,
                                        source_tree)

VENDOR = next((p for p in (Path(os.environ.get("TRACE_RL_TOOLSANDBOX_SOURCE") or "/nonexistent"),
                           Path(__file__).resolve().parents[3] / "shared" / "vendor" / VENDORED)
               if p.name == VENDORED and p.is_file()), None)  # CI: ../shared/vendor/ beside the checkout
needs_venv = pytest.mark.skipif(installed_python() is None, reason="ToolSandbox's venv is not installed: run "
                                "`trace-rl benchmarks install toolsandbox` (scripts/setup.sh --benchmarks toolsandbox)")
UNHELPFUL = "I am sorry, but I cannot assist with that."  # ToolSandbox's own UnhelpfulAgent says this


@pytest.fixture(scope="module")
def end_bench():
    bench = load_benchmark("toolsandbox", options={"user": "end"})
    yield bench
    bench.close()


def _first_user(messages: list[dict]) -> str:
    return next(m["content"] for m in messages if m["role"] == "user")


def _person_id(messages: list[dict]) -> str:
    return re.search(r"'person_id': '([^']+)'", messages[-1]["content"]).group(1)


# a perfect agent, turn by turn, keyed by the scenario's first user message (what the agent sees)
GOLD = {
    "Turn off wifi": [ToolCall("set_wifi_status", {"on": False}), "Wifi is turned off"],
    "Turn on wifi": [ToolCall("get_low_battery_mode_status", {}), ToolCall("set_low_battery_mode_status", {"on": False}),
                     ToolCall("set_wifi_status", {"on": True}), "Wifi has been turned on."],
    "Remove phone number +12453344098 from my contact": {
        "remove_contact_by_phone": [
            ToolCall("search_contacts", {"phone_number": "+12453344098"}),
            lambda m: ToolCall("remove_contact", {"person_id": _person_id(m)}),
            "Phone number +12453344098 has been removed from your contact"],
        "remove_contact_by_phone_no_remove_contact_insufficient_information": [
            "I cannot remove the phone number from your contact , because I don't have the tools available."]},
    "I want to delete someone from my contact": [
        "What is the phone number of the contact you want to delete?",  # the user simulator answers
        ToolCall("search_contacts", {"phone_number": "+12453344098"}),
        lambda m: ToolCall("remove_contact", {"person_id": _person_id(m)}),
        "Phone number +12453344098 has been removed from your contact"],
}
GOLD_IDS = ["wifi_off", "turn_on_wifi_low_battery_mode", "remove_contact_by_phone",
            "remove_contact_by_phone_no_remove_contact_insufficient_information"]


def gold_agent() -> ScriptedLLM:
    def script(messages, tools):
        turns = GOLD[_first_user(messages)]
        if isinstance(turns, dict):  # the same first message in two scenarios: told apart by the tools offered
            names = {t["function"]["name"] for t in tools}
            turns = turns["remove_contact_by_phone" if "remove_contact" in names else
                          "remove_contact_by_phone_no_remove_contact_insufficient_information"]
        turn = turns[sum(m["role"] == "assistant" for m in messages)]
        return turn(messages) if callable(turn) else turn
    return ScriptedLLM(script, name="gold")


@needs_venv
def test_gold_agents_score_full_marks_through_the_real_loop(end_bench, tmp_path):
    """Single-tool, state-dependency, canonicalization and insufficient-information scenarios."""
    tasks = {t.id: t for t in end_bench.tasks("all")}
    assert set(GOLD_IDS) <= set(tasks)
    trajs = rollout(end_bench, gold_agent(), GOLD_IDS, TrajectoryStore(tmp_path), concurrency=2, progress=False)
    for t in trajs:
        assert (t.reward, t.passed, t.termination) == (1.0, True, "agent_stop"), (t.task_id, t.reasons)
        assert all(sim == 1.0 for _, sim in t.reasons["milestone_matches"].values()), t.reasons
        assert len(t.reasons["milestone_matches"]) == t.reasons["milestones"] >= 1
    by_id = {t.task_id: t for t in trajs}
    assert by_id["turn_on_wifi_low_battery_mode"].reasons["categories"] == ["state_dependency", "multiple_tool_call",
                                                                          "single_user_turn"]
    first = by_id["wifi_off"].messages
    assert first[0] == {"role": "system", "content": "Don't make assumptions about what values to plug into "
                        "functions. Ask for clarification if a user request is ambiguous."}
    assert first[3]["role"] == "tool" and first[3]["tool_call_id"] == first[2]["tool_calls"][0]["id"]


@needs_venv
def test_a_multi_turn_scenario_with_toolsandboxs_user_simulator_prompt_answered_by_the_user_llm(tmp_path):
    seen = []

    def user(messages, tools):
        seen.append((messages, tools))
        if "removed" in messages[-1]["content"]:
            return ToolCall("end_conversation", {})
        return "+12453344098"

    bench = ToolSandboxBenchmark(user="simulator", user_llm=ScriptedLLM(user, name="user"))
    try:
        tid = "remove_contact_by_phone_multiple_user_turn"
        traj = run_episode(gold_agent(), bench.episode(tid), task_id=tid, benchmark=bench.name)
    finally:
        bench.close()
    assert (traj.reward, traj.passed, traj.termination) == (1.0, True, "user_stop"), traj.reasons
    assert [m["content"] for m in traj.messages if m["role"] == "user"] == [
        "I want to delete someone from my contact", "+12453344098"]
    messages, tools = seen[0]
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You are no longer an assistant.")
    assert "Delete a contact by phone number +12453344098" in [m for m in messages if m["role"] == "system"][-1]["content"]
    assert messages[-1] == {"role": "user", "content": GOLD["I want to delete someone from my contact"][0]}
    assert [t["function"]["name"] for t in tools] == ["end_conversation"] and len(seen) == 2


UNHELPFUL_PLAY = textwrap.dedent('''
    """ToolSandbox's own loop (Scenario.play) with its UnhelpfulAgent and a user who ends the
    conversation after the agent's reply; prints {scenario: similarity}."""
    import json, random, sys
    from tool_sandbox.common.execution_context import RoleType
    from tool_sandbox.common.message_conversion import Message
    from tool_sandbox.common.tool_discovery import ToolBackend
    from tool_sandbox.roles.base_role import BaseRole
    from tool_sandbox.roles.execution_environment import ExecutionEnvironment
    from tool_sandbox.roles.unhelpful_agent import UnhelpfulAgent
    from tool_sandbox.scenarios import named_scenarios

    class EndingUser(BaseRole):
        role_type = RoleType.USER

        def respond(self, ending_index=None):
            if self.get_messages(ending_index=ending_index)[-1].sender == RoleType.SYSTEM:
                return
            self.add_messages([Message(sender=RoleType.USER, recipient=RoleType.EXECUTION_ENVIRONMENT,
                                       content="end_conversation()")])

    random.seed(42)
    scenarios = named_scenarios(preferred_tool_backend=ToolBackend.DEFAULT)
    out = {}
    for name in sys.argv[1:]:
        s = scenarios[name]
        roles = {RoleType.USER: EndingUser(), RoleType.AGENT: UnhelpfulAgent(),
                 RoleType.EXECUTION_ENVIRONMENT: ExecutionEnvironment()}
        context = s.play(roles, name)
        out[name] = s.evaluation.evaluate(execution_context=context, max_turn_count=s.max_messages).similarity
    print(json.dumps(out))
''')


@needs_venv
def test_an_empty_agent_scores_what_toolsandboxs_own_loop_gives_its_unhelpful_agent(end_bench, tmp_path):
    ids = ["wifi_off", "search_phone_number_with_name", "turn_on_wifi_low_battery_mode",
           "remove_contact_by_phone_no_remove_contact_insufficient_information", "find_days_till_holiday"]
    script = tmp_path / "unhelpful.py"
    script.write_text(UNHELPFUL_PLAY)
    proc = subprocess.run([str(installed_python()), str(script), *ids], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = json.loads(proc.stdout.strip().splitlines()[-1])
    trajs = rollout(end_bench, ScriptedLLM(lambda m, t: UNHELPFUL), ids, TrajectoryStore(tmp_path / "r"),
                    concurrency=2, progress=False)
    got = {t.task_id: t.reward for t in trajs}
    assert got == pytest.approx(want, abs=1e-9)
    assert all(0.0 <= v < 1.0 for v in got.values()) and not any(t.passed for t in trajs)
    assert got["wifi_off"] < 0.5 < got["remove_contact_by_phone_no_remove_contact_insufficient_information"]


CRASHING_SIDE = textwrap.dedent('''
    """The real worker, with ToolSandbox's execution environment made to fail in two scenarios."""
    import importlib.util, os

    spec = importlib.util.spec_from_file_location("tsb_worker", {worker!r})
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)


    def fails(*args, **kwargs):
        raise RuntimeError("injected: ToolSandbox's execution environment failed")


    class CrashingBench(worker.ToolSandboxBench):
        def episode(self, task_id):
            ep = super().episode(task_id)
            if task_id == "wifi_off":
                ep.env.respond = fails
            if task_id == "get_wifi":
                ep.env.respond = lambda *a, **k: os._exit(3)  # the worker process dies mid-episode
            return ep
''')


@needs_venv
def test_a_crash_inside_toolsandbox_is_a_recorded_error_episode_and_the_run_goes_on(tmp_path):
    from trace_rl.evals import toolsandbox

    (tmp_path / "side.py").write_text(CRASHING_SIDE.format(worker=str(Path(toolsandbox.__file__).parent /
                                                                        "toolsandbox_worker.py")))

    class Crashing(ToolSandboxBenchmark):
        worker_target = f"{tmp_path / 'side.py'}:CrashingBench"

    bench = Crashing(user="end")
    ids = ["wifi_off", "get_wifi", "cellular_off"]
    policy = ScriptedLLM(lambda m, t: {"Turn off wifi": ToolCall("set_wifi_status", {"on": False}),
                                       "Is my wifi on?": ToolCall("get_wifi_status", {}),
                                       "Turn off cellular": ToolCall("set_cellular_service_status", {"on": False})}
                         [_first_user(m)] if m[-1]["role"] == "user" else "Cellular service is turned off")
    try:
        trajs = {t.task_id: t for t in rollout(bench, policy, ids, TrajectoryStore(tmp_path / "r"), concurrency=1,
                                               progress=False)}
        assert bench.restarts == 1
    finally:
        bench.close()
    assert trajs["wifi_off"].termination == "env_error" and trajs["wifi_off"].reward == 0.0
    assert "injected: ToolSandbox's execution environment failed" in trajs["wifi_off"].reasons["error"]
    assert trajs["get_wifi"].termination == "env_error" and trajs["get_wifi"].reasons["error_kind"] == "crashed"
    assert (trajs["cellular_off"].termination, trajs["cellular_off"].reward) == ("agent_stop", 1.0)


class RawCall(ToolCall):
    """A tool call as a model may write it: any name, arguments that need not be JSON."""

    def __init__(self, name: str, raw: str):
        super().__init__(name, {"__malformed__": raw})
        self.raw = raw

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.raw}}


@needs_venv
def test_hostile_tool_calls_execute_nothing_and_get_error_tool_messages(end_bench, tmp_path):
    marker = tmp_path / "pwned"
    touch = f"__import__('os').system('touch {marker}')"
    hostile = [RawCall(touch, "{}"), RawCall("rm_rf", '{"path": "/"}'), RawCall("set_wifi_status", "not json"),
               RawCall("set_wifi_status", '{"on": NaN}'), RawCall("set_wifi_status", '[false]'),
               RawCall("set_wifi_status", '{"on": 1e999}'), RawCall("set_wifi_status", '{"__malformed__": "x"}'),
               ToolCall("set_wifi_status", {"on": "False", f"x'); {touch} #": 1}),
               ToolCall("set_wifi_status", {"on": f"'); {touch}; ('"})]
    policy = ScriptedLLM([Reply("", hostile), "Wifi is turned off"])
    traj = run_episode(policy, end_bench.episode("wifi_off"), task_id="wifi_off", benchmark=end_bench.name)
    assert not marker.exists()
    results = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [c.id for c in hostile]
    errors = [m["content"].split(":")[0] for m in results]
    assert errors == ["KeyError", "KeyError"] + ["ValueError"] * 5 + ["TypeError", "TypeError"], results
    assert "is not a known allowed tool" in results[0]["content"]
    # wifi was never turned off, so the (otherwise gold) reply does not complete the scenario
    assert traj.termination == "agent_stop" and traj.reward < 1.0 and traj.reasons["milestone_matches"]["0"][1] < 1


@needs_venv
def test_splits_are_disjoint_keep_variants_together_and_name_what_is_excluded(end_bench):
    full = ToolSandboxBenchmark(user="simulator")
    try:
        spec = full.spec()
        every = {t.id for t in full.tasks("all")}
        train, test = {t.id for t in full.tasks("train")}, {t.id for t in full.tasks("test")}
        assert train and test and not train & test and train | test == every
        assert len(every) + len(spec["excluded"]) == spec["set_size"] == 129  # TRACE's set: no distraction tools
        assert len(spec["excluded"]) == 38 and spec["excluded"]["convert_currency"].startswith("needs RapidAPI")
        assert set(full.excluded()) == set(spec["excluded"])  # with a user simulator nothing else is left out
        families: dict[str, set] = {}
        for name, info in spec["scenarios"].items():
            families.setdefault(info["family"], set()).add(info["split"])
        assert all(len(s) == 1 for s in families.values()) and len(families) < len(every)
        assert spec["scenarios"]["turn_on_wifi_low_battery_mode_implicit"]["family"] == "turn_on_wifi"
        assert {spec["scenarios"][n]["split"] for n in ("remove_contact_by_phone", "remove_contact_by_phone_alt",
                                                        "remove_contact_by_phone_multiple_user_turn",
                                                        "remove_contact_by_phone_ambiguous")} in ({"train"}, {"test"})
        base = {t.id for t in full.tasks("base")}
        assert len(base) == 33 and "wifi_off" in base and "wifi_off_alt" not in base
        assert {"canonicalization", "state_dependency", "insufficient_information", "multiple_user_turn"} <= \
            set(full.splits())
        assert set(spec["task_tools"]["turn_on_wifi_low_battery_mode"]) == {
            "set_wifi_status", "set_low_battery_mode_status", "get_wifi_status", "get_low_battery_mode_status"}
    finally:
        full.close()
    # user=end plays no multi-user-turn scenario, and names them
    multi = "remove_contact_by_phone_multiple_user_turn"
    assert "multiple_user_turn" not in end_bench.splits()
    assert multi not in {t.id for t in end_bench.tasks("all")} and multi in end_bench.excluded()
    with pytest.raises(BenchmarkError, match="multiple user turns need user=simulator") as err:
        end_bench.episode(multi)
    assert "\n" not in str(err.value)
    assert {t.id for t in end_bench.tasks("train")} | {t.id for t in end_bench.tasks("test")} == \
        {t.id for t in end_bench.tasks("all")}


@needs_venv
def test_a_subset_variant_cuts_every_split():
    bench = load_benchmark("toolsandbox:base", options={"user": "end"})
    try:
        assert bench.name == "toolsandbox:base" and len(bench.tasks("all")) == 33
        assert {t.id for t in bench.tasks("train")} | {t.id for t in bench.tasks("test")} == \
            {t.id for t in bench.tasks("base")}
        assert "insufficient_information" not in bench.splits()
    finally:
        bench.close()
    with pytest.raises(BenchmarkError, match="unknown subset 'nope'"):
        load_benchmark("toolsandbox:nope")


def test_without_its_venv_the_benchmark_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path))
    with pytest.raises(BenchmarkError) as err:
        load_benchmark("toolsandbox")
    assert "\n" not in str(err.value) and "run `trace-rl benchmarks install toolsandbox`" in str(err.value)


def test_the_source_is_verified_unpacked_once_and_its_pins_fixed(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / VENDORED
    fake.write_bytes(b"not the archive")
    with pytest.raises(BenchmarkError, match="not the vendored archive's"):
        source_tree(str(fake))
    with pytest.raises(BenchmarkError, match="neither a folder, an archive nor a git URL"):
        source_tree(str(tmp_path / "missing.tar.gz"))
    with pytest.raises(BenchmarkError, match=r"git clone .* failed: .*; offline, name a source instead: "
                                             r"TRACE_RL_TOOLSANDBOX_SOURCE=PATH") as err:
        source_tree(f"file://{tmp_path}/no-such-repo.git")  # what an offline clone of the default source meets
    assert "\n" not in str(err.value) and not list((tmp_path / "cache").rglob(".toolsandbox-git-*"))
    if VENDOR is None:
        pytest.skip("no vendored archive (../shared/vendor/ or $TRACE_RL_TOOLSANDBOX_SOURCE)")
    tree = source_tree(str(VENDOR))
    assert (tree / "LICENSE").is_file() and (tree / "tool_sandbox" / "scenarios").is_dir()
    assert source_tree(str(VENDOR)) == tree and source_tree(str(tree)) == tree  # unpacked once; a folder is used as is
    deps = pins(tree)
    assert "ccy==1.4.0" in deps and "ccy==1.3.1" not in deps and "pydantic==2.7.4" in deps
    assert VENDORED_SHA256.startswith("c3146e69")


IMPORTS = textwrap.dedent('''
    """Run with -S (no .pth file imports anything): the worker builds its scenarios, plays a
    tool call, hands over the user's view, is scored; prints the distributions it imported."""
    import importlib.metadata, importlib.util, json, site, sys
    sys.path.append(sys.argv[2])
    spec = importlib.util.spec_from_file_location("w", sys.argv[1])
    w = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w)
    ep = w.ToolSandboxBench().episode("find_days_till_holiday")
    ep.reset()
    ep.step("", [{"id": "a", "function": {"name": "search_holiday", "arguments": '{"holiday_name": "Christmas"}'}}])
    assert ep.step("It is in a while.", [])["user_turn"]["tools"]
    ep.end_conversation()
    ep.score("agent_stop")
    found = importlib.metadata.packages_distributions()
    print(json.dumps(sorted({d for m in list(sys.modules) for d in found.get(m.split(".")[0], [])})))
''')


@needs_venv
def test_the_recorded_worker_distributions_cover_what_the_worker_imports(tmp_path):
    """WORKER_DISTRIBUTIONS is what to carry as wheels to a machine without a registry."""
    from trace_rl.evals import toolsandbox

    python = str(installed_python())
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / "imports.py").write_text(IMPORTS)
    proc = subprocess.run([python, "-S", str(tmp_path / "imports.py"),
                           str(Path(toolsandbox.__file__).parent / "toolsandbox_worker.py"), site],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    norm = lambda name: name.split("==")[0].lower().replace("_", "-")
    imported = {norm(d) for d in json.loads(proc.stdout.strip().splitlines()[-1])} - {"tool-sandbox"}
    recorded = {norm(d) for d in toolsandbox.WORKER_DISTRIBUTIONS}
    assert imported and imported <= recorded, sorted(imported - recorded)
    assert not {"transformers", "vertexai", "anthropic", "langchain"} & imported  # pins the worker never imports


@pytest.mark.slow
@needs_venv
def test_the_embedded_model_plays_two_scenarios_end_to_end(end_bench, tmp_path):
    policy = LLM(LLMConfig(model="qwen2.5-coder-0.5b", max_tokens=256))
    ids = ["wifi_off", "search_phone_number_with_name"]
    trajs = rollout(end_bench, policy, ids, TrajectoryStore(tmp_path), concurrency=2, progress=False)
    for t in trajs:
        assert t.termination in ("agent_stop", "max_steps"), (t.task_id, t.termination, t.reasons)
        assert 0.0 <= t.reward <= 1.0 and t.reasons["milestones"] >= 1 and t.steps >= 1
        assert t.messages[1] == {"role": "user", "content": _first_user(t.messages)}
