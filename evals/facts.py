"""Facts about a trajectory that code can establish, so the analyst labels from evidence and a
trained capability can be measured on the target even when no task passes.

Every fact is a list of occurrences {"step": message index, "detail": text}. Step indices are
positions in `Trajectory.messages`, the same numbers the analyst sees (`agents.analyst.compact`).
"""
from __future__ import annotations

import json
import re
from collections import Counter

from trace_rl.core.episode import tool_arguments
from trace_rl.core.records import Capability
from trace_rl.core.trajectory import Trajectory
from trace_rl.evals.report import wilson

FACTS = {
    "tool_errors": "a tool answered with an error",
    "unknown_tools": "a call to a tool the agent was not given",
    "invalid_arguments": "a call whose arguments break the tool's schema (missing, unknown or mistyped)",
    "repeated_calls": "the same call (tool and arguments) made again",
    "write_without_read": "a tool that changes data called on an id no earlier call or result mentioned",
    "ungrounded_arguments": "an id-like argument (3+ characters, no spaces) that appears in no earlier message",
    "no_tool_calls": "the agent ended without calling any tool",
}
READ_VERBS = ("get", "find", "list", "search", "check", "calculate", "lookup", "read", "show", "view", "think")
NEUTRAL = ("transfer_to_human_agents", "done")  # neither reads nor changes data
TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def is_write(tool: str) -> bool:
    """A tool that changes data, by its name's first word (τ²-bench's tools all follow this)."""
    return tool not in NEUTRAL and tool.split("_")[0] not in READ_VERBS


def _schema_problems(args: dict | None, schema: dict) -> list[str]:
    if args is None:
        return ["arguments are not a JSON object"]
    props, required = schema.get("properties") or {}, schema.get("required") or []
    out = [f"missing {k!r}" for k in required if k not in args]
    out += [f"unknown argument {k!r}" for k in args if props and k not in props]
    for k, v in args.items():
        if v is None and k not in required:  # null for an optional argument is leaving it out: ToolSandbox's
            continue                         # tools take it (their schemas say "number", their defaults are None)
        want = TYPES.get((props.get(k) or {}).get("type"))
        if want and not (isinstance(v, want) and (want is bool or not isinstance(v, bool))):  # True is no int
            out.append(f"{k!r} should be {(props[k])['type']}, got {type(v).__name__}")
    return out


