import json

import pytest

from doubles import ScriptedLLM
from trace_rl.agents.builders import Target
from trace_rl.agents.builders.code import EnvDraft, parse_draft, reference_example
from trace_rl.agents.env_builder import synthesize
from trace_rl.agents.verifier import VerifyConfig
from trace_rl.core.records import Capability
from paths import ROOT


def shipped_spec(avoid_domain: str) -> dict:
    """A verified spec shipped in sandbox/envs/, from another domain than `avoid_domain`."""
    root = ROOT / "sandbox" / "envs"
    return json.loads(next(p for p in sorted(root.glob("*.spec.json"))
                           if not p.name.endswith(f"_{avoid_domain}.spec.json")).read_text())


def test_draft_validation_parses_but_never_runs():
    assert parse_draft("```python\nclass Env:\n    pass\n```").code.startswith("class Env")
    with pytest.raises(ValueError, match="does not parse"):
        EnvDraft(code="class Env(:\n")
    with pytest.raises(ValueError, match="class Env"):
        EnvDraft(code="x = 1\n")
    with pytest.raises(ValueError, match="do not import tau2"):
        EnvDraft(code="import tau2\nclass Env: pass\n")
    # a module that would delete files on import is only parsed here
    EnvDraft(code="import shutil\nshutil.rmtree('/')\nclass Env: pass\n")


@pytest.mark.docker
@pytest.mark.ci
@pytest.mark.slow
def test_synthesis_loop_feeds_findings_back(tmp_path, sandbox_image):
    """Round 1 is broken (reward always 1), round 2 is the reference env: verified in 2 rounds."""
    from trace_rl.evals.benchmark import load_benchmark

    b = load_benchmark("tau2:airline")
    ep = b.episode(b.tasks("test")[0].id, with_user=False)
    target = Target("tau2:airline", ep.tools, ep.env.get_policy(), ep.system_prompt[:500])
    good = reference_example()
    broken = good.replace("    def score(self):\n",
                          "    def score(self):\n        return {'components': {'a': 1.0}, 'weights': {'a': 1.0}}\n", 1)
    builder = ScriptedLLM([f"```python\n{broken}```", f"```python\n{good}```"])
    cap = Capability(name="precondition_verification", description="Checks rules before acting. Matters.")
    result = synthesize(cap, target, builder, tmp_path, cfg=VerifyConfig(seeds=12, determinism_seeds=2),
                        log=lambda *a: None)
    assert result.status == "verified" and result.rounds == 2
    r1 = json.loads((tmp_path / "attempt_01" / "verifier_report.json").read_text())
    assert not r1["passed"] and any(f["check"] == "trivial_do_nothing" and not f["passed"] for f in r1["findings"])
    assert "trivial_do_nothing" in builder.requests[1][-1]["content"]  # findings went back to the builder
    assert (tmp_path / "attempt_02" / "env.py").read_text() == good.strip() + "\n"


@pytest.mark.docker
@pytest.mark.ci
@pytest.mark.slow
def test_synthesis_gives_up_to_a_human(tmp_path, sandbox_image):
    builder = ScriptedLLM(["```python\nclass Env:\n    pass\n```"] * 2)
    target = Target("t", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "", "")
    result = synthesize(Capability(name="x_y", description="d."), target, builder, tmp_path, max_rounds=2,
                        log=lambda *a: None)
    assert result.status == "needs_human" and "contract" in result.findings
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt_01", "attempt_02", "result.json"]


def test_an_unparsable_module_is_kept_with_the_error(tmp_path):
    builder = ScriptedLLM(["```python\nclass Env(:\n```"] * 3)
    target = Target("t", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "", "")
    result = synthesize(Capability(name="x_y", description="d."), target, builder, tmp_path, max_rounds=1,
                        log=lambda *a: None)
    assert result.status == "needs_human" and "does not parse" in result.findings
    assert (tmp_path / "attempt_01" / "builder_reply.txt").read_text() == "```python\nclass Env(:\n```"
    assert len(builder.requests) == 3 and "not valid" in builder.requests[2][-1]["content"]


def test_a_failing_builder_endpoint_is_a_recorded_round_not_a_crash(tmp_path):
    def timeout(messages, tools):
        raise TimeoutError("Request timed out.")

    target = Target("t", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "", "")
    result = synthesize(Capability(name="x_y", description="d."), target, ScriptedLLM(timeout), tmp_path, max_rounds=1,
                        log=lambda *a: None)
    assert result.status == "needs_human" and "endpoint failed: TimeoutError" in result.findings
    assert "Request timed out" in json.loads((tmp_path / "attempt_01" / "builder_error.json").read_text())["error"]


