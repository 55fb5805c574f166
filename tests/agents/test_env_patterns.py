"""Pattern mode: a builder's pattern choice, bound to real τ²-bench tools, expands into a spec that
EnvSpec validates and the sandbox runtime's own checks pass (run in-process); the reference wins on
every seed, doing nothing never does, and the step each pattern trains decides the reward.
Malformed or hostile choices are ValueErrors that name the field, never crashes."""
import json
from functools import cache

import pytest
from pydantic import ValidationError

from doubles import ScriptedLLM
from spec_runtime import call, load_runtime, play
from trace_rl.agents import env_patterns
from trace_rl.agents.env_patterns import PatternError, choice_model, expand, parse_choice
from trace_rl.core.records import Capability

spec_env, _ = load_runtime()  # the runtime as the sandbox sees it


def choice_schema(tools: list[dict]) -> dict:
    """The JSON schema of an answer on this target, as `choice_model` validates it."""
    return choice_model(tools).model_json_schema()


@cache
def tau2_tools(domain: str) -> tuple:
    from trace_rl.evals.benchmark import load_benchmark

    return tuple(load_benchmark(f"tau2:{domain}").spec()["tools"])


def tools_of(domain: str) -> list[dict]:
    return list(tau2_tools(domain))


GUARDED = {"pattern": "guarded_action", "read_tool": "get_customer_by_id", "write_tool": "suspend_line",
           "condition_field": "status", "allowed_values": ["Active"], "blocked_values": ["Pending", "Closed"],
           "request": "suspend my line"}
CHOICES = [  # (domain, choice): one or more per pattern, on three τ² domains
    ("telecom", {"pattern": "lookup_then_act", "read_tool": "get_customer_by_phone", "write_tool": "suspend_line",
                 "revealed_argument": "customer_id", "request": "suspend my line"}),
    ("retail", {"pattern": "lookup_then_act", "read_tool": "find_user_id_by_email", "write_tool": "modify_user_address",
                "revealed_argument": "user_id", "request": "change my address"}),
    ("telecom", GUARDED),
    ("airline", {"pattern": "guarded_action", "read_tool": "get_reservation_details",
                 "write_tool": "cancel_reservation", "condition_field": "cabin", "allowed_values": ["business"],
                 "blocked_values": ["economy", "basic_economy"], "request": "cancel my trip"}),
    ("retail", {"pattern": "exact_arguments", "write_tool": "cancel_pending_order", "request": "cancel my order"}),
    ("telecom", {"pattern": "exact_arguments", "write_tool": "grant_app_permission", "request": "let my app in"}),
    ("telecom", {"pattern": "multi_write", "write_tools": ["enable_roaming", "refuel_data"],
                 "request": "get me ready to travel"}),
    ("airline", {"pattern": "compute_then_act", "write_tool": "send_certificate", "amount_argument": "amount",
                 "unit": "night", "request": "compensate me"}),
]


@pytest.mark.parametrize("level", env_patterns.LEVELS)
@pytest.mark.parametrize("domain, choice", CHOICES, ids=[f"{d}-{c['pattern']}" for d, c in CHOICES])
def test_an_expanded_choice_passes_the_runtimes_checks_and_only_the_reference_wins(domain, choice, level):
    from trace_rl.agents.builders.spec import copies_starter
    from trace_rl.agents.env_spec import EnvSpec

    tools = tools_of(domain)
    spec = expand(choice, tools, level)
    assert EnvSpec.model_validate(spec).to_spec() == spec
    assert spec_env.check_spec(spec, tools, range(8)) == []  # reference wins, trivial replies lose, tasks vary
    assert not copies_starter(spec, tools)
    assert set(spec["tools"]) <= {t["function"]["name"] for t in tools}
    env = spec_env.SpecEnv(spec, tools)
    for seed in range(6):
        assert play(env, seed, lambda e: e.solve())["success"], seed
        assert play(env, seed, [{"content": "Hello! How can I help you?"}])["reward"] == 0.0


def reference_calls(env, seed):
    env.reset(seed)
    return [a["tool_calls"][0] for a in env.solve() if a.get("tool_calls")]


def test_lookup_then_act_needs_the_lookup_before_the_write():
    tools = tools_of("telecom")
    env = spec_env.SpecEnv(expand(CHOICES[0][1], tools), tools)
    write = reference_calls(env, 3)[-1]
    blind = play(env, 3, [call(write["name"], **write["arguments"]), {"content": "Done."}])  # the id guessed right
    assert blind["components"] == {"looked_up_first": 0.0, "acted_with_the_record": 1.0} and not blind["success"]
    assert write["arguments"]["customer_id"] not in env.reset(3)["messages"][0]["content"]  # only the lookup tells


def test_guarded_action_rewards_refusing_where_the_record_blocks_it():
    tools = tools_of("telecom")
    env = spec_env.SpecEnv(expand(GUARDED, tools), tools)
    outcomes = {}
    for seed in range(12):
        calls = reference_calls(env, seed)
        outcomes.setdefault(env.task["record"]["status"] == "Active", seed)
        acting = [call(c["name"], **c["arguments"]) for c in calls]
        if len(calls) == 1:  # blocked: the reference only looks; acting anyway is the careless agent
            lookup = calls[0]["arguments"]["customer_id"]
            write = call("suspend_line", customer_id=lookup, line_id=env.task["stated_line_id"],
                         reason=env.task["stated_reason"])
            assert not play(env, seed, [*acting, write, {"content": "Done."}])["success"]
    assert set(outcomes) == {True, False}  # both sides of the rule occur over the seeds


