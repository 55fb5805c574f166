"""Issue #40 on the two built-in benchmarks, BFCL multi-turn (per_turn) and ToolSandbox (user=end): the
environment builder works from their tools and the analyst's facts work on their trajectories.

Pattern mode: for every pattern the decode grammar offers on the target, a binding of the target's own
tools (the grammar's first alternative for it, chosen by code, no model) expands into a spec whose env
exposes exactly the target's schemas for the tools it binds, passes the runtime's own checks and, in the
Docker sandbox, the verifier's automatic checks (12 seeds), at each difficulty level (1-3). Every
alternative the grammar offers (BFCL: ~120, each one binding) passes the runtime's checks in-process, at
each level. Spec mode: the starter code writes on the target's tools passes the same checks. That is
(5 (BFCL) + 3 (ToolSandbox)) x 3 levels + 2 sandboxed runs, not every binding: BFCL's grammar allows
~1,600 bindings. Facts: hand-made trajectories with the benchmarks' real
tools, and two ToolSandbox episodes a 0.5B played (tests/support/toolsandbox_trajectories.jsonl)."""
import ast
import json
from functools import cache

import pytest

from paths import SUPPORT
from spec_runtime import load_runtime, play
from trace_rl.agents import env_patterns
from trace_rl.agents.builders import Target
from trace_rl.core.trajectory import Trajectory
from trace_rl.evals.bfcl import recipe
from trace_rl.evals.facts import trajectory_facts
from trace_rl.evals.toolsandbox import installed_python

spec_env, _ = load_runtime()
BENCHES = {
    "bfcl": pytest.param("bfcl:base", {"mode": "per_turn"}, marks=pytest.mark.skipif(
        not recipe().python.exists(), reason="bfcl-eval's venv is absent: trace-rl benchmarks install bfcl")),
    "toolsandbox": pytest.param("toolsandbox:base", {"user": "end"}, marks=pytest.mark.skipif(
        installed_python() is None, reason="ToolSandbox's venv is absent: trace-rl benchmarks install toolsandbox")),
}
TARGETS = list(BENCHES.values())
IDS = list(BENCHES)


@cache
def bench(name: str, options: str):
    from trace_rl.evals.benchmark import load_benchmark

    return load_benchmark(name, options=json.loads(options))


def target_of(name: str, options: dict) -> Target:
    return Target.of(bench(name, json.dumps(options, sort_keys=True)))


@cache
def grammar(name: str, options: str) -> dict:
    return env_patterns.decode_schema(Target.of(bench(name, options)).tools)


def bindings(name: str, options: dict) -> dict[str, dict]:
    """{pattern: a choice} for every pattern the grammar offers: its first alternative's first values."""
    tools = target_of(name, options).tools
    out = {}
    for alt in grammar(name, json.dumps(options, sort_keys=True))["anyOf"]:
        props = alt["properties"]
        pattern = props["pattern"]["const"]
        if pattern in out:
            continue
        choice = {"pattern": pattern, **{k: v for k, v in env_patterns._SAMPLE.items() if k in props}}
        choice |= {f: (props[f].get("enum") or [props[f]["const"]])[0] for f in env_patterns.BOUND if f in props}
        if "write_tools" in props:  # not bound by the grammar: the first pair that expands
            writes = props["write_tools"]["items"]["enum"]
            choice["write_tools"] = next(
                [a, b] for a in writes for b in writes if a != b and _expands({**choice, "write_tools": [a, b]}, tools))
        out[pattern] = choice
    return out


def _expands(choice: dict, tools: list[dict]) -> bool:
    try:
        env_patterns.expand(choice, tools)
        return True
    except ValueError:
        return False


def module_tools(module: str) -> list[dict]:
    """The TOOLS literal of a rendered env module (what the env hands the agent)."""
    tree = ast.parse(module)
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", None) == "TOOLS")