@pytest.mark.parametrize("cap, expected", [
    (Capability(name="multilingual_poetry_generation", description="Writes sonnets in French. It is the key to the task."),
     None),
    (Capability(name="empathetic_small_talk", description="Keeps the user happy with small talk and is polite to them."),
     None),
    (Capability(name="tool_call_precision", description="Anything."), "tool_call_precision"),
    (Capability(name="exact_tool_arguments", description="Anything."), "tool_call_precision"),
    (Capability(name="schema_exact_arguments", description="Calls the tool the ticket needs with exactly the arguments "
      "its schema allows, with nothing invented. Its absence shows as made-up properties."), "tool_call_precision"),
])
def test_library_match_needs_content_words_or_an_alias(cap, expected):
    """Shared stop words ("the", "is", "and") never make a match (they used to)."""
    from trace_rl.agents.env_library import library_match

    got = library_match(cap, "tau2:telecom")
    assert (got and got["capability"].name) == expected
    if got:
        assert got["capability"].description.startswith("Reference environment") and got["why"]


def test_library_match_is_per_target_domain():
    from trace_rl.agents.env_library import library_match

    cap = Capability(name="precondition_verification", description="Checks state first.")
    assert library_match(cap, "tau2:airline")["capability"].name == "precondition_verification"
    assert library_match(cap, "tau2:telecom") is None


@pytest.mark.docker
def test_spec_mode_feeds_spec_findings_back_until_verified(tmp_path, sandbox_image):
    """Spec mode: round 1's spec names a field no entity has (code declares it, and says so) and a
    task fact nobody defined (a check_spec finding naming it goes back to the builder); round 2 is
    the shipped example spec: verified, its module rendered by code."""
    from trace_rl.agents.env_builder import builder_mode
    from trace_rl.evals.benchmark import load_benchmark

    good = shipped_spec("retail")  # the airline example
    bad = json.loads(json.dumps(good).replace("{task.reservation.reservation_id}", "{task.reservation.booking_ref}", 1))
    bad["reference"][-1]["when"] = {"op": "state_equals", "path": "task.refundable", "value": True}
    builder = ScriptedLLM([json.dumps(bad), json.dumps(good)])
    target = Target.of(load_benchmark("tau2:airline"))
    cap = Capability(name="precondition_verification", description="Checks rules before acting. Matters.")
    result = synthesize(cap, target, builder, tmp_path, max_rounds=2, mode="spec",
                        cfg=VerifyConfig(seeds=12, determinism_seeds=2), log=lambda *a: None)
    assert result.status == "verified" and result.rounds == 2
    r1 = json.loads((tmp_path / "attempt_01" / "verifier_report.json").read_text())
    assert not r1["passed"] and "refundable" in r1["feedback"] and "booking_ref" in " ".join(r1["repairs"])
    assert json.loads((tmp_path / "attempt_01" / "builder_spec.json").read_text()) == bad  # as the model wrote it
    assert "refundable" in builder.requests[1][-1]["content"]  # the finding went back to the builder
    assert json.loads((tmp_path / "attempt_02" / "spec.json").read_text()) == good
    module = (tmp_path / "attempt_02" / "env.py").read_text()
    assert "class Env(SpecEnv)" in module and repr(target.policy)[:80] in module  # the policy, copied by code
    assert builder_mode("auto", builder) == "pattern" and builder_mode("code", builder) == "code"


def test_code_suggests_a_behaviour_for_each_target_tool():
    from trace_rl.agents.builders.spec import tool_suggestions
    from trace_rl.agents.env_spec import suggest_behaviour

    fn = lambda name, *args: {"name": name, "parameters": {"properties": {a: {"type": "string"} for a in args},
                                                           "required": list(args)}}
    assert suggest_behaviour(fn("get_order_details", "order_id"))[0] == {"kind": "read", "entity": "order",
                                                                         "arg": "order_id"}
    assert suggest_behaviour(fn("suspend_line", "customer_id", "line_id", "reason"))[0]["entity"] == "line"
    assert suggest_behaviour(fn("find_user_id_by_email", "email"))[0] == {"kind": "read", "entity": "user",
                                                                          "arg": "email", "field": "email"}
    assert suggest_behaviour(fn("search_direct_flight", "origin", "date"))[0]["where"] == {
        "origin": "{args.origin}", "date": "{args.date}"}
    assert suggest_behaviour(fn("transfer_to_human_agents", "summary"))[0]["kind"] == "const"
    assert suggest_behaviour(fn("toggle_airplane_mode"))[0]["kind"] == "const"
    lines, skeletons = tool_suggestions([{"function": fn("get_order_details", "order_id")},
                                         {"function": fn("cancel_pending_order", "order_id", "reason")}])
    assert "suggested:" in lines and json.loads(skeletons) == {
        "order": {"count": [3, 6], "fields": {"order_id": {"type": "id", "pattern": "O{n:04d}"}}}}
    _, skeletons = tool_suggestions([{"function": fn("find_user_id_by_email", "email")},  # listed first, as in retail
                                     {"function": fn("get_user_details", "user_id")}])
    assert list(json.loads(skeletons)["user"]["fields"]) == ["user_id", "email"]  # keyed by the id, then the lookup