def test_exact_arguments_fails_on_one_wrong_value_and_on_a_first_wrong_try():
    tools = tools_of("retail")
    env = spec_env.SpecEnv(expand(CHOICES[4][1], tools), tools)
    (right,) = reference_calls(env, 1)
    wrong = {**right["arguments"], "reason": "other"}
    assert not play(env, 1, [call(right["name"], **wrong), {"content": "Done."}])["success"]
    retried = play(env, 1, [call(right["name"], **wrong), call(right["name"], **right["arguments"]), {"content": "x"}])
    assert retried["components"] == {"every_value": 1.0, "first_try": 0.0}
    assert retried["reward"] == pytest.approx(0.3)  # right after a wrong write: partial credit, well under half


def test_multi_write_needs_every_write_and_compute_then_act_the_product():
    tools = tools_of("telecom")
    env = spec_env.SpecEnv(expand(CHOICES[6][1], tools), tools)
    first, _ = reference_calls(env, 2)
    half = play(env, 2, [call(first["name"], **first["arguments"]), {"content": "Done."}])
    assert half["reward"] == pytest.approx(0.5) and not half["success"]

    tools = tools_of("airline")
    env = spec_env.SpecEnv(expand(CHOICES[7][1], tools), tools)
    (right,) = reference_calls(env, 4)
    amount = env.task["amount"]
    assert right["arguments"]["amount"] == amount["count"] * amount["each"]
    summed = {**right["arguments"], "amount": amount["count"] + amount["each"]}
    assert not play(env, 4, [call("send_certificate", **summed), {"content": "Done."}])["success"]


# ---------------------------------------------------------------- difficulty levels
ONE_EACH = CHOICES[::2] + CHOICES[7:]  # one choice per pattern


def first_message(env, seed):
    return env.reset(seed)["messages"][0]["content"]


def test_every_pattern_has_words_for_each_harder_level_and_level_1_is_the_default():
    assert env_patterns.LEVELS == (1, 2, 3) and set(env_patterns.HARDER) == set(env_patterns.PATTERNS)
    assert all(set(levels) == {2, 3} for levels in env_patterns.HARDER.values())
    for domain, choice in ONE_EACH:
        tools = tools_of(domain)
        assert expand(choice, tools) == expand(choice, tools, 1) != expand(choice, tools, 2) != expand(choice, tools, 3)


def test_lookup_then_act_harder_the_user_names_another_records_value_and_then_its_near_identical_key():
    tools = tools_of("telecom")
    for level in (2, 3):
        env = spec_env.SpecEnv(expand(CHOICES[0][1], tools, level), tools)
        env.reset(0)
        assert 6 <= len(env.state["customer"]) <= 16  # more records than level 1's 3 to 6
        for seed in range(8):
            lookup, write = reference_calls(env, seed)
            stale = env.task["other"]["customer_id"]  # a real record's, never this one's
            assert stale != write["arguments"]["customer_id"] and f"I think my customer id is {stale}" in \
                first_message(env, seed)
            trusting = {**write["arguments"], "customer_id": stale}  # the lookup done, its answer ignored
            assert not play(env, seed, [call(lookup["name"], **lookup["arguments"]), call(write["name"], **trusting),
                                        {"content": "Done."}])["success"]
    env = spec_env.SpecEnv(expand(CHOICES[0][1], tools, 3), tools)
    for seed in range(8):
        (lookup, _), decoy = reference_calls(env, seed), env.task["other"]["phone_number"]
        assert f"is not {decoy}, it is {lookup['arguments']['phone_number']}" in first_message(env, seed)
        assert decoy[:6] == lookup["arguments"]["phone_number"][:6] == "555-10"  # near-identical keys
        env.reset(seed)
        looked = env.step(call("get_customer_by_phone", phone_number=decoy))["messages"][0]["content"]
        assert json.loads(looked)["customer_id"] == env.task["other"]["customer_id"]  # the decoy is a real record


def test_guarded_action_harder_blocks_values_that_read_almost_like_the_allowed_one():
    tools = tools_of("telecom")
    statuses = {}
    for level in (2, 3):
        spec = expand(GUARDED, tools, level)
        statuses[level] = set(spec["entities"]["customer"]["fields"]["status"]["values"])
        env = spec_env.SpecEnv(spec, tools)
        drawn = set()
        for seed in range(40):
            env.reset(seed)
            drawn.add(env.task["record"]["status"])
        near = drawn - {"Active", "Pending", "Closed"}
        assert near and all("Active" in s for s in near)  # seen, and near-misses of the allowed value
        for seed in range(40):
            calls = reference_calls(env, seed)
            if env.task["record"]["status"] in near:
                assert len(calls) == 1  # the reference only looks, and refuses
                acting = [call(c["name"], **c["arguments"]) for c in calls]
                write = call("suspend_line", customer_id=calls[0]["arguments"]["customer_id"],
                             line_id=env.task["stated_line_id"], reason=env.task["stated_reason"])
                assert not play(env, seed, [*acting, write, {"content": "Done."}])["success"]
            assert ("My status is Active, so it is allowed." in first_message(env, seed)) is (level == 3)
    assert statuses[2] == {"Active", "Pending", "Closed", "Active pending", "formerly Active"}
    assert statuses[3] == statuses[2] | {"pre-Active", "Active (expired)"}
    rule = expand(GUARDED, tools, 3)["system_prompt"]
    assert "status is Active." in rule and "pending" not in rule  # the policy names the allowed value only


