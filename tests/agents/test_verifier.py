import json
"""The verifier on a hand-written reference environment and deliberately broken variants."""
from importlib import resources

import pytest

from trace_rl.agents.verifier import VerifyConfig, automatic_checks, group_stats
from trace_rl.core.records import Capability
from paths import SUPPORT

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
    from trace_rl.models.chat import Reply, ToolCall
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


@pytest.mark.parametrize("name", sorted(__import__("trace_rl.agents.env_library", fromlist=["library"]).library()))
def test_every_library_environment_passes_against_its_target(sandbox_image, name):
    """The shipped environments (`<capability>_<domain>.py`) are sound against that domain's real tools."""
    from trace_rl.agents.env_library import library
    from trace_rl.evals.benchmark import load_benchmark

    tools = load_benchmark(f"tau2:{name.rsplit('_', 1)[1]}").spec()["tools"]
    findings, _ = automatic_checks(library()[name].read_text(), tools, CFG)
    assert failed(findings) == set(), [f for f in findings if not f.passed]


def test_calibration_gates_unless_told_it_is_advisory(monkeypatch):
    """A base model that never scores: the method rejects the env; advisory mode records and passes it."""
    import trace_rl.agents.verifier as v

    monkeypatch.setattr(v, "automatic_checks", lambda code, tools, cfg: ([v.Finding("contract", True, "ok")], {}))
    monkeypatch.setattr(v, "calibrate", lambda code, policy, cfg: {**group_stats([[0.0] * 4] * 4, cfg), "groups": []})
    gated = v.verify("code", [], Capability(name="x_y", description="d"), VerifyConfig(), base_policy=object())
    assert not gated.passed and "outside bounds: mean_reward" in gated.failures()[0].detail
    advisory = v.verify("code", [], Capability(name="x_y", description="d"), VerifyConfig(calibration_gate=False),
                        base_policy=object())
    assert advisory.passed and "(advisory: not gating)" in advisory.findings[-1].detail
    assert advisory.calibration["mean_reward"] == 0.0


def _passing_checks(monkeypatch):
    import trace_rl.agents.verifier as v

    monkeypatch.setattr(v, "automatic_checks", lambda code, tools, cfg: ([v.Finding("contract", True, "ok")], {}))
    return v


REVIEWED = "def reward(self, state):\n    return 1.0 if 'city' in state.reply else 0.0  # hint: reservation_id\n"


@pytest.mark.parametrize("answer, verdict_passes", [
    ('{"verdict": "pass", "findings": []}', True),
    ('{"verdict": "PASS", "findings": ["reward() gives 1 for any reply mentioning a city"]}', False),
    ('{"verdict": "fail", "findings": ["the hint gives the reservation_id away"]}', False),
])
def test_review_pass_with_findings_is_a_fail(monkeypatch, answer, verdict_passes):
    from doubles import ScriptedLLM

    v = _passing_checks(monkeypatch)
    report = v.verify(REVIEWED, [], Capability(name="x_y", description="d"), VerifyConfig(),
                      reviewer=ScriptedLLM([answer]))
    review = next(f for f in report.findings if f.check == "llm_review")
    assert review.passed is verdict_passes and report.passed is verdict_passes
    if not verdict_passes:
        assert "review:" in report.feedback() and report.review["findings"][0] in report.feedback()


def test_a_review_finding_that_restates_the_rubric_is_discarded_and_counted(monkeypatch):
    """The 1.5B's only finding on a spec that passed every automatic check (docs/examples/spec-build):
    the review prompt's checklist copied out, naming nothing in the code or episodes."""
    from doubles import ScriptedLLM

    from trace_rl import prompts

    v = _passing_checks(monkeypatch)
    parrot = prompts.load("verifier_review").split("Look for:")[1].split("Answer with")[0]
    parrot = " ".join(parrot.replace("\n", " ").replace("- ", "").split())
    answer = json.dumps({"verdict": "fail", "findings": [parrot]})
    report = v.verify(REVIEWED, [], Capability(name="x_y", description="d"), VerifyConfig(),
                      reviewer=ScriptedLLM([answer]))
    review = next(f for f in report.findings if f.check == "llm_review")
    assert review.passed and report.passed
    assert report.review["discarded"] == [parrot] and report.review["findings"] == []
    assert "1 finding(s) discarded" in review.detail and "no evidence" in review.detail
    # one grounded finding next to the parrot: the review fails on that one alone
    answer = json.dumps({"verdict": "fail", "findings": [parrot, "reward() pays any reply naming a city"]})
    report = v.verify(REVIEWED, [], Capability(name="x_y", description="d"), VerifyConfig(),
                      reviewer=ScriptedLLM([answer]))
    assert not report.passed and report.review["findings"] == ["reward() pays any reply naming a city"]