@pytest.mark.parametrize("domain", ["airline", "retail", "telecom"])
def test_a_spec_that_only_renames_the_starter_is_a_finding_and_a_real_one_is_not(domain, tmp_path, monkeypatch):
    """The 1.5B sent the starter back with its entity renamed for three of four capabilities and
    every automatic check passed it; it trains nothing, so it is a finding that goes back."""
    from trace_rl.agents import env_builder
    from trace_rl.agents.builders.spec import copies_starter, starter_spec
    from trace_rl.agents.env_builder import verify_attempt
    from trace_rl.evals.benchmark import load_benchmark

    target = Target.of(load_benchmark(f"tau2:{domain}"))
    copy = json.loads(json.dumps(starter_spec(target.tools, "x")).replace("reference_code", "ref_code"))
    entity = next(iter(copy["entities"]))
    copy = json.loads(json.dumps(copy).replace(f"task.{entity}.", "task.thing.").replace(f'"{entity}"', '"thing"'))
    assert copies_starter(copy, target.tools)
    # the proof run's 1.5B: the same task, the record looked up by another tool and argument
    other = next(t["function"] for t in target.tools if t["function"]["name"] != copy["reference"][0]["call"]
                 and (t["function"].get("parameters") or {}).get("properties"))
    arg = next(iter(other["parameters"]["properties"]))
    by_other = json.loads(json.dumps(copy))
    for step in (by_other["reference"][0], by_other["reward"][0]["pred"]):
        step[("call" if "call" in step else "tool")] = other["name"]
        step["args"] = {arg: next(iter(step["args"].values()))}
    assert copies_starter(by_other, target.tools)
    assert not copies_starter(shipped_spec(domain), target.tools)
    extended = json.loads(json.dumps(copy))
    extended["reward"].append({"name": "no_cancel", "weight": 0.2, "pred": {"op": "not_called", "tool": "x"}})
    assert not copies_starter(extended, target.tools)  # extending it is what the builder is asked to do

    monkeypatch.setattr(env_builder, "check_in_sandbox", lambda spec, tools: [])  # the spec's own checks pass
    adir = tmp_path / "attempt_01"
    adir.mkdir()
    (adir / "spec.json").write_text(json.dumps(copy))
    (adir / "env.py").write_text("# rendered")
    report = verify_attempt({"round": 1, "env": str(adir / "env.py")}, Capability(name="precondition_verification"), target)
    assert not report["passed"] and "starter_copy" in report["feedback"]
    assert "precondition_verification decides the reward" in report["feedback"]


@pytest.mark.docker
@pytest.mark.parametrize("domain", ["airline", "retail", "telecom"])
def test_the_starter_spec_code_writes_is_valid_on_each_target(domain, sandbox_image):
    """The builder's example is written by code on the target's own tools and passes every check:
    the spec's own and the verifier's automatic ones in the sandbox (the target's policy in the
    prompt included: a status word there made the first starter leak its answer)."""
    from trace_rl.agents.env_spec import render_module
    from trace_rl.agents.verifier import VerifyConfig, automatic_checks
    import sys

    from trace_rl.agents.builders.spec import starter_spec
    from trace_rl.core import reward
    from trace_rl.evals.benchmark import load_benchmark

    sys.modules.setdefault("reward", reward)
    sys.path.insert(0, str(ROOT / "sandbox" / "image"))
    import spec_env

    target = load_benchmark(f"tau2:{domain}").spec()
    tools = target["tools"]
    spec = starter_spec(tools, "x")
    assert set(spec["tools"]) <= {t["function"]["name"] for t in tools}
    assert spec_env.check_spec(spec, tools) == []
    findings, _ = automatic_checks(render_module(spec, tools, target["policy"]), tools,
                                   VerifyConfig(seeds=12, determinism_seeds=2))
    assert all(f.passed for f in findings), [f for f in findings if not f.passed]
