"""Spec mode: the spec runtime (sandbox/image/spec_env.py) and its predicate language, run on the
host on our own test specs; malformed and hostile specs must give findings, never exceptions.
The last test runs a rendered spec module through the real sandbox and the verifier."""
import copy
import json
import random
import types
from types import SimpleNamespace

import pytest
from spec_runtime import call, load_runtime, play

spec_env, airline = load_runtime()
TOOLS = airline.TOOLS  # the real airline schemas, as the hand-written env copies them
RID, UID = "{task.reservation.reservation_id}", "{task.user.user_id}"


def fact(name):
    return {"op": "state_equals", "path": f"task.{name}", "value": True}


def no(p):
    return {"op": "not", "of": p}


LOOKUP = {"tool": "get_reservation_details", "args": {"reservation_id": RID}}
REFUSALS = {"op": "any", "of": [{"op": "reply_contains", "text": w} for w in ("cannot", "can't", "unable", "not eligible")]}
AIRLINE = {
    "name": "precondition_verification",
    "system_prompt": f"<instructions>\n{airline.INSTRUCTION}\n</instructions>\n<policy>\n{airline.POLICY}\n</policy>",
    "hint": airline.Env.hint,
    "max_steps": 10,
    "tools": {
        "get_user_details": {"kind": "read", "entity": "user", "arg": "user_id"},
        "get_reservation_details": {"kind": "read", "entity": "reservation", "arg": "reservation_id"},
        "cancel_reservation": {"kind": "update", "entity": "reservation", "arg": "reservation_id",
                               "set": {"status": "cancelled"},
                               "guard": {"op": "compare", "left": "{record.status}", "cmp": "!=", "right": "cancelled"},
                               "error": "Reservation {args.reservation_id} is already cancelled"},
        "transfer_to_human_agents": {"kind": "const", "result": "Transfer successful"},
    },
    "entities": {
        "user": {"count": [1, 1], "fields": {
            "user_id": {"type": "id", "pattern": "user_{n:04d}"},
            "first_name": {"type": "choice", "values": ["Chen", "Sara", "Raj", "Fatima", "Noah", "Mia"]},
            "membership": {"type": "choice", "values": ["regular", "silver", "gold"]}}},
        "reservation": {"count": [1, 3], "fields": {
            "reservation_id": {"type": "id", "pattern": "RES{n:04d}"},
            "user_id": {"type": "ref", "entity": "user"},
            "origin": {"type": "choice", "values": ["SFO", "JFK", "LAX", "ORD"]},
            "destination": {"type": "choice", "values": ["DFW", "DEN", "SEA", "ATL"]},
            "cabin": {"type": "choice", "values": ["basic_economy", "economy", "business"]},
            "insurance": {"type": "choice", "values": ["yes", "no"]},
            "created_at": {"type": "date", "start": "2024-05-01", "days": 14},
            "first_flight_date": {"type": "date", "start": "2024-05-10", "days": 20},
            "price": {"type": "int", "min": 60, "max": 900},
            "status": {"type": "const", "value": None}}},
    },
    "task": {
        "user": {"type": "pick", "entity": "user"},
        "reservation": {"type": "pick", "entity": "reservation"},
        "reason": {"type": "choice", "values": [
            {"code": "change_of_plan", "text": "my plans changed"},
            {"code": "health", "text": "I'm sick and can't travel"},
            {"code": "weather", "text": "a storm is forecast"},
            {"code": "airline_cancelled", "text": "the airline cancelled my flight"}]},
        "flown": {"type": "fact", "pred": {"op": "compare", "left": "{task.reservation.first_flight_date}",
                                           "cmp": "<", "right": "2024-05-15"}},
        "eligible": {"type": "fact", "pred": {"op": "all", "of": [no(fact("flown")), {"op": "any", "of": [
            {"op": "compare", "left": "{task.reservation.created_at}", "cmp": ">=", "right": "2024-05-14"},
            {"op": "state_equals", "path": "task.reservation.cabin", "value": "business"},
            {"op": "state_equals", "path": "task.reason.code", "value": "airline_cancelled"},
            {"op": "all", "of": [
                {"op": "state_equals", "path": "task.reservation.insurance", "value": "yes"},
                {"op": "compare", "left": "{task.reason.code}", "cmp": "in", "right": ["health", "weather"]}]}]}]}},
    },
    "user_message": f"Hi, my user id is {UID}. I'd like to cancel reservation {RID} because {{task.reason.text}}.",
    "reference": [
        {"call": "get_user_details", "args": {"user_id": UID}},
        {"call": "get_reservation_details", "args": {"reservation_id": RID}},
        {"call": "transfer_to_human_agents", "args": {"summary": f"User wants to cancel {RID}; part already flown."},
         "when": fact("flown")},
        {"reply": "Part of this trip has already been flown, so I cannot cancel it; I have transferred you to a "
                  "human agent.", "when": fact("flown")},
        {"call": "cancel_reservation", "args": {"reservation_id": RID}, "when": fact("eligible")},
        {"reply": f"Reservation {RID} is now cancelled; the refund goes back to your payment method.",
         "when": fact("eligible")},
        {"reply": f"I'm sorry, reservation {RID} is not eligible for cancellation under our policy, so I cannot "
                  "cancel it.", "when": {"op": "all", "of": [no(fact("flown")), no(fact("eligible"))]}},
    ],
    "reward": [
        {"name": "checked_first", "weight": 0.2, "pred": {"op": "all", "of": [
            {"op": "called_before", "first": {"tool": "get_user_details", "args": {"user_id": UID}},
             "then": {"tool": "cancel_reservation"}},
            {"op": "called_before", "first": LOOKUP, "then": {"tool": "cancel_reservation"}}]}},
        {"name": "decision", "weight": 0.5, "pred": {"op": "all", "of": [
            {"op": "called", **LOOKUP},
            {"op": "if", "cond": fact("eligible"),
             "then": {"op": "all", "of": [
                 {"op": "state_equals", "path": "task.reservation.status", "value": "cancelled"},
                 {"op": "called", "tool": "cancel_reservation", "args": {"reservation_id": RID}, "only": True}]},
             "else": {"op": "all", "of": [
                 {"op": "not_called", "tool": "cancel_reservation"},
                 {"op": "if", "cond": fact("flown"), "then": {"op": "called", "tool": "transfer_to_human_agents"}}]}}]}},
        {"name": "communication", "weight": 0.3, "pred": {"op": "all", "of": [
            {"op": "called", **LOOKUP},
            {"op": "if", "cond": fact("eligible"),
             "then": {"op": "all", "of": [{"op": "reply_contains", "text": "cancel"}, no(REFUSALS)]},
             "else": REFUSALS}]}},
    ],
}