def test_exact_arguments_harder_says_values_beside_decoys():
    tools = tools_of("retail")
    env = spec_env.SpecEnv(expand(CHOICES[4][1], tools, 2), tools)
    text = first_message(env, 1)
    (right,) = reference_calls(env, 1)
    wrong = env.task["stated_reason"]["wrong"]
    assert text.count(" is not ") == 1 and f"My reason is not {wrong}, it is {right['arguments']['reason']}." in text
    misled = {**right["arguments"], "reason": wrong}
    assert not play(env, 1, [call(right["name"], **misled), {"content": "x"}])["success"]
    env = spec_env.SpecEnv(expand(CHOICES[4][1], tools, 3), tools)
    text = first_message(env, 1)
    (right,) = reference_calls(env, 1)
    decoy = env.task["other"]["order_id"]
    assert text.count(" is not ") == len(right["arguments"]) and f"is not {decoy}, it is" in text  # the key too
    env.reset(1)  # the decoy key is a real order: the call goes through, on the wrong one
    out = env.step(call(right["name"], **{**right["arguments"], "order_id": decoy}))["messages"][0]["content"]
    assert not out.startswith("Error") and not play(env, 1, [call(right["name"], **{**right["arguments"],
                                                            "order_id": decoy}), {"content": "x"}])["success"]
    props = {"name": {"type": "string"}, "party_date": {"type": "string"}, "guests": {"type": "integer"},
             "seating": {"type": "string", "enum": ["inside", "terrace"]}, "note": {"type": "string"}}
    booking = [{"type": "function", "function": {"name": "book_table", "parameters": {
        "type": "object", "properties": props, "required": ["name"]}}}]
    choice = {"pattern": "exact_arguments", "write_tool": "book_table", "request": "book a table"}
    stated = [reference_calls(spec_env.SpecEnv(expand(choice, booking, level), booking), 1)[0]["arguments"]
              for level in (1, 2, 3)]
    assert [len(a) for a in stated] == [2, 3, 4]  # one more optional argument to state per level
    assert spec_env.check_spec(expand(choice, booking, 3), booking, range(8)) == []


def test_multi_write_harder_asks_for_every_write_on_two_then_three_records():
    tools = tools_of("telecom")
    for level in (2, 3):
        env = spec_env.SpecEnv(expand(CHOICES[6][1], tools, level), tools)
        calls = reference_calls(env, 2)
        ids = [c["arguments"]["customer_id"] for c in calls]
        assert len(calls) == 2 * level and len(set(ids)) == level and all(i in first_message(env, 2) for i in ids)
        first_only = [call(c["name"], **c["arguments"]) for c in calls if c["arguments"]["customer_id"] == ids[0]]
        part = play(env, 2, [*first_only, {"content": "Done."}])
        assert part["reward"] == pytest.approx(1 / level, abs=0.01) and not part["success"]
        assert play(env, 2, lambda e: e.solve())["success"]


def test_compute_then_act_harder_takes_a_discount_then_a_second_item():
    tools = tools_of("airline")
    for level in (2, 3):
        env = spec_env.SpecEnv(expand(COMPUTE, tools, level), tools)
        for seed in range(6):
            (right,) = reference_calls(env, seed)
            a = env.task["amount"]
            total = a["count"] * a["each"] + (a["count2"] * a["each2"] if level == 3 else 0) - a["discount"]
            assert right["arguments"]["amount"] == total > 0 and f"with {a['discount']} off" in first_message(env, seed)
            undiscounted = {**right["arguments"], "amount": total + a["discount"]}
            assert not play(env, seed, [call("send_certificate", **undiscounted), {"content": "Done."}])["success"]
    said = [expand(COMPUTE, tools, level)["user_message"] for level in (2, 3)]
    assert "count2" not in said[0] and "count2" in said[1]


@pytest.mark.parametrize("difficulty", [0, 4, "2", 2.0, True])
def test_a_difficulty_outside_the_levels_is_an_error_naming_it(difficulty):
    with pytest.raises(PatternError, match="difficulty: must be one of 1, 2, 3") as err:
        expand(GUARDED, tools_of("telecom"), difficulty)
    assert err.value.field == "difficulty"


# ---------------------------------------------------------------- malformed and hostile choices
def field_error(choice, tools, field):
    with pytest.raises(ValueError) as err:
        expand(choice, tools)
    assert field in str(err.value), str(err.value)
    return err.value


@pytest.mark.parametrize("change, field, kind", [
    ({"write_tool": "cancel_reservation"}, "write_tool", ValidationError),  # another domain's tool
    ({"write_tool": "set_apn_settings", "pattern": "exact_arguments"}, "apn_settings", PatternError),  # an object arg
    ({"write_tool": "enable_roaming", "read_tool": "get_customer_by_phone"}, "write_tool", PatternError),  # no key arg
    ({"condition_field": None}, "condition_field", ValidationError),  # missing
    ({"pattern": "lookup_and_tell"}, "lookup_and_tell", ValidationError),  # no such pattern
    ({"blocked_values": ["Active"]}, "blocked_values", PatternError),  # allowed on every seed
    ({"allowed_values": ["{task.record.status}"]}, "allowed_values", ValidationError),  # a smuggled slot
])
def test_a_choice_that_does_not_fit_is_an_error_naming_the_field(change, field, kind):
    choice = {k: v for k, v in {**GUARDED, **change}.items() if v is not None}
    if choice["pattern"] == "exact_arguments":
        choice = {k: choice[k] for k in ("pattern", "write_tool", "request")}
    err = field_error(choice, tools_of("telecom"), field)
    assert isinstance(err, kind)