def trajectory_facts(traj: Trajectory, tools: list[dict] | None = None) -> dict[str, list[dict]]:
    """{fact: occurrences} plus "termination", "tools_used" and "turns". `tools`: the schemas the
    agent was given (unknown-tool and argument checks need them; without, those facts stay empty)."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
    facts: dict = {name: [] for name in FACTS}
    seen_calls, mentioned, used = set(), set(), []
    said = json.dumps(schemas, ensure_ascii=False)  # all the agent had seen so far: the schemas' enums, every message
    for step, m in enumerate(traj.messages):
        content = str(m.get("content") or "")
        if m.get("role") == "tool":
            if content.lstrip().lower().startswith("error"):
                facts["tool_errors"].append({"step": step, "detail": content.strip()[:200]})
            mentioned.update(re.findall(r"[A-Za-z0-9_\-]{3,}", content))
            said += "\n" + content
            continue
        sent = ""  # this message's arguments, as sent and decoded (a \u escape is the same value): said after it
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            name, raw = fn.get("name", ""), fn.get("arguments") or "{}"
            args = tool_arguments(raw)
            used.append(name)
            if schemas and name not in schemas:
                facts["unknown_tools"].append({"step": step, "detail": name})
            elif schemas and (problems := _schema_problems(args, schemas[name])):
                facts["invalid_arguments"].append({"step": step, "detail": f"{name}: {'; '.join(problems)}"})
            key = (name, json.dumps(args, sort_keys=True) if args is not None else str(raw))
            if key in seen_calls:
                facts["repeated_calls"].append({"step": step, "detail": f"{name}({key[1][:120]})"})
            seen_calls.add(key)
            ids = [v for v in (args or {}).values() if isinstance(v, str) and len(v) >= 3]
            known = not schemas or name in schemas  # a call to a tool that does not exist changed nothing
            if known and is_write(name) and ids and not any(v in mentioned for v in ids):
                facts["write_without_read"].append({"step": step, "detail": f"{name} on {', '.join(ids)[:120]}"})
            if made_up := [v for v in ids if not re.search(r"\s", v) and v not in said]:  # e.g. customer "12345"
                facts["ungrounded_arguments"].append({"step": step, "detail": f"{name}: {', '.join(made_up)[:120]}"})
            mentioned.update(v for v in (args or {}).values() if isinstance(v, str))
            sent += f"\n{raw} " + " ".join(map(str, (args or {}).values()))
        said += "\n" + content + sent
    if not used:
        last = max((i for i, m in enumerate(traj.messages) if m.get("role") == "assistant"), default=None)
        facts["no_tool_calls"].append({"step": last, "detail": str(traj.messages[last].get("content") or "")[:120]
                                       if last is not None else "no agent turn"})
    return {**facts, "termination": traj.termination, "tools_used": sorted(set(used)),
            "turns": sum(m.get("role") == "assistant" for m in traj.messages)}


def hollow(traj: Trajectory) -> bool:
    """An episode the user (simulator) ended before the agent did anything: at most one opening
    message, no tool call. τ²-bench passes one when the task asks for no change. Passed or failed, it
    shows nothing about the agent."""
    return traj.termination == "user_stop" and not any(m.get("tool_calls") for m in traj.messages) and \
        sum(m.get("role") == "assistant" for m in traj.messages) <= 1


def render_facts(facts: dict) -> str:
    """The facts as the analyst reads them, under the trajectory."""
    lines = [f"facts: ended by {facts['termination']}, {facts['turns']} agent turns, tools used: "
             f"{', '.join(facts['tools_used']) or 'none'}"]
    lines += [f"  fact {name} at step {occ['step']}: {occ['detail']}" for name in FACTS for occ in facts[name][:5]]
    return "\n".join(lines)


def facts_summary(facts: dict[str, dict], outcome: dict[str, bool], examples: int = 2) -> str:
    """What code found across *all* trajectories, failed vs passed, with a few verbatim examples:
    discovery reads a handful of trajectories, and a small model proposes from one long read; these
    counts show it which failures recur and how often."""
    failed = [k for k in facts if not outcome.get(k, False)]
    passed = [k for k in facts if outcome.get(k, False)]

    def share(keys: list[str], has) -> str:
        return f"{sum(bool(has(facts[k])) for k in keys)} of {len(keys)}"

    def ends(keys: list[str]) -> str:
        return ", ".join(f"{t} {n}" for t, n in Counter(facts[k]["termination"] for k in keys).most_common()) or "none"

    lines = [f"Code-found facts across all {len(facts)} trajectories ({len(failed)} failed, {len(passed)} passed):",
             f"- how episodes ended: failed: {ends(failed)}; passed: {ends(passed)}"]
    for name, meaning in FACTS.items():
        seen = list(dict.fromkeys(o["detail"][:100] for k in failed for o in facts[k][name]))[:examples]
        lines.append(f"- {name} ({meaning}): failed {share(failed, lambda f: f[name])}, "
                     f"passed {share(passed, lambda f: f[name])}" + (f"; e.g. {'; '.join(map(repr, seen))}" if seen else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------- capability transfer metrics
METRIC_WORDS = [  # (words in a capability's name or description, the fact that measures it)
    (("precondition", "verif", "before", "check", "eligib"), "write_without_read"),
    (("schema", "format"), "invalid_arguments"),
    # arguments that keep to the schemas can still carry made-up ids: precision is measured by grounding
    (("precision", "argument", "parameter", "ground", "fabricat"), "ungrounded_arguments"),
    (("unknown", "hallucinat", "nonexistent"), "unknown_tools"),
    (("repeat", "loop", "redundant", "duplicate"), "repeated_calls"),
]


def metric_for(capability: Capability) -> str:
    """The fact whose rate measures a capability on the target (tool errors when no word matches)."""
    text = (capability.name + " " + capability.description).lower().replace("_", " ")
    # at a word's start: "format" is not in "information", "ground" not in "background"
    return next((fact for words, fact in METRIC_WORDS if any(re.search(rf"\b{w}", text) for w in words)),
                "tool_errors")


def transfer_metrics(trajs: list[Trajectory], capabilities: list[Capability], tools: list[dict] | None) -> dict:
    """{capability: {"metric", "episodes", "with_fact", "rate", "ci95"}}: the share of episodes in
    which the failure the capability is about occurred (lower is better)."""
    facts = [trajectory_facts(t, tools) for t in trajs]
    out = {}
    for cap in capabilities:
        metric = metric_for(cap)
        hits = sum(bool(f[metric]) for f in facts)
        out[cap.name] = {"metric": metric, "episodes": len(facts), "with_fact": hits,
                            "rate": hits / len(facts) if facts else 0.0, "ci95": wilson(hits, len(facts))}
    return out