def airline_spec():
    return copy.deepcopy(AIRLINE)


def checks(findings):
    return {f["check"] for f in findings}


# ---------------------------------------------------------------- a complete, valid spec
def test_airline_spec_passes_every_check():
    assert spec_env.check_spec(airline_spec(), TOOLS, range(10)) == []


def test_airline_reference_succeeds_on_seeds_0_to_9_and_doing_nothing_fails():
    env = spec_env.SpecEnv(airline_spec(), TOOLS)
    branches = set()
    for seed in range(10):
        assert play(env, seed, lambda e: e.solve())["success"], seed
        branches.add("flown" if env.task["flown"] else "eligible" if env.task["eligible"] else "ineligible")
        nothing = play(env, seed, [{"content": "Hello! How can I help you?"}])
        assert not nothing["success"] and nothing["reward"] == 0.0
    assert branches == {"flown", "eligible", "ineligible"}  # the seeds exercise every rule of the policy


def seed_where(env, flown, eligible):
    return next(s for s in range(100) if env.reset(s) and (env.task["flown"], env.task["eligible"]) == (flown, eligible))


def test_cancelling_without_checking_or_against_the_policy_is_not_rewarded():
    env = spec_env.SpecEnv(airline_spec(), TOOLS)
    seed = seed_where(env, False, True)
    rid, uid = env.task["reservation"]["reservation_id"], env.task["user"]["user_id"]
    blind = play(env, seed, [call("cancel_reservation", reservation_id=rid), {"content": "It is cancelled."}])
    assert blind["components"] == {"checked_first": 0.0, "decision": 0.0, "communication": 0.0}
    late = play(env, seed, [call("cancel_reservation", reservation_id=rid), call("get_user_details", user_id=uid),
                            call("get_reservation_details", reservation_id=rid), {"content": "It is cancelled."}])
    assert late["components"]["checked_first"] == 0.0 and late["components"]["decision"] == 1.0

    seed = seed_where(env, False, False)
    rid, uid = env.task["reservation"]["reservation_id"], env.task["user"]["user_id"]
    checked_then_cancelled = play(env, seed, [call("get_user_details", user_id=uid),
                                              call("get_reservation_details", reservation_id=rid),
                                              call("cancel_reservation", reservation_id=rid),
                                              {"content": "Reservation cancelled."}])
    assert env.task["reservation"]["status"] == "cancelled"  # the API does not check the rules ...
    assert checked_then_cancelled["components"]["decision"] == 0.0  # ... the reward does
    assert not checked_then_cancelled["success"]


def test_tools_answer_like_the_target():
    env = spec_env.SpecEnv(airline_spec(), TOOLS)
    obs = env.reset(3)
    assert [t["function"]["name"] for t in obs["tools"]] == list(AIRLINE["tools"])
    assert obs["tools"] == [t for n in AIRLINE["tools"] for t in TOOLS if t["function"]["name"] == n]
    rid = env.task["reservation"]["reservation_id"]
    out = env.step(call("get_reservation_details", reservation_id="NOPE42"))["messages"][0]["content"]
    assert out == "Error: Reservation NOPE42 not found"
    out = env.step(call("get_reservation_details", reservation_id=rid, verbose=True))["messages"][0]["content"]
    assert out.startswith("Error:") and "unexpected keyword arguments: verbose" in out
    out = env.step(call("get_reservation_details"))["messages"][0]["content"]
    assert "missing required arguments: reservation_id" in out
    assert json.loads(env.step(call("get_reservation_details", reservation_id=rid))["messages"][0]["content"]) \
        == env.task["reservation"]
    assert json.loads(env.step(call("cancel_reservation", reservation_id=rid))["messages"][0]["content"])["status"] \
        == "cancelled"
    again = env.step(call("cancel_reservation", reservation_id=rid))["messages"][0]["content"]
    assert again == f"Error: Reservation {rid} is already cancelled"  # the guard
    assert env.step(call("transfer_to_human_agents", summary="x"))["messages"][0]["content"] == "Transfer successful"
    assert [c[2] is None for c in env.calls] == [True, True, True, False, False, True, False]