def test_binding_errors_say_what_to_choose_instead():
    tools = tools_of("telecom")
    lookup = {**CHOICES[0][1], "read_tool": "get_customer_by_id"}  # the key the user states, "revealed"
    assert "line_id" in str(field_error(lookup, tools, "revealed_argument"))
    err = field_error({**GUARDED, "read_tool": "get_customer_by_phone"}, tools, "write_tool")
    assert "get_customer_by_id" in str(err)  # a read tool keyed by an argument suspend_line takes
    multi = {"pattern": "multi_write", "write_tools": ["enable_roaming", "transfer_to_human_agents"], "request": "x y"}
    assert "disable_roaming" in str(field_error(multi, tools, "write_tools"))
    twice = {**multi, "write_tools": ["enable_roaming", "enable_roaming"]}
    assert "twice" in str(field_error(twice, tools, "write_tools"))
    amount = {"pattern": "compute_then_act", "write_tool": "suspend_line", "amount_argument": "gb_amount",
              "unit": "GB", "request": "add data"}
    assert "none" in str(field_error(amount, tools, "amount_argument"))


def test_model_words_cannot_become_template_slots():
    tools = tools_of("telecom")
    with pytest.raises(ValueError, match="request"):  # the model (and the grammar) allow plain words only
        expand({**GUARDED, "request": "suspend {task.record.status}"}, tools)
    # a choice that skipped validation still gets no slot in: code strips the braces
    smuggled = parse_choice(GUARDED, tools).model_copy(
        update={"request": "suspend {task.record.status} {{task.stated_reason}}"})
    spec = expand(smuggled, tools)
    assert spec["user_message"].startswith("Suspend task.record.status task.stated_reason.")
    first = spec_env.SpecEnv(spec, tools).reset(0)["messages"][0]["content"]
    assert first.startswith("Suspend task.record.status task.stated_reason.")  # words, never the record's values
    with pytest.raises(PatternError, match="request"):
        expand(smuggled.model_copy(update={"request": "{}{}{}"}), tools)


def test_parse_choice_reads_the_json_in_a_reply_and_rejects_extra_keys():
    tools = tools_of("telecom")
    got = parse_choice("Here it is:\n```json\n" + json.dumps(GUARDED) + "\n```", tools)
    assert got.pattern == "guarded_action" and got.write_tool == "suspend_line"
    with pytest.raises(ValidationError, match="extra"):
        parse_choice({**GUARDED, "reward": []}, tools)


# ---------------------------------------------------------------- the grammar's schema
def enums(schema: dict, key: str) -> set:
    """Every enum value the schema allows under a property named `key` (items of arrays included)."""
    out = set()
    for model in schema["$defs"].values():
        prop = model["properties"].get(key) or {}
        prop = prop.get("items", prop)
        out |= set(prop.get("enum") or ([prop["const"]] if "const" in prop else []))
    return out


@pytest.mark.parametrize("domain", ["airline", "retail", "telecom"])
def test_the_schemas_tool_names_are_the_targets_own(domain):
    tools = tools_of(domain)
    schema = choice_schema(tools)
    names = {t["function"]["name"] for t in tools}
    reads, writes = set(env_patterns.read_tools(tools)), set(env_patterns.write_tools(tools))
    assert enums(schema, "read_tool") == reads and enums(schema, "write_tool") == writes
    assert enums(schema, "write_tools") == writes and reads | writes <= names and reads and writes


def test_the_schema_offers_only_what_the_tools_can_fill():
    def tool(name, **args):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {a: {"type": t} for a, t in args.items()}, "required": list(args)}}}
    tools = [tool("get_order_details", order_id="string"), tool("cancel_order", order_id="string", reason="string"),
             tool("toggle_wifi")]
    schema = choice_schema(tools)
    assert enums(schema, "read_tool") == {"get_order_details"} and enums(schema, "write_tool") == {"cancel_order"}
    assert enums(schema, "pattern") == {"lookup_then_act", "guarded_action", "exact_arguments"}  # one write, no number
    with pytest.raises(PatternError, match="no tool that acts"):
        choice_schema([tool("get_order_details", order_id="string")])


def test_the_choice_schema_compiles_to_a_llama_cpp_grammar():
    llama_grammar = pytest.importorskip("llama_cpp.llama_grammar")
    gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(choice_schema(tools_of("telecom"))))
    assert "guarded_action" in gbnf and "suspend_line" in gbnf and "toggle_wifi" not in gbnf
    llama_grammar.LlamaGrammar.from_string(gbnf, verbose=False)


@pytest.mark.parametrize("domain", ["airline", "telecom"])
def test_every_binding_the_decode_grammar_allows_expands(domain):
    tools = tools_of(domain)
    schema = env_patterns.decode_schema(tools)
    patterns = set()
    for alt in schema["anyOf"]:
        props = alt["properties"]
        patterns.add(props["pattern"]["const"])
        bound = {f: props[f].get("enum") or [props[f]["const"]] for f in env_patterns.BOUND if f in props}
        for field, values in bound.items():
            for value in values:
                choice = {k: v for k, v in env_patterns._SAMPLE.items() if k in props}
                choice |= {"pattern": props["pattern"]["const"], **{f: v[0] for f, v in bound.items()}, field: value}
                expand(choice, tools)  # raises on a binding the grammar should not have offered
    assert patterns == enums(choice_schema(tools), "pattern")  # no pattern lost on the way


def allowed(prop: dict) -> list:
    """The values a bound field of a decode_schema alternative allows (one `const`, or merged: an `enum`)."""
    return prop.get("enum") or [prop["const"]]