def assert_target_schemas(spec: dict, module: str, tools: list[dict]):
    """The env's tools are exactly the target's schemas (names and parameters) for the tools the spec binds."""
    own = {t["function"]["name"]: t for t in tools}
    exposed = module_tools(module)
    assert [t["function"]["name"] for t in exposed] == [n for n in own if n in spec["tools"]]
    assert set(spec["tools"]) <= set(own)
    for t in exposed:
        assert t == own[t["function"]["name"]]
    served = spec_env.SpecEnv(spec, tools).reset(0)["tools"]  # in the spec's order
    assert {t["function"]["name"]: t for t in served} == {t["function"]["name"]: t for t in exposed}


@pytest.mark.parametrize("level", env_patterns.LEVELS)
@pytest.mark.parametrize("name, options", TARGETS, ids=IDS)
def test_every_grammar_alternative_expands_and_passes_the_runtimes_checks(name, options, level):
    """One binding per alternative the decode grammar offers (merged alternatives: their first tool), at
    each difficulty level."""
    target = target_of(name, options)
    schema = grammar(name, json.dumps(options, sort_keys=True))
    assert len(json.dumps(schema)) < 300_000, "the grammar grew back (BFCL's was 1.15 MB before merging)"
    failures = []
    for alt in schema["anyOf"]:
        props = alt["properties"]
        if "write_tools" in props:
            continue  # the grammar does not bind multi_write's tools: bindings() picks a pair
        choice = {"pattern": props["pattern"]["const"], **{k: v for k, v in env_patterns._SAMPLE.items() if k in props}}
        choice |= {f: (props[f].get("enum") or [props[f]["const"]])[0] for f in env_patterns.BOUND if f in props}
        spec = env_patterns.expand(choice, target.tools, level)
        if problems := spec_env.check_spec(spec, target.tools, range(8)):
            failures.append((choice, problems[0]["detail"][:300]))
    assert not failures, failures[:5]


@pytest.mark.parametrize("name, options", TARGETS, ids=IDS)
def test_the_grammar_offers_patterns_and_the_prompt_fits(name, options):
    from trace_rl.agents.builders.pattern import pattern_messages
    from trace_rl.core.records import Capability

    target = target_of(name, options)
    offered = set(env_patterns.offered(grammar(name, json.dumps(options, sort_keys=True))))
    assert {"exact_arguments", "compute_then_act", "multi_write"} <= offered
    if name.startswith("bfcl"):  # ToolSandbox has no tool that reads one record by a string key
        assert {"lookup_then_act", "guarded_action"} <= offered
    messages = pattern_messages(Capability(name="x", description="y"), target, None, None)
    assert sum(len(m["content"]) for m in messages) < 40_000  # BFCL's 128 tools, one line each


@pytest.mark.docker
@pytest.mark.parametrize("level", env_patterns.LEVELS)
@pytest.mark.parametrize("name, options", TARGETS, ids=IDS)
def test_pattern_envs_bind_the_targets_schemas_and_pass_the_verifiers_automatic_checks(name, options, level,
                                                                                       sandbox_image):
    from trace_rl.agents.env_spec import render_module
    from trace_rl.agents.verifier import VerifyConfig, automatic_checks

    target = target_of(name, options)
    failed = {}
    for pattern, choice in bindings(name, options).items():
        spec = env_patterns.expand(choice, target.tools, level)
        module = render_module(spec, target.tools, target.policy)  # as builders/pattern.py writes env.py
        assert_target_schemas(spec, module, target.tools)
        for seed in range(4):
            assert play(spec_env.SpecEnv(spec, target.tools), seed, lambda e: e.solve())["success"], (pattern, seed)
        findings, _ = automatic_checks(module, target.tools, VerifyConfig(seeds=12, determinism_seeds=2))
        assert {"tool_schemas", "trivial_random_tools", "answer_leak", "reference_solver"} <= {f.check for f in findings}
        schemas = next(f for f in findings if f.check == "tool_schemas")
        assert sorted(schemas.figures["tools"]) == sorted(spec["tools"])
        if bad := [f"{f.check}: {f.detail[:200]}" for f in findings if not f.passed]:
            failed[pattern] = bad
    assert not failed, failed