def test_instances_are_seeded():
    env = spec_env.SpecEnv(airline_spec(), TOOLS)
    first = lambda s: (env.reset(s)["messages"][0]["content"], json.dumps(env.state, sort_keys=True))  # noqa: E731
    assert first(4) == first(4)
    assert len({first(s) for s in range(10)}) == 10


def test_list_and_write_behaviours():
    spec = {"system_prompt": "Help.", "user_message": "Which reservations does {task.user.user_id} have?",
            "tools": {"get_user_details": {"kind": "list", "entity": "reservation",
                                           "where": {"user_id": "{args.user_id}"}, "project": "reservation_id"},
                      "cancel_reservation": {"kind": "write", "entity": "reservation", "arg": "reservation_id",
                                             "set": {"status": "cancelled by {args.reservation_id}"}}},
            "entities": {"user": {"count": [2, 2], "fields": {"user_id": {"type": "id", "pattern": "u{n:02d}"}}},
                         "reservation": {"count": [5, 5], "fields": {
                             "reservation_id": {"type": "id", "pattern": "R{n}"},
                             "user_id": {"type": "ref", "entity": "user"},
                             "status": {"type": "const", "value": "active"}}}},
            "task": {"user": {"type": "pick", "entity": "user"}},
            "reference": [{"call": "get_user_details", "args": {"user_id": UID}}, {"reply": "Done."}],
            "reward": [{"name": "listed", "weight": 1, "pred": {"op": "called", "tool": "get_user_details"}}]}
    env = spec_env.SpecEnv(spec, TOOLS)
    env.reset(0)
    uid = env.task["user"]["user_id"]
    listed = json.loads(env.step(call("get_user_details", user_id=uid))["messages"][0]["content"])
    assert listed == [r["reservation_id"] for r in env.state["reservation"] if r["user_id"] == uid]
    env.step(call("cancel_reservation", reservation_id=env.state["reservation"][0]["reservation_id"]))
    assert env.state["reservation"][0]["status"] == f"cancelled by {env.state['reservation'][0]['reservation_id']}"


def test_a_pick_other_than_earlier_picks_is_a_different_record_on_every_seed():
    spec = {"system_prompt": "Help.", "user_message": "Mine is {task.a.reservation_id}, not {task.b.reservation_id}.",
            "tools": {"get_reservation_details": {"kind": "read", "entity": "reservation", "arg": "reservation_id"}},
            "entities": {"reservation": {"count": [3, 3], "fields": {
                "reservation_id": {"type": "id", "pattern": "R{n:02d}"}}}},
            "task": {"a": {"type": "pick", "entity": "reservation"},
                     "b": {"type": "pick", "entity": "reservation", "other_than": ["a"]},
                     "c": {"type": "pick", "entity": "reservation", "other_than": ["a", "b"]}},
            "reference": [{"call": "get_reservation_details", "args": {"reservation_id": "{task.a.reservation_id}"}},
                          {"reply": "Done."}],
            "reward": [{"name": "looked", "weight": 1, "pred": {"op": "called", "tool": "get_reservation_details",
                                                               "args": {"reservation_id": "{task.a.reservation_id}"}}}]}
    assert spec_env.check_spec(spec, TOOLS, range(8)) == []
    env = spec_env.SpecEnv(spec, TOOLS)
    for seed in range(20):
        env.reset(seed)
        assert len({env.task[n]["reservation_id"] for n in "abc"}) == 3, seed  # three records, none twice
    firsts = {spec_env.SpecEnv(spec, TOOLS).reset(s)["messages"][0]["content"][8:11] for s in range(20)}
    assert len(firsts) > 1  # and which one is `a` still varies
    # only earlier picks of the same entity can be named; a fourth record does not exist
    for other_than, said in ((["c"], "'c'"), (["b", "z"], "'z'"), ([3], "int 3")):
        bad = copy.deepcopy(spec)
        bad["task"]["c"]["other_than"] = other_than
        (finding,) = spec_env.static_findings(bad, TOOLS)
        assert finding["detail"].startswith("task.c.other_than[") and said in finding["detail"], finding
        assert "earlier pick of 'reservation' (those: a, b)" in finding["detail"]
    four = copy.deepcopy(spec)
    four["task"]["d"] = {"type": "pick", "entity": "reservation", "other_than": ["a", "b", "c"]}
    (finding,) = spec_env.check_spec(four, TOOLS, range(1))
    assert finding["check"] == "runtime" and "other than a, b, c" in finding["detail"]


