"""The verifier on a hand-written reference environment and deliberately broken variants."""
from importlib import resources

import pytest

from trace_rl.agents.verifier import VerifyConfig, automatic_checks, group_stats

pytestmark = [pytest.mark.docker, pytest.mark.ci, pytest.mark.slow]
CFG = VerifyConfig(seeds=20, determinism_seeds=3)


def reference_code() -> str:
    return (resources.files("trace_rl.sandbox") / "envs" / "precondition_verification_airline.py").read_text()


@pytest.fixture(scope="module")
def airline_tools():
    from trace_rl.evals.benchmark import load_benchmark

    b = load_benchmark("tau2:airline")
    return b.episode(b.tasks("test")[0].id, with_user=False).tools


def failed(findings):
    return {f.check for f in findings if not f.passed}


def test_reference_environment_passes(sandbox_image, airline_tools):
    findings, samples = automatic_checks(reference_code(), airline_tools, CFG)
    assert failed(findings) == set(), [f for f in findings if not f.passed]
    assert {"solver", "do_nothing", "refuse", "random_tools", "parrot"} <= set(samples)


BROKEN = {
    "tool_schemas": ('_param("reservation_id", "Reservation Id", "The reservation ID, such as \'ZFA04Y\'.")}},',
                     '_param("reservation", "Reservation", "The reservation.")}},'),
    "trivial_do_nothing": ("    def score(self):\n", "    def score(self):\n        return {'components': {'a': 1.0}, 'weights': {'a': 1.0}}\n"),
    "determinism": ('        self.user_id = f"{first.lower()}_{last.lower()}_{rng.randint(100, 9999)}"',
                    '        import random as _r\n        self.user_id = f"{first.lower()}_{last.lower()}_{_r.randint(100, 9999)}"'),
}


@pytest.mark.parametrize("expected", sorted(BROKEN))
def test_broken_variants_fail_with_the_right_finding(sandbox_image, airline_tools, expected):
    old, new = BROKEN[expected]
    code = reference_code()
    assert old in code
    findings, _ = automatic_checks(code.replace(old, new, 1), airline_tools, CFG)
    assert expected in failed(findings), [f for f in findings if not f.passed]


def test_answer_leaked_in_prompt_is_found(sandbox_image, airline_tools):
    # the prompt tells the decision, and the reward no longer needs the lookup to be done
    code = reference_code().replace(
        'return f"<instructions>\\n{INSTRUCTION}\\n</instructions>\\n<policy>\\n{POLICY}\\n</policy>"',
        'return f"<instructions>\\n{INSTRUCTION}\\n</instructions>\\n<policy>\\n{POLICY}\\n</policy>\\n'
        'Expected answer: " + ("cancel " + self.rid if self.eligible else "cannot cancel")').replace(
        "communication = float(told and bool(looked_up))", "communication = float(told)").replace(
        '"weights": {"action": 0.6, "communication": 0.4}', '"weights": {"action": 0.0, "communication": 1.0}')
    findings, _ = automatic_checks(code, airline_tools, CFG)
    assert "answer_leak" in failed(findings)


def test_contract_violation_and_crash_are_findings(sandbox_image, airline_tools):
    findings, _ = automatic_checks("class Env:\n    pass\n", airline_tools, CFG)
    assert [f.check for f in findings] == ["contract"] and not findings[0].passed
    findings, _ = automatic_checks("import os\nos._exit(1)\n", airline_tools, CFG)
    assert not findings[0].passed and "crashed" in findings[0].detail


def test_group_stats_thresholds():
    cfg = VerifyConfig()
    good = group_stats([[0, 1, 0, 1], [0, 0, 1, 0], [1, 0, 0.5, 0], [0, 1, 0, 0]], cfg)
    assert good["accepted"] and good["constant_groups"] == 0
    bad = group_stats([[1, 1, 1, 1]] * 3 + [[0, 1, 0, 1]], cfg)
    assert not bad["accepted"] and not bad["checks"]["all_success_groups"]


def test_synthetic_episode_runs_the_base_agent_loop(sandbox_image):
    """The sandboxed env behind the Episode protocol: a scripted agent replays the solver."""
    import json as _json

    from doubles import ScriptedLLM
    from trace_rl.agents.base_agent import run_episode
    from trace_rl.agents.llm import Reply, ToolCall
    from trace_rl.evals.synthetic import SyntheticEpisode
    from trace_rl.sandbox.session import EnvSession

    with EnvSession() as s:
        s.load(reference_code())
        s.call("reset", 3)
        actions = s.call("solve")

        def script(messages, tools):
            a = actions[sum(m["role"] == "assistant" for m in messages)]
            if a.get("tool_calls"):
                c = a["tool_calls"][0]
                return ToolCall(c["name"], c["arguments"])
            return Reply(content=a["content"], tool_calls=[])
        ep = SyntheticEpisode(s, 3, hinted=True)
        t = run_episode(ScriptedLLM(script), ep, task_id="3", benchmark="synthetic")
        assert t.passed and t.reward == 1.0 and "Hint:" in ep.system_prompt
        assert ep.plain_system_prompt in ep.system_prompt and "Hint:" not in ep.plain_system_prompt
        bad = SyntheticEpisode(s, 3)
        bad.reset()
        obs = bad.step("", [{"id": "x", "function": {"name": "get_reservation_details", "arguments": "{oops"}}])
        assert obs.messages[0]["content"].startswith("Error") and not obs.done
        _json.dumps(t.to_dict())


@pytest.mark.parametrize("name", sorted(__import__("trace_rl.agents.env_builder", fromlist=["library"]).library()))
def test_every_library_environment_passes_against_its_target(sandbox_image, name):
    """The shipped environments (`<capability>_<domain>.py`) are sound against that domain's real tools."""
    from trace_rl.agents.env_builder import library
    from trace_rl.evals.benchmark import load_benchmark

    tools = load_benchmark(f"tau2:{name.rsplit('_', 1)[1]}").spec()["tools"]
    findings, _ = automatic_checks(library()[name].read_text(), tools, CFG)
    assert failed(findings) == set(), [f for f in findings if not f.passed]


def test_calibration_gates_unless_told_it_is_advisory(monkeypatch):
    """A base model that never scores: the method rejects the env; advisory mode records and passes it."""
    import trace_rl.agents.verifier as v

    monkeypatch.setattr(v, "automatic_checks", lambda code, tools, cfg: ([v.Finding("contract", True, "ok")], {}))
    monkeypatch.setattr(v, "calibrate", lambda code, policy, cfg: {**group_stats([[0.0] * 4] * 4, cfg), "groups": []})
    gated = v.verify("code", [], {"name": "x_y", "description": "d"}, VerifyConfig(), base_policy=object())
    assert not gated.passed and "outside bounds: mean_reward" in gated.failures()[0].detail
    advisory = v.verify("code", [], {"name": "x_y", "description": "d"}, VerifyConfig(calibration_gate=False),
                        base_policy=object())
    assert advisory.passed and "(advisory: not gating)" in advisory.findings[-1].detail
    assert advisory.calibration["mean_reward"] == 0.0
