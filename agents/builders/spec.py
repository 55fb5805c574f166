"""Spec mode (small local models): the model writes a JSON spec decoded under EnvSpec's JSON schema
(llama.cpp's grammar), starting from a minimal spec code writes on the target's own tools; code repairs
mechanical slips (in the sandbox) and renders the module that runs it (sandbox/image/spec_env.py)."""
from __future__ import annotations

import ast
import json
import re
from importlib import resources

from trace_rl import prompts
from trace_rl.agents.builders import Target, ask_builder
from trace_rl.agents.env_spec import EnvSpec, render_module, repair_in_sandbox, suggest_behaviour
from trace_rl.core.io import atomic_write_json
from trace_rl.core.records import Capability
from trace_rl.core.rundir import Attempt


def starter_spec(tools: list[dict], name: str = "") -> dict:
    """A minimal valid spec that code writes on the target's own tools (look a record up by its id,
    tell the user a code only the record holds), for the builder to extend: a worked example from another domain gets
    that domain's tools, ids and facts copied."""
    from trace_rl.agents.env_patterns import string_key

    def rank(t):  # a read by id, then a read by another field, then a search (ToolSandbox has no read)
        behaviour, entity, key = suggest_behaviour(t["function"])
        kind = behaviour["kind"]
        required = set((t["function"].get("parameters") or {}).get("required") or [])
        if kind not in ("read", "list") or not key or not string_key(t["function"], key) or required - {key}:
            return None  # spec_env's ids are strings; the reference passes the key alone
        return (kind == "list", "field" in behaviour)
    ranked = sorted((r, i) for i, t in enumerate(tools) if (r := rank(t)) is not None)
    if not ranked:
        raise ValueError("the target has no tool that looks a record up by a string: write the example by hand")
    fn = tools[ranked[0][1]]["function"]
    tool, (_, entity, key) = fn["name"], suggest_behaviour(fn)
    arg = key
    behaviour = ({"kind": "list", "entity": entity, "where": {key: f"{{args.{key}}}"}} if ranked[0][0][0]
                 else {"kind": "read", "entity": entity, "arg": key, **({"field": key} if ranked[0][0][1] else {})})
    # the answer is a value only the tool reveals: a word like "cancelled" is in the target's policy,
    # which the verifier's echo policy repeats (an answer leak)
    rid, code = f"{{task.{entity}.{key}}}", f"{{task.{entity}.reference_code}}"
    return {"name": name, "entities": {entity: {"count": [3, 6], "fields": {
                key: {"type": "id", "pattern": entity[:1].upper() + "{n:04d}"},
                "reference_code": {"type": "id", "pattern": "RC{n:05d}"}}}},
            "task": {entity: {"type": "pick", "entity": entity}},
            "tools": {tool: behaviour},
            "system_prompt": "Help the user with the tools; check records before you answer.",
            "user_message": f"What is the reference code of {rid}?",
            "reference": [{"call": tool, "args": {arg: rid}}, {"reply": f"It is {code}."}],
            "reward": [{"name": "looked_up", "weight": 0.5, "pred": {"op": "called", "tool": tool, "args": {arg: rid}}},
                       {"name": "told", "weight": 0.5, "pred": {"op": "reply_contains", "text": code}}]}


def copies_starter(spec: dict, tools: list[dict]) -> bool:
    """Whether a spec still asks, does and rewards exactly what the starter does (look a record up,
    tell its reference code): the example "trains nothing yet", so a spec that only renamed its
    entity, tool or slots is not an environment for any capability, though every automatic check passes it."""
    try:
        starter = starter_spec(tools)
    except ValueError:
        return False
    return _task_shape(spec, tools) == _task_shape(starter, tools)


def _task_shape(spec: dict, tools: list[dict]) -> str:
    """The user message, reference and reward with slots, tool names and arguments abstracted (the starter
    with the record looked up by another tool or argument is still the starter)."""
    names = {t["function"]["name"] for t in tools}

    def walk(x, key: str | None = None):
        if key == "args":
            return {}
        if isinstance(x, dict):
            return {k: walk(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, str):
            x = re.sub(r"\{\{?\s*task\.[^}]*\}\}?", "{slot}", x)
            return "TOOL" if x in names else x
        return x
    return json.dumps(walk([spec.get(k) for k in ("user_message", "reference", "reward")]), sort_keys=True)


def one_key_per_line(spec: dict) -> str:
    return "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in spec.items()) + "\n}"


def spec_format() -> str:
    """The format's documentation: the runtime's own docstring (one source for both)."""
    doc = ast.get_docstring(ast.parse((resources.files("trace_rl.sandbox") / "image" / "spec_env.py").read_text()))
    return doc[doc.index("Spec keys"):]