# ---------------------------------------------------------------- the expression and predicate language
def episode(calls=(), reply=""):
    """What predicates read: calls as (name, arguments, result or None when the call failed)."""
    return SimpleNamespace(calls=list(calls), final_reply=reply)


def holds(p, ep, task=None):
    return spec_env.holds(p, ep, {"task": task or {}})


def test_templates_keep_types_format_text_and_escape_braces():
    ctx = {"task": {"n": 7, "r": {"id": "R1", "tags": ["a", "b"]}}}
    assert spec_env.render("{task.n}", ctx) == 7
    assert spec_env.render("{ task.r.tags }", ctx) == ["a", "b"]
    assert spec_env.render("id {task.r.id}, n={task.n}, {{literal}}", ctx) == "id R1, n=7, {literal}"
    assert spec_env.render({"x": ["{task.r.tags.1}", 3, None]}, ctx) == {"x": ["b", 3, None]}
    with pytest.raises(spec_env.SpecError, match="nothing at 'zz'"):
        spec_env.render("{task.r.zz}", ctx)


def test_double_braced_paths_are_slots_as_small_models_write_them():
    ctx = {"task": {"n": 7, "r": {"id": "R1", "status": "open"}}}
    assert spec_env.render("{{ task.n }}", ctx) == 7
    assert spec_env.render("reservation {{task.r.id}} and {{literal}}", ctx) == "reservation R1 and {literal}"
    assert holds({"op": "state_equals", "path": "{{ task.r.status }}", "value": "open"}, episode(), ctx["task"])
    assert holds({"op": "state_equals", "path": "{task.r.status}", "value": "open"}, episode(), ctx["task"])


def test_called_matches_a_successful_call_with_an_argument_subset():
    ep = episode([("get", {"id": "R1", "verbose": True}, {"ok": 1}), ("get", {"id": "R2"}, None)])
    assert holds({"op": "called", "tool": "get", "args": {"id": "R1"}}, ep)
    assert not holds({"op": "called", "tool": "get", "args": {"id": "R2"}}, ep)  # that call failed
    assert not holds({"op": "called", "tool": "get", "args": {"id": "R1", "verbose": False}}, ep)
    assert not holds({"op": "called", "tool": "get", "args": {"id": "R1"}, "only": True}, ep)  # R2 was tried too
    assert holds({"op": "called", "tool": "get", "args": {"id": "{task.rid}"}}, ep, {"rid": "R1"})


def test_not_called_counts_failed_calls_too():
    ep = episode([("cancel", {"id": "R9"}, None)])
    assert not holds({"op": "not_called", "tool": "cancel"}, ep)
    assert holds({"op": "not_called", "tool": "cancel", "args": {"id": "R1"}}, ep)
    assert holds({"op": "not", "of": {"op": "called", "tool": "cancel"}}, ep)  # not(called): no success


def test_called_before():
    p = {"op": "called_before", "first": {"tool": "look"}, "then": {"tool": "act"}}
    assert holds(p, episode([("look", {}, "x"), ("act", {}, "y")]))
    assert holds(p, episode([("look", {}, "x")]))  # then never happened: fine
    assert not holds(p, episode([("act", {}, "y"), ("look", {}, "x"), ("act", {}, "y")]))
    assert not holds(p, episode([("look", {}, None), ("act", {}, "y")]))  # the look failed
    assert not holds(p, episode([]))


def test_reply_state_compare_and_connectives():
    rec = {"status": "active", "n": 3}
    task = {"rec": rec, "words": ["a"]}
    ep = episode(reply="Your booking is CANCELLED.")
    assert holds({"op": "reply_contains", "text": "cancelled"}, ep)
    assert not holds({"op": "reply_contains", "text": ""}, ep)  # an empty needle proves nothing
    assert holds({"op": "state_equals", "path": "task.rec.status", "value": "active"}, ep, task)
    rec["status"] = "cancelled"  # a pick is the live record: predicates see what tools changed
    assert holds({"op": "state_equals", "path": "task.rec.status", "value": "cancelled"}, ep, task)
    assert holds({"op": "compare", "left": "{task.rec.n}", "cmp": ">=", "right": 3}, ep, task)
    assert holds({"op": "compare", "left": "a", "cmp": "in", "right": "{task.words}"}, ep, task)
    assert not holds({"op": "compare", "left": "{task.rec.n}", "cmp": "<", "right": "x"}, ep, task)  # int < str
    true, false = {"op": "reply_contains", "text": "booking"}, {"op": "reply_contains", "text": "refund"}
    assert holds({"op": "all", "of": [true, {"op": "not", "of": false}]}, ep)
    assert holds({"op": "any", "of": [false, true]}, ep) and not holds({"op": "any", "of": []}, ep)
    assert holds({"op": "if", "cond": false, "then": false}, ep)  # no else: true
    assert not holds({"op": "if", "cond": false, "then": true, "else": false}, ep)
    assert not holds({"op": "if", "cond": true, "then": false}, ep)