def test_the_decode_grammar_refuses_the_binding_the_1_5b_sent_three_rounds_running():
    schema = env_patterns.decode_schema(tools_of("airline"))
    lookups = [a["properties"] for a in schema["anyOf"] if a["properties"]["pattern"]["const"] == "lookup_then_act"
               and "get_reservation_details" in allowed(a["properties"]["read_tool"])
               and "update_reservation_baggages" in allowed(a["properties"]["write_tool"])]
    (props,) = lookups
    assert "reservation_id" not in props["revealed_argument"]["enum"] and "total_baggages" in props["revealed_argument"]["enum"]
    llama_grammar = pytest.importorskip("llama_cpp.llama_grammar")
    llama_grammar.LlamaGrammar.from_string(llama_grammar.json_schema_to_gbnf(json.dumps(schema)), verbose=False)


def test_the_decode_grammar_never_offers_the_lookups_key_as_the_guards_field():
    """The 1.5B guarded suspend_line on customer_id, the record's own key, 9 times in 3 rounds; every
    name the grammar offers instead expands."""
    from trace_rl.agents.env_patterns import CONDITION_FIELDS

    tools = tools_of("telecom")
    guards = [a["properties"] for a in env_patterns.decode_schema(tools)["anyOf"]
              if a["properties"]["pattern"]["const"] == "guarded_action"]
    assert guards and all(set(g["condition_field"]["enum"]) <= set(CONDITION_FIELDS) for g in guards)
    by_id = next(g for g in guards if "get_customer_by_id" in allowed(g["read_tool"]))
    assert "customer_id" not in by_id["condition_field"]["enum"]
    for field in by_id["condition_field"]["enum"]:
        expand({"pattern": "guarded_action", "read_tool": "get_customer_by_id", "write_tool": "suspend_line",
                "condition_field": field, "allowed_values": ["active"], "blocked_values": ["closed"],
                "request": "suspend my line"}, tools)
    with pytest.raises(PatternError, match="condition_field"):
        expand({"pattern": "guarded_action", "read_tool": "get_customer_by_id", "write_tool": "suspend_line",
                "condition_field": "customer_id", "allowed_values": ["a"], "blocked_values": ["b"],
                "request": "suspend my line"}, tools)


# ---------------------------------------------------------------- the builder in pattern mode
class RecordingLLM(ScriptedLLM):
    """A scripted builder that also keeps each request's response_format."""

    def _complete(self, messages, tools, **kw):
        self.formats = [*getattr(self, "formats", []), kw.get("response_format")]
        return super()._complete(messages, tools, **kw)


def test_pattern_mode_writes_the_choice_and_its_expansion_and_says_code_built_it(tmp_path, monkeypatch):
    from trace_rl.agents import env_builder
    from trace_rl.agents.builders import Target
    from trace_rl.agents.env_builder import builder_mode, synthesize_round
    from trace_rl.agents.verifier import VerifierReport
    from trace_rl.core.records import PATTERN_NOTE
    from trace_rl.graph.report import stage_summary

    tools = tools_of("telecom")
    target = Target("tau2:telecom", tools, "Be nice.", "")
    misfit = {**GUARDED, "read_tool": "get_customer_by_phone"}  # no write tool takes phone_number
    builder = RecordingLLM([json.dumps(misfit), json.dumps(GUARDED)])
    monkeypatch.setattr(env_builder, "check_in_sandbox", lambda spec, tools: spec_env.check_spec(spec, tools))
    monkeypatch.setattr(env_builder, "verify", lambda *a, **k: VerifierReport([]))  # the sandbox's verdict: passed
    cap = Capability(name="precondition_verification", description="Checks the account before acting.")
    record = synthesize_round(cap, target, builder, tmp_path, 1, mode=builder_mode("pattern", builder),
                              log=lambda *a: None)
    adir = tmp_path / "attempt_01"
    assert json.loads((adir / "builder_choice.json").read_text()) == GUARDED  # what the model wrote
    assert json.loads((adir / "spec.json").read_text()) == expand(GUARDED, tools)  # what code made of it
    assert "class Env(SpecEnv)" in (adir / "env.py").read_text()
    # decoded under the per-target grammar, with the patterns that fit the capability
    assert builder.formats[0]["schema"] == env_patterns.fitting(cap, env_patterns.decode_schema(tools))
    assert "get_customer_by_id" in builder.requests[1][-1]["content"]  # the misfit's error went back
    assert "guarded_action" in builder.requests[0][0]["content"] and "suspend_line(" in builder.requests[0][1]["content"]
    manifest = json.loads((adir / "manifest.json").read_text())
    assert manifest["origin"] == "pattern:guarded_action" and manifest["note"] == PATTERN_NOTE
    assert manifest["difficulty"] == 1 == json.loads((adir / "difficulty.json").read_text())["difficulty"]
    assert record.status == "verified" and record.source == "pattern:guarded_action"
    (row,) = [r for r in stage_summary({"envs": {cap.name: record}}) if r["stage"] == "synthesise"]
    assert PATTERN_NOTE in row["detail"] and "guarded_action)" in row["detail"]  # level 1: nothing added
    (adir / "difficulty.json").write_text(json.dumps({"pattern": "guarded_action", "difficulty": 2, "why": "x"}))
    (row,) = [r for r in stage_summary({"envs": {cap.name: record}}) if r["stage"] == "synthesise"]
    assert "(guarded_action, difficulty 2)" in row["detail"]
    from trace_rl.core.records import AdapterRecord

    adapter = AdapterRecord(trained_on=Capability(name=cap.name, description=""), steps=4)
    (row,) = [r for r in stage_summary({"envs": {cap.name: record}, "adapters": {cap.name: adapter}})
              if r["stage"] == "train"]
    assert "pattern-built env" in row["detail"]  # the trained row says what it trained on, too
    previous, _ = env_builder.previous_round(tmp_path, 2)
    assert json.loads(previous) == GUARDED  # a next round shows the model its choice, not code's spec


