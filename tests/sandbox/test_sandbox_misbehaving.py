"""Environment modules that misbehave the way model-written code does (tests/support/envs/misbehaving/,
each appended to the sound tests/support/envs/sound.py): every one is a finding in the verifier and an
`env_error` episode on the rollout path, never an exception, a stuck run or a wrong kind."""
import json

import pytest

from trace_rl.sandbox.session import SessionLimits
from paths import SUPPORT

pytestmark = [pytest.mark.docker]
ENVS = SUPPORT / "envs"
SOUND = (ENVS / "sound.py").read_text()
LIMITS = SessionLimits(call_timeout_s=2.0)
TOOLS = json.loads(SOUND.split("TOOLS = ", 1)[1].split("\n\n", 1)[0])

# module -> (seed it misbehaves on, what the verifier's finding says, the episode's error kind, the policy's reply)
CASES = {
    "hang_on_seed": (3, "seed 3", "timeout", "aaaa"),
    "exit_on_seed": (2, "seed 2", "crashed", "aaaa"),
    "tools_as_strings": (0, "tools must be a non-empty list", "contract", "aaaa"),
    "step_returns_none": (0, "[contract] step", "contract", "aaaa"),
    "reward_returns_list": (0, "[contract] reward: must return a dict", "contract", "aaaa"),
    "system_prompt_int": (0, "system_prompt must be a string", "contract", "aaaa"),
    "nan_reward": (0, "NaN is not JSON", "protocol", "aaaa"),
    "reward_too_big": (0, "reward must be a finite number in [0, 1], got 5.0", "contract", "aaaa"),
    "trivial_negative": (0, "got -1000000000.0", "contract", "bbbb"),
    "deep_reply": (0, "RecursionError", "env_error", "aaaa"),
    "flood_protocol": (0, "[protocol]", "protocol", "aaaa"),
    "huge_reply": (0, "[output_limit]", "output_limit", "aaaa"),
    "extra_reply": (0, "reply id 999 answers no request", "protocol", "aaaa"),
    "ok_is_a_string": (0, "'ok' is true or false", "protocol", "aaaa"),
}


def module(name: str) -> str:
    return SOUND + "\n\n" + (ENVS / "misbehaving" / f"{name}.py").read_text()


def test_every_case_has_a_module_and_the_sound_env_passes(sandbox_image):
    from trace_rl.agents.verifier import VerifyConfig, automatic_checks

    assert {p.stem for p in (ENVS / "misbehaving").glob("*.py")} == set(CASES)
    findings, _ = automatic_checks(SOUND, TOOLS, VerifyConfig(seeds=6, determinism_seeds=1), LIMITS)
    assert all(f.passed for f in findings), [f for f in findings if not f.passed]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_misbehaving_module_is_a_finding(sandbox_image, name):
    from trace_rl.agents.verifier import VerifyConfig, automatic_checks

    _, says, _, _ = CASES[name]
    findings, _ = automatic_checks(module(name), TOOLS, VerifyConfig(seeds=6, determinism_seeds=1), LIMITS)
    failed = [f for f in findings if not f.passed]
    assert failed and any(says in f.detail for f in failed), findings


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_misbehaving_module_is_an_env_error_episode(sandbox_image, name):
    from doubles import ScriptedLLM
    from trace_rl.agents.base_agent import run_episode
    from trace_rl.evals.synthetic import SyntheticBenchmark

    seed, _, kind, reply = CASES[name]
    with SyntheticBenchmark(module(name), seeds=range(seed, seed + 2), pool_size=1, limits=LIMITS) as bench:
        t = run_episode(ScriptedLLM(lambda m, t: reply), bench.episode(str(seed)), task_id=str(seed), benchmark="x")
        assert t.termination == "env_error" and t.reward == 0.0 and not t.passed, t.reasons
        assert t.reasons["error_kind"] == kind, t.reasons
        if seed:  # misbehaves on one seed only: the pool hands out a working session for the next
            again = run_episode(ScriptedLLM(lambda m, t: "aaaa"), bench.episode(str(seed + 1)), task_id="next",
                                benchmark="x")
            assert again.termination == "agent_stop" and again.passed, again.reasons


def test_a_deeply_nested_or_nan_line_is_a_protocol_error_on_the_host():
    from trace_rl.sandbox.session import parse_reply

    for line in (b"[" * 100_000, b'{"ok": true, "result": NaN}', b'{"ok": true, "result": Infinity}',
                 b'{"ok": "true"}', b"[]", b'{"ok": true, "result": ' + b"[" * 70 + b"]" * 70 + b"}"):
        with pytest.raises(ValueError):
            parse_reply(line)
    assert parse_reply(b'{"id": 1, "ok": true, "result": [[1]]}')["result"] == [[1]]