def tool_line(fn: dict) -> str:
    """A target tool in one line: name(arguments): the first line of its description."""
    args = ", ".join((fn.get("parameters") or {}).get("properties") or {})
    return f"- {fn['name']}({args}): {(fn.get('description') or '').strip().split(chr(10))[0][:90]}"


def tool_suggestions(tools: list[dict]) -> tuple[str, str]:
    """The request's tool list (one line per tool, with the behaviour code suggests) and entity
    skeletons for the entities those behaviours use: keyed by the id argument that looks them up
    (get_user_details(user_id)), with the other fields tools look them up by (email) after the key."""
    lines, entities, lookups = [], {}, []
    for t in tools:
        fn = t["function"]
        behaviour, entity, key = suggest_behaviour(fn)
        lines.append(f"{tool_line(fn)}\n    suggested: {json.dumps(behaviour)}")
        if entity and key and "field" in behaviour:
            lookups.append((entity, key))
        elif entity and key:
            entities.setdefault(entity, key)
    skeletons = {e: {"count": [3, 6], "fields": {k: {"type": "id", "pattern": e[:1].upper() + "{n:04d}"}}}
                 for e, k in entities.items()}
    for entity, field in lookups:  # a lookup field: unique per record, after the key
        fields = skeletons.setdefault(entity, {"count": [3, 6], "fields": {}})["fields"]
        fields.setdefault(field, {"type": "id", "pattern": f"{field}_{{n:03d}}"})
    return "\n".join(lines), json.dumps(skeletons)


def spec_messages(capability: Capability, target: Target, examples: list[str], feedback: str | None,
                  previous: str | None) -> list[dict]:
    tools, skeletons = tool_suggestions(target.tools)
    user = (f"# Capability to train\n{capability.name}: {capability.description}\n\n"
            f"# Failed trajectories that show the gap\n" + "\n\n".join(examples)[:3000] +
            f"\n\n# Target benchmark: {target.name}\n## Its tools (name(arguments): description), each with the "
            f"behaviour code suggests (use the tool name alone as the key in `tools`; change what you need)\n{tools}"
            f"\n\n## Entity skeletons for those behaviours (declare every entity a tool names; add the fields your "
            f"task, reference and reward use)\n{skeletons}"
            f"\n\n## Its policy (excerpt; code puts the whole policy in the env's system prompt)\n{target.policy[:1500]}")
    if previous is not None:  # findings last, nearest the answer: small models otherwise echo the old spec
        user += (f"\n\n# Your previous spec\n{previous}\n# What the checks found in it (fix every one)\n{feedback}"
                 "\nWrite the corrected spec. Do not send the previous one again unchanged.")
    system = prompts.load("env_builder_spec", format=spec_format(),
                          example=one_key_per_line(starter_spec(target.tools, capability.name)))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def write_spec(llm, capability: Capability, target: Target, examples: list[str], feedback=None, previous=None,
               attempts: int = 2) -> dict:
    """The builder's spec, decoded under EnvSpec's JSON schema (llama.cpp's grammar); a spec with
    no tool of the target goes straight back to it. Everything else is repaired or checked in the
    sandbox (repair_spec, check_spec)."""
    names = sorted(t["function"]["name"] for t in target.tools)

    def known_tools(spec: EnvSpec) -> dict:
        # the request lists tools as `name(arguments)`; a model may copy that form as the name: code strips it
        spec.tools = {n.split("(")[0].strip(): v for n, v in spec.tools.items()}
        if not any(n in names for n in spec.tools):  # some other domain's tools only: nothing to repair from
            raise ValueError(f"tools: {sorted(spec.tools)} are not tools of {target.name}; choose from "
                             f"{', '.join(names)}")
        return spec.to_spec()  # another domain's tool next to real ones: code drops it in the sandbox
    return ask_builder("spec", lambda: llm.structured(
        spec_messages(capability, target, examples, feedback, previous), EnvSpec, attempts,
        check=known_tools,  # a bad spec costs a round, which has findings to fix
        **({"temperature": 0.7} if previous else {})))  # a later round must not repeat


def write(llm, capability: Capability, target: Target, examples: list[str], attempt: Attempt, feedback: str | None,
          previous: str | None, earlier: list[Attempt]) -> str:
    """Also writes builder_spec.json (what the model wrote), repairs.json and spec.json (what runs)."""
    raw = write_spec(llm, capability, target, list(examples), feedback, previous)
    atomic_write_json(attempt.builder_spec, raw)  # what the model wrote, as it wrote it
    suggestions = {t["function"]["name"]: suggest_behaviour(t["function"])[0] for t in target.tools}
    fixed, repairs = repair_in_sandbox(raw, target.tools, suggestions)  # mechanical slips, fixed by code
    atomic_write_json(attempt.repairs, repairs)
    atomic_write_json(attempt.spec, fixed)
    return render_module(fixed, target.tools, target.policy)  # schemas and policy: copied by code