PRECONDITION = Capability(name="precondition_verification", description="Checks the policy's preconditions (the "
                "eligibility rules) before calling a tool that changes the database.")
COMPUTE = {"pattern": "compute_then_act", "write_tool": "send_certificate", "amount_argument": "amount",
           "unit": "night", "request": "compensate me"}


def test_a_request_in_code_is_refused_by_the_model_and_the_grammar():
    bad = {**GUARDED, "request": "calculate(total_baggages * 10)"}
    with pytest.raises(ValidationError, match="request"):
        parse_choice(bad, tools_of("telecom"))
    import re

    for alt in env_patterns.decode_schema(tools_of("telecom"))["anyOf"]:  # the grammar carries the pattern
        pattern = alt["properties"]["request"]["pattern"]
        assert re.match(pattern, "suspend my line") and not re.match(pattern, bad["request"])


def _tool(name, **args):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {a: {"type": t} for a, t in args.items()}, "required": list(args)}}}


def test_a_target_with_one_pattern_gets_a_menu_and_a_grammar_and_one_with_none_a_pattern_error():
    one = [_tool("cancel_order", order_id="string", reason="string")]  # no lookup, no number: exact_arguments only
    assert env_patterns.offered(env_patterns.decode_schema(one)) == ["exact_arguments"]
    assert env_patterns.pattern_menu(one).startswith("- exact_arguments:")
    assert parse_choice({"pattern": "exact_arguments", "write_tool": "cancel_order", "request": "cancel it"},
                        one).write_tool == "cancel_order"
    blob = [_tool("save_note", note={"type": "object"})]  # acts, but code can make no value for its argument
    with pytest.raises(PatternError, match="builder_mode spec or code"):
        env_patterns.decode_schema(blob)


def test_a_misfit_only_points_at_patterns_the_target_offers():
    refunds = Capability(name="refund_totals", description="Works out refund amounts and totals.")
    assert env_patterns.misfit(refunds, "exact_arguments")  # compute_then_act would fit...
    # ...but a target without a number argument cannot offer it: the choice is left to the model
    assert env_patterns.misfit(refunds, "exact_arguments", ["exact_arguments", "lookup_then_act"]) is None


def test_a_pattern_from_another_family_is_a_misfit_that_names_the_fitting_one():
    why = env_patterns.misfit(PRECONDITION, "compute_then_act")
    assert why and "guarded_action" in why and "precondition_verification" in why
    assert env_patterns.misfit(PRECONDITION, "guarded_action") is None
    # a description in none of the families' words leaves the choice to the model
    assert env_patterns.misfit(Capability(name="politeness", description="Greets the user warmly."), "multi_write") is None
    # a phone *number* is no numerical reasoning
    precision = Capability(name="tool_call_precision", description="Passes the customer's phone number exactly.")
    assert env_patterns.misfit(precision, "exact_arguments") is None
    assert "exact_arguments" in env_patterns.misfit(precision, "compute_then_act")


def test_a_misfit_choice_goes_back_to_the_builder_in_the_same_round():
    from trace_rl.agents.builders import Target
    from trace_rl.agents.builders.pattern import write_pattern

    target = Target("tau2:airline", tools_of("airline"), "Be nice.", "")
    guarded = CHOICES[3][1]
    builder = RecordingLLM([json.dumps(COMPUTE), json.dumps(guarded)])
    choice, spec = write_pattern(builder, PRECONDITION, target)
    assert choice == guarded and spec == expand(guarded, target.tools)
    assert "does not train precondition_verification" in builder.requests[1][-1]["content"]


def test_a_later_round_may_not_send_the_failed_binding_again(tmp_path):
    """The demo's 0.5B sent round 1's lookup_then_act choice again word for word in round 2 (at
    temperature 0.7), and calibration failed it again: a binding that failed goes back to the model."""
    from trace_rl.agents.builders import Target
    from trace_rl.agents.builders.pattern import write_pattern

    target = Target("tau2:telecom", tools_of("telecom"), "Be nice.", "")
    failed = CHOICES[0][1]
    reworded = {**failed, "request": "please suspend the line"}
    builder = RecordingLLM([json.dumps(reworded), json.dumps(GUARDED)])
    choice, _ = write_pattern(builder, PRECONDITION, target, feedback="calibration: too hard", previous=json.dumps(failed),
                              failed=[failed])
    assert choice == GUARDED
    assert "same pattern and tools as your previous choice" in builder.requests[1][-1]["content"]
    first = RecordingLLM([json.dumps(failed)])
    assert write_pattern(first, PRECONDITION, target)[0] == failed  # round 1 has nothing to repeat
    # round 2 gave no valid choice: round 3 still may not go back to round 1's
    third = RecordingLLM([json.dumps(failed), json.dumps(GUARDED)])
    assert write_pattern(third, PRECONDITION, target, feedback="no valid choice", previous=None,
                         failed=[failed])[0] == GUARDED
    # the synthesis round collects every earlier round's choice itself
    from trace_rl.agents.env_builder import build_attempt

    (tmp_path / "attempt_01").mkdir()
    (tmp_path / "attempt_01" / "builder_choice.json").write_text(json.dumps(failed))
    again = RecordingLLM([json.dumps(reworded), json.dumps(GUARDED)])
    build_attempt(again, PRECONDITION, target, [], tmp_path, 3, "no valid choice", None, mode="pattern")
    assert json.loads((tmp_path / "attempt_03" / "builder_choice.json").read_text()) == GUARDED