def test_review_without_a_valid_verdict_is_a_fail_not_a_crash(monkeypatch):
    from doubles import ScriptedLLM

    v = _passing_checks(monkeypatch)
    report = v.verify("code", [], Capability(name="x_y", description="d"), VerifyConfig(),
                      reviewer=ScriptedLLM(['{"verdict": "looks fine"}'] * 3))
    assert not report.passed and "no valid verdict" in report.failures()[0].detail


HINT_LEAK = (SUPPORT / "envs" / "sound.py").read_text() + '''

# the hint gives the answer away
class Env(Env):
    max_steps = 2

    def generate(self, rng):
        self.secret = "".join(rng.choice("qwxz") for _ in range(8))
        self.hint = "The word to say is " + self.secret + "."
        return "Say the word."

    def score(self):
        return {"components": {"word": float(self.secret in self.final_reply)}, "weights": {"word": 1.0}}

    def reference_actions(self):
        return [{"content": self.secret}]
'''


def test_an_answer_in_the_hint_is_a_leak(sandbox_image):
    from graph_doubles import TOOL

    findings, _ = automatic_checks(HINT_LEAK, [TOOL], CFG)
    leak = next(f for f in findings if f.check == "answer_leak")
    assert not leak.passed and leak.figures["mean"] == 1.0


def _coin_policy(p_right: float):
    """A tiny stochastic policy for the "say a" env: "aaaa" (reward 1) with probability p_right."""
    import random

    from doubles import ScriptedLLM

    rng = random.Random(0)
    return ScriptedLLM(lambda messages, tools: "aaaa" if rng.random() < p_right else "bbbb", name=f"coin{p_right}")


@pytest.mark.parametrize("p_right, accepted", [(0.4, True), (0.0, False), (1.0, False)])
def test_calibration_runs_for_real_in_the_sandbox(sandbox_image, p_right, accepted):
    """verify() with a real calibrate(): base-model episodes in the sandbox, group statistics,
    the gate, and advice for the builder when the env is out of the band."""
    from graph_doubles import ENV, TOOL
    from trace_rl.agents.verifier import verify

    cfg = VerifyConfig(seeds=6, determinism_seeds=1, calib_seeds=6, calib_samples=8)
    report = verify(ENV, [TOOL], Capability(name="say_letter_a", description="d"), cfg, base_policy=_coin_policy(p_right))
    calib = next(f for f in report.findings if f.check == "calibration")
    assert all(len(g) == 8 for g in report.calibration["groups"])
    assert calib.passed is accepted and report.passed is accepted
    if p_right == 0.0:  # a second all-zero group puts 2 of 6 over the cap 0.2, whatever comes next: stop there
        assert report.calibration["mean_reward"] == 0.0 and "too hard" in report.feedback()
        assert "stopped after 2 of 6 groups: all-zero groups are already 2 of 6, over the cap 0.2" in calib.detail
    if p_right == 1.0:
        assert report.calibration["success_rate"] == 1.0 and "too easy" in report.feedback()
        assert report.calibration["stopped_early"] == {
            "after": 2, "of": 6, "why": "all-success groups are already 2 of 6, over the cap 0.2"}
        assert report.calibration["verdict"] == "too_easy"
    if not accepted:
        assert len(report.calibration["groups"]) == 2
    if accepted:  # never stopped early: all 6 groups played
        assert 0.2 <= report.calibration["mean_reward"] <= 0.6
        assert len(report.calibration["groups"]) == 6 and report.calibration["stopped_early"] is None
