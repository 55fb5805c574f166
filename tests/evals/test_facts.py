"""Code-established trajectory facts (the analyst's evidence) and the transfer metrics built on them."""
import json

from trace_rl.core.trajectory import Trajectory
from trace_rl.evals.facts import metric_for, render_facts, trajectory_facts, transfer_metrics
from trace_rl.core.records import Capability

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"reservation_id": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["reservation_id"]}}} for n in ("get_reservation_details", "cancel_reservation")]


def call(name, **args):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def tool(text):
    return {"role": "tool", "tool_call_id": "c", "content": text}


def traj(*messages, termination="agent_stop"):
    return Trajectory(task_id="t", benchmark="b", trial=0, model="m", reward=0.0, passed=False,
                      termination=termination, messages=[{"role": "system", "content": "s"},
                                                         {"role": "user", "content": "cancel ABC123"}, *messages])


def test_each_fact_is_found_at_its_step():
    t = traj(call("cancel_reservation", reservation_id="ABC123"), tool("Error: reservation not found"),
             call("get_reservation_details", reservation_id="ABC123"), tool('{"reservation_id": "ABC123"}'),
             call("get_reservation_details", reservation_id="ABC123"), tool("{}"),
             call("book_flight", origin="SFO"), tool("Error: Tool 'book_flight' not found."),
             call("cancel_reservation", count="2"), tool("Error: missing reservation_id"))
    f = trajectory_facts(t, TOOLS)
    assert [o["step"] for o in f["write_without_read"]] == [2]  # the id was read only later
    assert [o["step"] for o in f["tool_errors"]] == [3, 9, 11]
    assert [o["step"] for o in f["repeated_calls"]] == [6]
    assert f["unknown_tools"] == [{"step": 8, "detail": "book_flight"}]
    assert f["ungrounded_arguments"] == [{"step": 8, "detail": "book_flight: SFO"}]  # ABC123 was in the user's message
    assert f["invalid_arguments"][0]["step"] == 10 and "missing 'reservation_id'" in f["invalid_arguments"][0]["detail"]
    assert "'count' should be integer" in f["invalid_arguments"][0]["detail"]
    assert f["turns"] == 5 and f["tools_used"] == ["book_flight", "cancel_reservation", "get_reservation_details"]
    assert "fact write_without_read at step 2" in render_facts(f)


def test_a_careful_trajectory_has_no_failure_facts():
    t = traj(call("get_reservation_details", reservation_id="ABC123"), tool('{"status": "booked"}'),
             call("cancel_reservation", reservation_id="ABC123"), tool('{"status": "cancelled"}'),
             {"role": "assistant", "content": "Done."})
    f = trajectory_facts(t, TOOLS)
    assert not any(f[k] for k in ("tool_errors", "unknown_tools", "invalid_arguments", "repeated_calls",
                                  "write_without_read", "ungrounded_arguments", "no_tool_calls"))
    silent = traj({"role": "assistant", "content": "I would need the ticket first."})
    assert trajectory_facts(silent, TOOLS)["no_tool_calls"] == [{"step": 2, "detail": "I would need the ticket first."}]


def test_transfer_metric_is_the_share_of_episodes_with_the_failure():
    careless = traj(call("cancel_reservation", reservation_id="ABC123"), tool("{}"))
    careful = traj(call("get_reservation_details", reservation_id="ABC123"), tool("ABC123"),
                   call("cancel_reservation", reservation_id="ABC123"), tool("{}"))
    cap = Capability(name="precondition_verification", description="Checks before acting.")
    m = transfer_metrics([careless, careful, careful, careful], [cap], TOOLS)["precondition_verification"]
    assert m["metric"] == "write_without_read" and m["with_fact"] == 1 and m["rate"] == 0.25
    assert m["ci95"][0] < 0.25 < m["ci95"][1]
    assert metric_for(Capability(name="tool_call_precision", description="")) == "ungrounded_arguments"
    assert metric_for(Capability(name="schema_adherence", description="")) == "invalid_arguments"
    informed = Capability(name="argument_precision", description="Fills arguments only with information it was given.")
    assert metric_for(informed) == "ungrounded_arguments"  # "format" inside "information" is no match
    assert metric_for(Capability(name="polite_style", description="Is polite.")) == "tool_errors"


def test_the_summary_counts_each_fact_over_failed_and_passed_with_examples():
    from trace_rl.evals.facts import facts_summary

    bad = traj(call("cancel_reservation", reservation_id="XYZ"), tool("Error: reservation not found"),
               termination="too_many_errors")
    silent = traj({"role": "assistant", "content": "Sure, I can help."}, termination="agent_error")
    good = traj(call("get_reservation_details", reservation_id="ABC123"), tool('{"status": "booked"}'))
    facts = {k: trajectory_facts(t, TOOLS) for k, t in [("bad", bad), ("silent", silent), ("good", good)]}
    text = facts_summary(facts, {"bad": False, "silent": False, "good": True})
    assert "all 3 trajectories (2 failed, 1 passed)" in text
    assert "failed: too_many_errors 1, agent_error 1; passed: agent_stop 1" in text
    assert "no_tool_calls (the agent ended without calling any tool): failed 1 of 2, passed 0 of 1; " \
           "e.g. 'Sure, I can help.'" in text
    assert "tool_errors (a tool answered with an error): failed 1 of 2, passed 0 of 1; " \
           "e.g. 'Error: reservation not found'" in text
    assert "write_without_read" in text and "failed 1 of 2" in text.split("write_without_read")[1]


def test_a_made_up_id_is_ungrounded_and_a_copied_or_listed_one_is_not():
    """The embedded 1.5B asked for customer "12345" where the ticket named a phone number: an id
    copied from no earlier message. Values from a schema's enum, free text and ids read from an
    earlier message or an earlier result are grounded."""
    tools = [{"type": "function", "function": {"name": "get_bills", "parameters": {"type": "object", "properties": {
        "customer_id": {"type": "string"}, "status": {"type": "string", "enum": ["overdue", "paid"]},
        "note": {"type": "string"}}}}}]
    t = traj(call("get_bills", customer_id="12345", status="overdue", note="asked by the user"),
             tool('{"customer_id": "C1001"}'), call("get_bills", customer_id="C1001", status="paid"), tool("{}"))
    f = trajectory_facts(t, tools)
    assert f["ungrounded_arguments"] == [{"step": 2, "detail": "get_bills: 12345"}]
    accents = [{"type": "function", "function": {"name": "set_city", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Zürich", "Genève"]}}}}}]
    assert not trajectory_facts(traj(call("set_city", city="Zürich")), accents)["ungrounded_arguments"]