@pytest.mark.docker
@pytest.mark.parametrize("name, options", TARGETS, ids=IDS)
def test_the_spec_modes_starter_binds_the_targets_tools_and_passes_the_checks(name, options, sandbox_image):
    from trace_rl.agents.builders.spec import spec_messages, starter_spec
    from trace_rl.agents.env_spec import render_module
    from trace_rl.agents.verifier import VerifyConfig, automatic_checks
    from trace_rl.core.records import Capability

    target = target_of(name, options)
    spec = starter_spec(target.tools, "x")
    module = render_module(spec, target.tools, target.policy)
    assert_target_schemas(spec, module, target.tools)
    assert spec_env.check_spec(spec, target.tools) == []
    findings, _ = automatic_checks(module, target.tools, VerifyConfig(seeds=12, determinism_seeds=2))
    assert {"tool_schemas", "trivial_random_tools", "answer_leak", "reference_solver"} <= {f.check for f in findings}
    assert all(f.passed for f in findings), [f for f in findings if not f.passed]
    spec_messages(Capability(name="x", description="y"), target, [], None, None)  # spec mode can prompt


# ---------------------------------------------------------------- the analyst's facts
def call(name: str, **args) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def episode(*messages, bench_name: str) -> Trajectory:
    return Trajectory(task_id="t", benchmark=bench_name, trial=0, model="m", reward=0.0, passed=False,
                      termination="agent_stop", messages=[{"role": "user", "content": "Do it."}, *messages,
                                                          {"role": "assistant", "content": "Done."}])


CASES = {  # benchmark: (a right call, a wrong-typed one, an unknown tool)
    "bfcl": (call("cd", folder="documents"), call("ls", a="yes"), call("open_file", path="notes.txt")),
    "toolsandbox": (call("set_wifi_status", on=False), call("set_wifi_status", on="off"), call("turn_off_wifi")),
}


@pytest.mark.parametrize("name, options", TARGETS, ids=IDS)
def test_facts_flag_exactly_the_wrong_typed_argument_and_the_unknown_tool(name, options):
    tools = bench(name, json.dumps(options, sort_keys=True)).spec()["tools"]
    right, wrong, unknown = CASES[name.split(":")[0]]
    ok = trajectory_facts(episode(right, {"role": "tool", "content": "ok"}, bench_name=name), tools)
    assert ok["invalid_arguments"] == [] and ok["unknown_tools"] == []
    bad = trajectory_facts(episode(right, {"role": "tool", "content": "ok"}, wrong, {"role": "tool", "content": "ok"},
                                   unknown, bench_name=name), tools)
    (typed,) = bad["invalid_arguments"]
    assert typed["step"] == 3 and "should be boolean, got str" in typed["detail"]
    assert bad["unknown_tools"] == [{"step": 5, "detail": unknown["tool_calls"][0]["function"]["name"]}]


@pytest.mark.parametrize("name, options", [BENCHES["toolsandbox"]], ids=["toolsandbox"])
def test_facts_on_stored_toolsandbox_episodes(name, options):
    """Two episodes qwen2.5-coder-0.5b played: add_reminder with `latitude: null` (an optional argument,
    which ToolSandbox's tool took: no invalid argument; the fact used to flag it), and add_reminder
    without its required reminder_timestamp (four times)."""
    tools = bench(name, json.dumps(options, sort_keys=True)).spec()["tools"]
    lines = (SUPPORT / "toolsandbox_trajectories.jsonl").read_text().splitlines()
    null_optional, missing = (Trajectory(**json.loads(line)) for line in lines)
    facts = trajectory_facts(null_optional, tools)
    assert facts["invalid_arguments"] == [] and facts["unknown_tools"] == []
    assert facts["tools_used"] == ["add_reminder", "datetime_info_to_timestamp"]
    facts = trajectory_facts(missing, tools)
    assert [o["detail"] for o in facts["invalid_arguments"]] == ["add_reminder: missing 'reminder_timestamp'"] * 4
    from trace_rl.core.records import Capability
    from trace_rl.evals.facts import transfer_metrics

    schema = Capability(name="schema_adherence", description="Calls tools with arguments that keep to the schema.")
    got = transfer_metrics([null_optional, missing], [schema], tools)["schema_adherence"]
    assert (got["metric"], got["with_fact"], got["episodes"]) == ("invalid_arguments", 1, 2)