def calibrated_round(folder, choice: dict, level: int, groups: list[list[float]], gate: bool = True):
    """A finished round in `folder`: the choice, its level, and a verifier report whose calibration over
    `groups` (8 seeds x 4) is computed by the verifier's own functions, as verify() records it."""
    from trace_rl.agents.verifier import (Finding, VerifierReport, VerifyConfig, calibration_result,
                                          certain_rejection)
    from trace_rl.core.rundir import Attempt

    cfg = VerifyConfig(calib_seeds=8, calib_samples=4, calibration_gate=gate)
    c = calibration_result(groups, certain_rejection(groups, cfg), cfg)
    report = VerifierReport([Finding("calibration", c["accepted"] or not gate, "figures")], calibration=c)
    folder.mkdir(parents=True)
    (folder / "builder_choice.json").write_text(json.dumps(choice))
    (folder / "difficulty.json").write_text(json.dumps({"difficulty": level}))
    (folder / "verifier_report.json").write_text(json.dumps({**report.to_dict(), "feedback": report.feedback()}))
    return Attempt(folder)


EASY, HARD, FINE = [[1, 1, 1, 1]] * 3, [[0, 0, 0, 0]] * 2, [[1, 0, 0, 0], [0, 1, 1, 0]] * 4


@pytest.mark.parametrize("level, groups, gate, retry", [
    (1, EASY, True, 2), (2, EASY, True, 3), (3, EASY, True, None),  # no level above 3
    (2, HARD, True, 1), (1, HARD, True, None),  # none below 1
    (1, FINE, True, None), (1, EASY, False, None)])  # accepted; advisory calibration does not fail the round
def test_only_a_round_calibration_failed_as_too_easy_or_too_hard_offers_its_choice_again(tmp_path, level, groups,
                                                                                          gate, retry):
    from trace_rl.agents.builders.pattern import retry_after

    got = retry_after([calibrated_round(tmp_path / "attempt_01", CHOICES[4][1], level, groups, gate)])
    assert (got and got.level) == retry
    if got:
        assert got.choice == CHOICES[4][1] and got.verdict == ("too_easy" if groups is EASY else "too_hard")


def test_the_same_choice_after_too_easy_is_expanded_one_level_harder_and_recorded(tmp_path):
    """Round 1 (exact_arguments at level 1) was too easy: round 2's builder is told it may send it again and
    does; code expands it at level 2 and the round records the level. Another choice starts at 1, and a
    level a binding already failed at is not offered (calibration said too hard at 2: 1 was too easy)."""
    from trace_rl.agents.builders import Target
    from trace_rl.agents.builders.pattern import write_pattern
    from trace_rl.agents.env_builder import build_attempt

    target = Target("tau2:retail", tools_of("retail"), "Be nice.", "")
    exact, cap = CHOICES[4][1], Capability(name="argument_precision", description="Passes exact argument values.")
    calibrated_round(tmp_path / "attempt_01", exact, 1, EASY)
    reworded = {**exact, "request": "cancel the order"}  # the same binding in other words
    again = RecordingLLM([json.dumps(reworded)])
    build_attempt(again, cap, target, [], tmp_path, 2, "- calibration: too easy", json.dumps(exact), mode="pattern")
    adir = tmp_path / "attempt_02"
    assert json.loads((adir / "difficulty.json").read_text()) == {
        "pattern": "exact_arguments", "difficulty": 2, "why": "the previous round's env, the same pattern and tools "
                                                             "at difficulty 1, was too easy for the base model"}
    assert json.loads((adir / "spec.json").read_text()) == expand(reworded, target.tools, 2)
    assert "builder_choice.json" in {p.name for p in adir.iterdir()} and "difficulty" not in (
        adir / "builder_choice.json").read_text()  # the model's choice as it wrote it: the level is code's
    prompt = again.requests[0][-1]["content"]
    assert "You may send the same pattern and tools again: code will make the task harder (difficulty 2 of 3: " \
           + env_patterns.HARDER["exact_arguments"][2] in prompt and "Do not send the previous choice" not in prompt
    # another binding after a too-easy round starts at 1
    other = {"pattern": "exact_arguments", "write_tool": "modify_user_address", "request": "move me"}
    calibrated_round(tmp_path / "b" / "attempt_01", exact, 1, EASY)
    build_attempt(RecordingLLM([json.dumps(other)]), cap, target, [], tmp_path / "b", 2, "x", "y", mode="pattern")
    assert json.loads((tmp_path / "b" / "attempt_02" / "difficulty.json").read_text())["difficulty"] == 1
    # round 2 (level 2) too hard: level 1 already failed, so nothing is offered and the repeat is refused
    calibrated_round(tmp_path / "c" / "attempt_01", exact, 1, EASY)
    calibrated_round(tmp_path / "c" / "attempt_02", exact, 2, HARD)
    third = RecordingLLM([json.dumps(exact), json.dumps(other)])
    build_attempt(third, cap, target, [], tmp_path / "c", 3, "- calibration: too hard", json.dumps(exact),
                  mode="pattern")
    assert "You may send the same" not in third.requests[0][-1]["content"]
    assert "same pattern and tools as your previous choice" in third.requests[1][-1]["content"]
    assert json.loads((tmp_path / "c" / "attempt_03" / "builder_choice.json").read_text()) == other
    # write_pattern alone: with no retry, a failed binding is refused at any level it failed at
    with pytest.raises(ValueError, match="same pattern and tools"):
        write_pattern(RecordingLLM([json.dumps(exact)]), cap, target, "x", "y", attempts=1,
                      failed=[{**exact, "difficulty": 1}])