# ---------------------------------------------------------------- malformed specs -> findings
def mutate(path, value=None, delete=False):
    """The airline spec with the value at a path ("reward.1.pred.tool") replaced or deleted."""
    spec = airline_spec()
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = int(last) if isinstance(node, list) else last
    if delete:
        del node[last]
    else:
        node[last] = value
    return spec


MALFORMED = {
    "exposing a tool the target lacks": (
        lambda: mutate("tools.cancel_order", {"kind": "const", "result": "ok"}),
        "unknown_tool", "tools.cancel_order: 'cancel_order' is not one of the target's tools"),
    "a predicate on a tool not exposed": (
        lambda: mutate("reward.1.pred.of.1.else.of.0.tool", "book_reservation"),
        "unknown_tool", "reward[1].pred.of[1].else.of[0].tool: 'book_reservation' is not an exposed tool"),
    "a reference call of a tool not exposed": (
        lambda: mutate("reference.0.call", "update_reservation_flights"), "unknown_tool", "reference[0].call"),
    "an unknown field in a path": (
        lambda: mutate("reward.1.pred.of.1.then.of.0.path", "task.reservation.state"),
        "unknown_field", "'reservation' has no field 'state'"),
    "an unknown field in a template": (
        lambda: mutate("user_message", "Cancel {task.reservation.booking_code} please"),
        "unknown_field", "user_message: 'reservation' has no field 'booking_code'"),
    "an unknown task name": (
        lambda: mutate("reference.1.args.reservation_id", "{task.booking.reservation_id}"),
        "unknown_field", "reference[1].args.reservation_id: '{task.booking.reservation_id}': the task has no 'booking'"),
    "an unknown entity": (
        lambda: mutate("task.reservation.entity", "booking"), "unknown_entity", "task.reservation.entity"),
    "a ref to an entity defined later": (
        lambda: mutate("entities.user.fields.favourite", {"type": "ref", "entity": "reservation"}),
        "unknown_entity", "entities.user.fields.favourite.entity"),
    "an argument the tool does not take": (
        lambda: mutate("reward.0.pred.of.1.first.args", {"reservation": RID}),
        "unknown_argument", "'get_reservation_details' takes no argument 'reservation'"),
    "a behaviour keyed on an argument the tool does not take": (
        lambda: mutate("tools.get_user_details.arg", "id"), "unknown_argument", "tools.get_user_details.arg"),
    "a reference call missing a required argument": (
        lambda: mutate("reference.0.args", {}),
        "missing_argument", "reference[0].args: lacks 'user_id', required by 'get_user_details'"),
    "an unsatisfiable reference": (  # the reward wants a refund mentioned, the refusal replies never do
        lambda: mutate("reward.2.pred.of.1", {"op": "reply_contains", "text": "refund"}),
        "reference_fails", "components ['communication'] do not hold"),
    "a reference that never applies": (
        lambda: mutate("reference", [{"reply": "never", "when": {"op": "all", "of": [fact("flown"), no(fact("flown"))]}}]),
        "reference_fails", "no step applies"),
    "a reward doing nothing earns": (
        lambda: mutate("reward", [{"name": "polite", "weight": 1,
                                   "pred": {"op": "not_called", "tool": "cancel_reservation"}},
                                  {"name": "said", "weight": 1, "pred": {"op": "any", "of": [
                                      {"op": "reply_contains", "text": "help"}, {"op": "reply_contains", "text": "."}]}}]),
        "do_nothing", "scores 1.00 on average"),
    "a task that never changes": (
        lambda: mutate("user_message", "Please cancel my reservation."), "variety", "distinct tasks"),
    "a weight that is a string": (lambda: mutate("reward.0.weight", "0.2"), "schema", "reward[0].weight: must be a number"),
    "a missing key": (lambda: mutate("user_message", delete=True), "schema", "user_message: missing"),
    "an unknown key": (lambda: mutate("reward.0.why", "x"), "schema", "reward[0].why: unknown key"),
    "an unknown op": (lambda: mutate("reward.0.pred.op", "eval"), "schema", "reward[0].pred.op: must be one of"),
    "an unknown behaviour": (lambda: mutate("tools.get_user_details.kind", "python"), "schema", "kind: must be one of"),
    "a count upside down": (lambda: mutate("entities.reservation.count", [3, 1]), "schema", "entities.reservation.count"),
    "an id pattern with a format attack": (
        lambda: mutate("entities.user.fields.user_id.pattern", "{n:999999999d}"), "schema", "pattern: must hold"),
    "a bad date": (lambda: mutate("entities.reservation.fields.created_at.start", "May 1st"), "schema", "created_at"),
    "a bad comparison": (lambda: mutate("task.flown.pred.cmp", "=~"), "schema", "task.flown.pred.cmp"),
    "a non-finite weight": (lambda: mutate("reward.0.weight", float("nan")), "limits", "non-finite"),
    "a list where a spec belongs": (lambda: [AIRLINE], "schema", "spec: must be an object"),
    "nothing at all": (lambda: None, "schema", "spec: must be an object"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_spec_gives_a_finding_naming_the_field(case):
    make, check, detail = MALFORMED[case]
    findings = spec_env.check_spec(make(), TOOLS, range(10))
    assert all(set(f) == {"check", "passed", "detail"} and f["passed"] is False for f in findings)
    assert any(f["check"] == check and detail in f["detail"] for f in findings), findings


def test_a_spec_that_fails_the_static_checks_does_not_load():
    with pytest.raises(spec_env.SpecError, match="is not one of the target's tools"):
        spec_env.SpecEnv(mutate("tools.cancel_order", {"kind": "const", "result": "ok"}), TOOLS)


def test_hostile_nesting_and_size_are_findings_not_recursion_errors():
    deep = {"op": "reply_contains", "text": "x"}
    for _ in range(100_000):
        deep = {"op": "not", "of": deep}
    findings = spec_env.check_spec(mutate("reward.0.pred", deep), TOOLS)
    assert checks(findings) == {"limits"} and "nested deeper than" in findings[0]["detail"]
    deep_expr = "x"
    for _ in range(100_000):
        deep_expr = [deep_expr]
    assert checks(spec_env.check_spec(mutate("reference.0.args.user_id", deep_expr), TOOLS)) == {"limits"}
    wide = mutate("entities.user.fields.first_name.values", ["n" * 4000] * 50)
    assert checks(spec_env.check_spec(wide, TOOLS)) == {"limits"}
    assert checks(spec_env.check_spec(mutate("entities.reservation.count", [1, 10 ** 12]), TOOLS)) == {"schema"}


def _random_value(rng):
    return rng.choice([None, True, 0, -1, 10 ** 15, 2.5, "", "x", "{task.reservation}", "{task.nope.x}", "{",
                       "}}{{", [], [1, "a"], {}, {"op": "all"}, {"type": "id"}, {"kind": "read"}])


def test_random_mutations_never_crash_the_checker():
    """Hostile model output: any value anywhere gives findings (or a sound spec), never an exception."""
    rng = random.Random(0)
    paths = []
    stack = [("", AIRLINE)]
    while stack:
        prefix, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
        for k, v in items:
            paths.append(f"{prefix}{k}")
            stack.append((f"{prefix}{k}.", v))
    sound = 0
    for i in range(400):
        path = rng.choice(paths)
        spec = mutate(path, delete=True) if i % 3 == 0 and not path.split(".")[-1].isdigit() else \
            mutate(path, _random_value(rng))
        findings = spec_env.check_spec(spec, TOOLS, range(3))
        assert isinstance(findings, list) and "internal" not in checks(findings), (path, findings)
        if not findings:
            sound += 1
            env = spec_env.SpecEnv(spec, TOOLS)  # a spec that passes runs
            assert play(env, 0, lambda e: e.solve())["success"]
    assert sound < 400  # the mutations did break specs


# ---------------------------------------------------------------- the host side: schema and module
def shape(model, tag: str | None = None) -> tuple[dict, dict]:
    """(required, optional) keys of a pydantic model, each with the runtime's type tag (spec_env's tables)."""
    import typing

    from pydantic import BaseModel

    def type_tag(ann):
        if typing.get_origin(ann) is typing.Annotated:
            return type_tag(typing.get_args(ann)[0])
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        origin = typing.get_origin(ann)
        if origin in (typing.Union, types.UnionType) and len(args) == 1:
            return type_tag(args[0])  # X | None: optional, of type X
        if origin in (typing.Union, types.UnionType) or isinstance(ann, type) and issubclass(ann, BaseModel):
            return dict  # a predicate, or any other nested object
        if origin is typing.Literal:
            return type(args[0])
        return {list: list, dict: dict}.get(origin, spec_env.ANY if ann is typing.Any else ann)
    required, optional = {}, {}
    for name, f in model.model_fields.items():
        if name != tag:
            (required if f.is_required() else optional)[f.alias or name] = type_tag(f.annotation)
    return required, optional


def variants(union) -> dict:
    """{discriminator value: model} of a discriminated union of pydantic models."""
    import typing

    models = typing.get_args(typing.get_args(union)[0]) if typing.get_origin(union) is typing.Annotated else \
        typing.get_args(union)
    return {value: m for m in models for key in ("op", "kind", "type") if key in m.model_fields
            for value in typing.get_args(m.model_fields[key].annotation)}


def test_envspec_and_the_runtime_define_the_same_format():
    """The spec format is defined once, in pydantic (agents/env_spec.py: the builder's grammar); the sandbox
    image's stdlib runtime keeps its own tables of it (it cannot import pydantic). Every key, whether it is
    required and its type must be the same in both: any drift fails here."""
    from trace_rl.agents import env_spec as s

    assert {k: shape(m, "op") for k, m in variants(s.Predicate).items()} == spec_env.PREDICATES
    assert {k: shape(m, "kind") for k, m in variants(s.Tool).items()} == spec_env.TOOL_KEYS
    assert {k: shape(m, "type") for k, m in variants(s.TaskVar).items()} == spec_env.FIELD_KEYS
    assert set(variants(s.FieldSpec)) == set(spec_env.FIELD_TYPES) and set(spec_env.TASK_TYPES) == set(spec_env.FIELD_KEYS)
    assert set(spec_env.KINDS) == set(spec_env.TOOL_KEYS)
    assert (shape(s.CallPattern), shape(s.Entity), shape(s.Component)) == (
        spec_env.CALL_KEYS, spec_env.ENTITY_KEYS, spec_env.COMPONENT_KEYS)
    assert (shape(s.CallStep), shape(s.ReplyStep)) == spec_env.STEP_KEYS
    assert set(typing_args(s.Compare.model_fields["cmp"].annotation)) == set(spec_env.CMPS)
    required, optional = shape(s.EnvSpec)
    runtime = spec_env.SPEC_KEYS
    # the one difference, on purpose: the grammar makes a builder write entities and task (a spec may omit them)
    assert {**required, **optional} == {**runtime[0], **runtime[1]} and set(required) - set(runtime[0]) == {
        "entities", "task"}
    assert s.EnvSpec.model_validate(AIRLINE).to_spec() == AIRLINE
    for case in ("a weight that is a string", "a missing key", "an unknown key", "an unknown op"):
        with pytest.raises(ValueError):
            s.EnvSpec.model_validate(MALFORMED[case][0]())


def typing_args(ann):
    import typing

    return typing.get_args(ann)


def test_envspec_schema_compiles_to_a_llama_cpp_grammar():
    llama_grammar = pytest.importorskip("llama_cpp.llama_grammar")
    from trace_rl.agents.env_spec import EnvSpec

    gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(EnvSpec.model_json_schema()))
    assert "reply_contains" in gbnf and "called_before" in gbnf
    llama_grammar.LlamaGrammar.from_string(gbnf, verbose=False)  # parses as a grammar


def test_rendered_module_carries_the_spec_and_the_targets_schemas():
    from trace_rl.agents.env_spec import render_module

    distractor = {"type": "function", "function": {"name": "book_reservation", "parameters": {"type": "object"}}}
    code = render_module(AIRLINE, TOOLS + [distractor])
    ns = {"__name__": "trace_rl_env"}
    exec(compile(code, "env.py", "exec"), ns)  # our own module text on our own test spec
    assert ns["SPEC"] == AIRLINE
    assert ns["TOOLS"] == [t for t in TOOLS if t["function"]["name"] in AIRLINE["tools"]]
    env = ns["Env"]()
    assert play(env, 2, lambda e: e.solve())["success"]
    hostile = mutate("hint", '"""\nimport os; os._exit(3)\n"""')
    ns = {"__name__": "trace_rl_env"}
    exec(compile(render_module(hostile, TOOLS), "env.py", "exec"), ns)  # the text stays a string
    assert ns["SPEC"]["hint"] == hostile["hint"]


@pytest.mark.docker
def test_rendered_spec_passes_the_verifiers_automatic_checks_in_the_sandbox(sandbox_image):
    from trace_rl.agents.env_spec import check_in_sandbox, render_module
    from trace_rl.agents.verifier import VerifyConfig, automatic_checks

    findings, samples = automatic_checks(render_module(AIRLINE, TOOLS), TOOLS, VerifyConfig(seeds=20, determinism_seeds=3))
    assert [f for f in findings if not f.passed] == [] and {f.check for f in findings} >= {
        "contract", "tool_schemas", "determinism", "reference_solver", "trivial_do_nothing", "answer_leak"}
    assert samples["solver"][-1]["role"] == "assistant"
    assert check_in_sandbox(AIRLINE, TOOLS) == []
    bad = check_in_sandbox(mutate("reward.2.pred.of.1", {"op": "reply_contains", "text": "refund"}), TOOLS)
    assert checks(bad) == {"reference_fails"}


def _slipped():
    """The reference spec with the slips the embedded 1.5B made for real (docs/examples/spec-build)."""
    s = copy.deepcopy(AIRLINE)
    del s["entities"]["reservation"]["fields"]["insurance"]  # used by a task fact, never declared
    s["entities"]["reservation"]["fields"]["airport"] = {"type": "ref", "entity": "airport"}  # undeclared entity
    s["task"]["eligible"] = json.loads(json.dumps(s["task"]["eligible"]).replace("task.reservation.", "task.res."))
    s["tools"]["cancel_reservation"]["set"]["refunded_at"] = "{args.reservation_id}"  # an undeclared field set
    del s["tools"]["transfer_to_human_agents"]  # called by the reference, not exposed
    step = next(x for x in s["reference"] if x.get("call") == "cancel_reservation")
    step["call"], step["args"] = "cancel_pending_order", {"reason": "x"}  # retail's tool and argument, not its id
    s["tools"]["find_user_id_by_email"] = {"kind": "read", "entity": "user", "arg": "email"}  # retail's tool
    s["task"]["desk"] = {"type": "const", "value": ["A1", "B2"]}
    s["user_message"] = s["user_message"].replace("{task.reason.text}", "{task.reason.text} (desk {task.desk[0]})")
    return s


def test_code_repairs_a_small_models_mechanical_slips_and_says_which():
    from trace_rl.agents.env_spec import suggest_behaviour

    slipped = _slipped()
    assert len(spec_env.static_findings(slipped, TOOLS)) >= 6
    suggestions = {t["function"]["name"]: suggest_behaviour(t["function"])[0] for t in TOOLS}
    fixed, notes = spec_env.repair_spec(slipped, TOOLS, suggestions=suggestions)
    assert spec_env.static_findings(fixed, TOOLS) == [] and slipped == _slipped()  # the input is left as it was
    said = " | ".join(notes)
    for part in ("a.0.b", "entities.reservation.fields.insurance", "entities.airport", "task.res -> task.reservation",
                 "refunded_at", "tools.transfer_to_human_agents", "cancel_pending_order -> cancel_reservation",
                 "reservation_id: filled by code", "reason=...): dropped", "tools.find_user_id_by_email: dropped"):
        assert part in said, part
    assert fixed["entities"]["reservation"]["fields"]["insurance"]["type"] == "choice"
    assert "(desk {task.desk.0})" in fixed["user_message"]
    assert set(fixed["entities"]["reservation"]["fields"]["insurance"]["values"]) >= {"yes"}  # a value the spec uses
    assert list(fixed["entities"]).index("airport") < list(fixed["entities"]).index("reservation")  # generated first


def test_an_entity_declared_after_what_refers_to_it_is_moved_before_it_unless_they_form_a_cycle():
    s = copy.deepcopy(AIRLINE)  # reservation refers to user; the 1.5B declared them the other way round
    s["entities"] = {"reservation": s["entities"]["reservation"],
                     **{k: v for k, v in s["entities"].items() if k != "reservation"}}
    assert [f["check"] for f in spec_env.static_findings(s, TOOLS)] == ["unknown_entity"]
    fixed, notes = spec_env.repair_spec(s, TOOLS)
    assert list(fixed["entities"])[:2] == ["user", "reservation"] and notes == [
        "entities.user: moved by code before reservation, which refers to it"]
    assert spec_env.check_spec(fixed, TOOLS) == []
    s["entities"]["user"]["fields"]["latest"] = {"type": "ref", "entity": "reservation"}  # a cycle: not code's call
    fixed, notes = spec_env.repair_spec(s, TOOLS)
    assert notes == [] and "unknown_entity" in [f["check"] for f in spec_env.static_findings(fixed, TOOLS)]


def test_a_field_written_as_one_task_name_is_read_from_the_picked_record_and_text_keeps_brackets():
    s = copy.deepcopy(AIRLINE)
    s["user_message"] = "Cancel {task.reservation_id} please [1]."
    fixed, notes = spec_env.repair_spec(s, TOOLS)
    assert fixed["user_message"] == "Cancel {task.reservation.reservation_id} please [1]."
    assert spec_env.static_findings(fixed, TOOLS) == [] and len(notes) == 1


def test_a_spec_that_exposes_every_tool_keeps_those_it_uses_and_a_few_others():
    from trace_rl.evals.benchmark import load_benchmark

    tools = load_benchmark("tau2:airline").spec()["tools"]
    s = copy.deepcopy(AIRLINE)
    for t in tools:  # every airline tool, as the 1.5B exposed all 14
        s["tools"].setdefault(t["function"]["name"], {"kind": "const", "result": "ok"})
    assert len(s["tools"]) > spec_env.EXPOSED_TOOLS
    fixed, notes = spec_env.repair_spec(s, tools)
    assert set(AIRLINE["tools"]) <= set(fixed["tools"]) and len(fixed["tools"]) == spec_env.EXPOSED_TOOLS
    assert spec_env.check_spec(fixed, tools) == [] and "kept 5" in notes[-1]
    s["reference"][0]["when"] = {"op": "not_called", "tool": "search_direct_flight"}  # a tool named only there
    fixed, _ = spec_env.repair_spec(s, tools)
    assert "search_direct_flight" in fixed["tools"] and len(fixed["tools"]) == spec_env.EXPOSED_TOOLS


def test_what_code_cannot_decide_stays_a_finding_and_hostile_specs_are_left_alone():
    s = copy.deepcopy(AIRLINE)
    s["reference"][-1]["when"] = fact("refundable")  # a fact the builder never defined: its decision, not code's
    fixed, notes = spec_env.repair_spec(s, TOOLS)
    assert notes == [] and any("refundable" in f["detail"] for f in spec_env.static_findings(fixed, TOOLS))
    for hostile in (None, [], "x", {"entities": "no"}, {"tools": {"a": 1}, "entities": {"e": {"fields": 3}}}):
        out, _ = spec_env.repair_spec(hostile, TOOLS)
        assert out == hostile or isinstance(out, dict)
