"""τ² gold replays for the tests: score a scripted conversation with tau2's own evaluator, to check
that the adapter's scoring agrees with tau2 (gold replay = 100 %, do-nothing = the known floors)."""
import json
import uuid

from trace_rl.core.episode import tool_arguments
from trace_rl.evals.benchmark import BenchmarkError
from trace_rl.evals.tau2_bench import STOP_TOKEN, _now


def gold_actions(bench, task_id: str) -> list[dict]:
    """The task's reference actions as OpenAI tool calls."""
    task = bench._tau2_task(task_id)
    actions = (task.evaluation_criteria.actions or []) if task.evaluation_criteria else []
    return [{"id": a.action_id, "requestor": a.requestor, "type": "function",
             "function": {"name": a.name, "arguments": json.dumps(a.arguments)}} for a in actions]


def gold_say(ep) -> list[str]:
    """The substrings tau2 expects the agent to tell the user."""
    crit = ep.task.evaluation_criteria
    return [str(x) for x in (crit.communicate_info or [])] if crit else []


def replay(ep, tool_calls: list[dict], say: list[str] = ()):
    """Score a scripted conversation with no user simulator: apply `tool_calls` (each may carry
    `requestor: user`), say each text in `say` to the user, then stop."""
    from tau2.data_model.message import AssistantMessage, ToolCall, UserMessage

    ep._init_state()
    for tc in tool_calls:
        fn = tc["function"]
        requestor = "assistant" if ep.solo else tc.get("requestor", "assistant")
        args = tool_arguments(fn.get("arguments"))
        if args is None:  # a scripted call is the caller's mistake: no episode to record it in
            raise BenchmarkError(f"replay: tool call {fn['name']!r}: arguments are not a JSON object")
        call = ToolCall(id=tc.get("id") or uuid.uuid4().hex[:8], name=fn["name"], arguments=args, requestor=requestor)
        message = AssistantMessage if requestor == "assistant" else UserMessage  # requestor: assistant | user
        ep.trajectory.append(message(role=requestor, tool_calls=[call], timestamp=_now()))
        result = ep.env.get_response(call)
        result.timestamp = _now()
        ep.trajectory.append(result)
    for text in [*say, STOP_TOKEN]:
        ep.trajectory.append(AssistantMessage(role="assistant", content=text, timestamp=_now()))
    return ep.score("agent_stop")