@pytest.mark.docker
def test_too_easy_then_too_hard_moves_the_level_up_then_offers_nothing_back(tmp_path, sandbox_image):
    """The loop for real (sandbox, verifier, calibration): a literal-minded base policy calls the tool with every
    "My X is Y." it reads. It solves exact_arguments at level 1 every time: calibration stops early, too easy.
    Round 2 sends the same choice; code expands it at level 2, where the policy misses the value said beside a
    decoy: too hard. Round 3 is not offered level 1 again (too easy already) and the same choice is refused."""
    import re

    from trace_rl.agents.builders import Target
    from trace_rl.agents.env_builder import build_attempt, synthesize_round
    from trace_rl.agents.verifier import VerifyConfig
    from trace_rl.models.scripted import ToolCall

    def literal(messages, tools):
        if messages[-1]["role"] != "user":
            return "Done."
        said = re.findall(r"My ([a-z ]+?) is ([^\s,]+?)\.(?:\s|$)", messages[-1]["content"])
        return ToolCall(tools[0]["function"]["name"], {k.replace(" ", "_"): v for k, v in said})

    target = Target("tau2:retail", tools_of("retail"), "Be nice.", "")
    exact, cap = CHOICES[4][1], Capability(name="argument_precision", description="Passes exact argument values.")
    cfg = VerifyConfig(seeds=8, determinism_seeds=1, calib_seeds=6, calib_samples=2)
    for rnd, verdict, why in ((1, "too_easy", "all-success"), (2, "too_hard", "all-zero")):
        record = synthesize_round(cap, target, RecordingLLM([json.dumps(exact)]), tmp_path, rnd, cfg=cfg,
                                  base_policy=ScriptedLLM(literal), mode="pattern", max_rounds=3, log=lambda *a: None)
        adir = tmp_path / f"attempt_{rnd:02d}"
        report, manifest = (json.loads((adir / f).read_text()) for f in ("verifier_report.json", "manifest.json"))
        assert record is None and manifest["difficulty"] == rnd and manifest["calibration"]["verdict"] == verdict
        assert [f["check"] for f in report["findings"] if not f["passed"]] == ["calibration"]
        assert f"stopped after 2 of 6 groups: {why} groups are already 2 of 6" in report["feedback"]
    other = {"pattern": "exact_arguments", "write_tool": "modify_user_address", "request": "move me"}
    third = RecordingLLM([json.dumps(exact), json.dumps(other)])
    build_attempt(third, cap, target, [], tmp_path, 3, "- calibration: too hard", json.dumps(exact), mode="pattern")
    assert "You may send the same" not in third.requests[0][-1]["content"]
    assert "same pattern and tools as your previous choice" in third.requests[1][-1]["content"]
    assert json.loads((tmp_path / "attempt_03" / "difficulty.json").read_text())["difficulty"] == 1


def test_the_grammar_offers_only_the_patterns_that_fit_the_capability():
    """Told the misfit, the 1.5B chose compute_then_act for telecom's precondition_verification 9 times
    in 3 rounds: the grammar and the menu now offer only the fitting families; a capability in none of
    the families' words still gets every pattern the tools allow."""
    from trace_rl.agents.builders import Target
    from trace_rl.agents.builders.pattern import write_pattern

    target = Target("tau2:airline", tools_of("airline"), "Be nice.", "")
    builder = RecordingLLM([json.dumps(CHOICES[3][1])])
    write_pattern(builder, PRECONDITION, target)
    offered = {a["properties"]["pattern"]["const"] for a in builder.formats[0]["schema"]["anyOf"]}
    assert offered == {"guarded_action", "lookup_then_act"}  # "preconditions", "eligibility"; "before"
    assert "- guarded_action:" in builder.requests[0][0]["content"]
    assert "- compute_then_act:" not in builder.requests[0][0]["content"]
    everything = env_patterns.decode_schema(target.tools)
    polite = Capability(name="politeness", description="Greets the user warmly.")
    assert env_patterns.fitting(polite, everything) == everything


@pytest.mark.docker
@pytest.mark.parametrize("level", env_patterns.LEVELS)
@pytest.mark.parametrize("domain, choice", ONE_EACH, ids=[f"{d}-{c['pattern']}" for d, c in ONE_EACH])
def test_a_pattern_env_passes_the_verifiers_automatic_checks_in_the_sandbox(domain, choice, level, sandbox_image):
    """What check_spec does not run: random tool calls and echoing the prompt (the target's policy in
    it) must not score either, at every difficulty level."""
    from trace_rl.agents.env_spec import render_module
    from trace_rl.agents.verifier import VerifyConfig, automatic_checks
    from trace_rl.evals.benchmark import load_benchmark

    tools = tools_of(domain)
    module = render_module(expand(choice, tools, level), tools, load_benchmark(f"tau2:{domain}").spec()["policy"])
    findings, _ = automatic_checks(module, tools, VerifyConfig(seeds=12, determinism_seeds=2))
    assert {f.check for f in findings} >= {"trivial_random_tools", "answer_leak", "reference_solver"}
    assert all(f.passed for f in findings), [f for f in findings if not f.passed]


@pytest.mark.parametrize("text, says", [
    ("{}", "field difficulty: Field required"),
    ('{"difficulty": 7}', "field difficulty: Input should be less than or equal to 3"),
    ("[1]", "field (top level)"), ("not json", "difficulty.json")])
def test_a_difficulty_file_of_the_wrong_shape_is_one_line_naming_its_field(tmp_path, text, says):
    from trace_rl.agents.builders.pattern import attempt_level
    from trace_rl.core.rundir import Attempt, RunDirError

    (tmp_path / "difficulty.json").write_text(text)
    with pytest.raises(RunDirError, match="difficulty.json") as err:
        attempt_level(Attempt(tmp_path))
    assert says in str(err.value) and "\n" not in str(err.value)
