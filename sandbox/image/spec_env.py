"""Spec mode: an environment written as a JSON spec, not Python (stdlib only: it runs inside the
sandbox image next to trace_env.py).

Small builder models cannot write a whole environment module, but under a grammar they can fill
in a spec. `SpecEnv` turns a spec into an `Environment` under the same contract (so the same
verifier judges it), and `check_spec` turns a bad spec into findings the builder can act on in
its next round. A spec is hostile model output: it is interpreted, never executed, and its size,
depth and every loop are bounded.

Spec keys (hint, max_steps, entities, task are optional):
  tools         {name: behaviour}: which of the target's tools the env exposes. Their schemas come
                from the benchmark (TOOLS), never from the spec. Behaviours:
                  {"kind": "read", "entity": E, "arg": A, "field": F}   the E record whose F (default:
                      E's key) equals args[A], or the error "E <value> not found"
                  {"kind": "update" | "write", ...read's keys, "set": {field: expr}, "guard": P,
                      "error": template}   set fields on that record; if the guard fails: the error
                  {"kind": "list", "entity": E, "where": {field: expr}, "project": field}
                  {"kind": "const", "result": expr}
  entities      {E: {"count": [lo, hi], "fields": {field: F}}}, generated in order. F is one of
                  {"type": "id", "pattern": "R{n:04d}"} (E's first id field is its key)
                  {"type": "choice", "values": [...]} (values may be objects: {task.reason.text})
                  {"type": "int" | "float", "min": a, "max": b}   {"type": "bool", "p": 0.5}
                  {"type": "ref", "entity": E2} (the key of a random E2: E2 must come before E)
                  {"type": "date", "start": "2024-05-01", "days": 30}   {"type": "const", "value": v}
  task          {name: F | {"type": "pick", "entity": E, "where": {field: expr}, "other_than": [name]}
                         | {"type": "fact", "pred": P}}, in order. A pick is the live record, so
                `task.res.status` read at scoring time sees what the agent's tool calls changed;
                `other_than` names earlier picks of E it must not be (a second, different record).
  system_prompt, user_message   templates over `task`
  reference     [{"call": tool, "args": {name: expr}, "when": P} | {"reply": template, "when": P}]
  reward        [{"name": n, "weight": w > 0, "pred": P}]: each component is 1 if P holds, else 0;
                success (reward >= 0.99) means every component holds.

Expressions: JSON literals; strings are templates: "{task.res.reservation_id}" alone is that value
(any type), inside text it is formatted in; "{{task.x}}" is the same slot; other "{{" and "}}" are
literal braces. Paths start at
`task`, in tools also at `args` (the call's arguments) and `record` (the record looked up).

Predicates, {"op": ...}:
  called          {"tool", "args": {...}, "only": false}: a call of tool succeeded whose arguments
                  include args; with only, every call of the tool matched args
  not_called      {"tool", "args"}: no call matched, not even a failed one
  called_before   {"first": {"tool", "args"}, "then": {"tool", "args"}}: first succeeded, and every
                  call matching `then` came after it
  reply_contains  {"text": expr}: in the final reply, ignoring case
  state_equals    {"path", "value": expr}
  compare         {"left": expr, "cmp": "==" | "!=" | "<" | "<=" | ">" | ">=" | "in", "right": expr}
  all, any        {"of": [P, ...]}     not {"of": P}     if {"cond": P, "then": P, "else": P (true)}
"""
import copy
import json
import math
import operator
import re
from datetime import date, timedelta

from trace_env import Environment

MAX_DEPTH, MAX_NODES, MAX_TEXT, MAX_CHARS = 16, 5000, 4000, 60000  # of the spec's JSON
MAX_ENTITIES, MAX_FIELDS, MAX_RECORDS, MAX_STEPS = 10, 30, 50, 30
KINDS = ("read", "update", "write", "list", "const")
FIELD_TYPES = ("id", "choice", "int", "float", "bool", "ref", "date", "const")
TASK_TYPES = FIELD_TYPES + ("pick", "fact")
CMPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
        ">=": operator.ge, "in": lambda left, right: left in right}
ANY = "any"  # a type tag: any JSON value (an expression)
# shapes: {name: (required keys, optional keys)}, each key -> type tag
SPEC_KEYS = ({"system_prompt": str, "user_message": str, "tools": dict, "reference": list, "reward": list},
             {"name": str, "hint": str, "max_steps": int, "entities": dict, "task": dict})
TOOL_KEYS = {"read": ({"entity": str, "arg": str}, {"field": str}),
             "update": ({"entity": str, "arg": str}, {"field": str, "set": dict, "guard": dict, "error": str}),
             "list": ({"entity": str}, {"where": dict, "project": str}),
             "const": ({"result": ANY}, {})}
TOOL_KEYS["write"] = TOOL_KEYS["update"]
FIELD_KEYS = {"id": ({"pattern": str}, {}), "choice": ({"values": list}, {}), "int": ({"min": int, "max": int}, {}),
              "float": ({"min": float, "max": float}, {}), "bool": ({}, {"p": float}),
              "ref": ({"entity": str}, {}), "date": ({"start": str, "days": int}, {}), "const": ({"value": ANY}, {}),
              "pick": ({"entity": str}, {"where": dict, "other_than": list}), "fact": ({"pred": dict}, {})}
PREDICATES = {"called": ({"tool": str}, {"args": dict, "only": bool}), "not_called": ({"tool": str}, {"args": dict}),
              "called_before": ({"first": dict, "then": dict}, {}), "reply_contains": ({"text": ANY}, {}),
              "state_equals": ({"path": str, "value": ANY}, {}),
              "compare": ({"left": ANY, "cmp": str, "right": ANY}, {}),
              "all": ({"of": list}, {}), "any": ({"of": list}, {}), "not": ({"of": dict}, {}),
              "if": ({"cond": dict, "then": dict}, {"else": dict})}
CALL_KEYS = ({"tool": str}, {"args": dict})
ENTITY_KEYS = ({"count": list, "fields": dict}, {})
STEP_KEYS = (({"call": str}, {"args": dict, "when": dict}), ({"reply": str}, {"when": dict}))  # a call, a reply
COMPONENT_KEYS = ({"name": str, "weight": float, "pred": dict}, {})
# the same format as the builder's schema (agents/env_spec.py, pydantic): tests/sandbox/test_spec_runtime.py fails on any drift
TRIVIAL_REPLIES = {"do_nothing": "Hello! How can I help you?",  # the verifier's trivial policies
                   "refuse": "I'm sorry, I cannot help with that request and I am unable to do it."}
# a slot: {path}, or {{ path }} for a path from task/args/record (small models write it so); else
# "{{" and "}}" are literal braces
_SLOT = re.compile(r"\{\{\s*((?:task|args|record)(?:\.\w+)*)\s*\}\}|\{\{|\}\}|\{([^{}]*)\}")
_PATH = re.compile(r"[A-Za-z_]\w*(\.\w+)*")
_ID = re.compile(r"\{n(?::0(\d)d)?\}")


class SpecError(ValueError):
    """The spec cannot be run as written (a message names the spec's field)."""


def finding(check, where, detail):
    return {"check": check, "passed": False, "detail": f"{where}: {detail}"}


# ---------------------------------------------------------------- expressions and predicates
def resolve(path, ctx):
    """A dotted path over ctx's roots (task / args / record); list items by index."""
    value = ctx
    for seg in path.split("."):
        if isinstance(value, dict) and seg in value:
            value = value[seg]
        elif isinstance(value, list) and seg.isdigit() and int(seg) < len(value):
            value = value[int(seg)]
        else:
            raise SpecError(f"'{{{path}}}': nothing at '{seg}'")
    return value


def _bare(path):
    """A path field written as a slot ("{task.x}", "{{ task.x }}") is that path."""
    return path.strip().lstrip("{").rstrip("}").strip()


def _slot_path(m):
    """The path a template slot names, or None for a literal brace."""
    path = m.group(1) if m.group(1) is not None else m.group(2)
    return None if path is None else path.strip()


def render(expr, ctx):
    """An expression's value: strings are templates, lists and objects are rendered item by item."""
    if isinstance(expr, list):
        return [render(x, ctx) for x in expr]
    if isinstance(expr, dict):
        return {k: render(v, ctx) for k, v in expr.items()}
    if not isinstance(expr, str):
        return expr
    whole = _SLOT.fullmatch(expr)
    if whole and _slot_path(whole) is not None:
        return copy.deepcopy(resolve(_slot_path(whole), ctx))

    def slot(m):
        if _slot_path(m) is None:
            return m.group(0)[0]
        v = resolve(_slot_path(m), ctx)
        return v if isinstance(v, str) else json.dumps(v)
    return _SLOT.sub(slot, expr)[:MAX_TEXT]


def _matches(call, pattern, ctx):
    want = render(pattern.get("args", {}), ctx)
    return call[0] == pattern["tool"] and all(k in call[1] and call[1][k] == v for k, v in want.items())


def holds(p, env, ctx):
    """Evaluate predicate p on the episode so far (env.calls, env.final_reply) and the state."""
    op = p["op"]
    if op in ("all", "any"):
        return (all if op == "all" else any)(holds(q, env, ctx) for q in p["of"])
    if op == "not":
        return not holds(p["of"], env, ctx)
    if op == "if":
        branch = p["then"] if holds(p["cond"], env, ctx) else p.get("else")
        return branch is None or holds(branch, env, ctx)
    if op == "called":
        of_tool = [c for c in env.calls if c[0] == p["tool"]]
        hits = [c for c in of_tool if _matches(c, p, ctx)]
        return any(c[2] is not None for c in hits) and (not p.get("only") or len(hits) == len(of_tool))
    if op == "not_called":
        return not any(_matches(c, p, ctx) for c in env.calls)
    if op == "called_before":
        first = next((i for i, c in enumerate(env.calls) if c[2] is not None and _matches(c, p["first"], ctx)), None)
        return first is not None and all(i > first for i, c in enumerate(env.calls) if _matches(c, p["then"], ctx))
    if op == "reply_contains":
        text = render(p["text"], ctx)
        text = text if isinstance(text, str) else json.dumps(text)
        return bool(text) and text.lower() in env.final_reply.lower()
    if op == "state_equals":
        return resolve(_bare(p["path"]), ctx) == render(p["value"], ctx)
    if op == "compare":
        try:
            return bool(CMPS[p["cmp"]](render(p["left"], ctx), render(p["right"], ctx)))
        except TypeError:  # "abc" < 3, 3 in 4: not true
            return False
    raise SpecError(f"unknown op {op!r}")


# ---------------------------------------------------------------- the environment
class SpecEnv(Environment):
    """An Environment whose instance, tools, reference and reward all come from SPEC."""
    SPEC = None
    TOOLS = []  # the target's full tool schemas (at least those SPEC names), copied by host code
    POLICY = ""  # the target's policy, copied by host code: it comes before the spec's system prompt

    def __init__(self, spec=None, tools=None):
        spec, tools = (self.SPEC if spec is None else spec), (self.TOOLS if tools is None else tools)
        problems = static_findings(spec, tools)
        if problems:
            raise SpecError("; ".join(f["detail"] for f in problems[:5]))
        self.spec = spec
        by_name = {t["function"]["name"]: t for t in tools}
        self.tools = [by_name[name] for name in spec["tools"]]
        self.hint, self.max_steps = spec.get("hint", ""), spec.get("max_steps", 10)

    def __getattr__(self, name):  # tool_<name> for every exposed tool
        if name.startswith("tool_") and name[5:] in self.__dict__.get("spec", {}).get("tools", {}):
            return lambda **args: self._call(name[5:], args)
        raise AttributeError(name)

    def generate(self, rng):
        self.state, self.task = {}, {}
        for name, ent in self.spec.get("entities", {}).items():
            n = rng.randint(*ent["count"])
            ids = {f: _ids(spec["pattern"], n, rng) for f, spec in ent["fields"].items() if spec["type"] == "id"}
            self.state[name] = [{f: ids[f][i] if f in ids else self._value(spec, rng)
                                 for f, spec in ent["fields"].items()} for i in range(n)]
        for name, spec in self.spec.get("task", {}).items():
            self.task[name] = self._value(spec, rng)
        ctx = {"task": self.task}
        own = str(render(self.spec["system_prompt"], ctx))
        self._system_prompt = f"<policy>\n{self.POLICY}\n</policy>\n\n{own}" if self.POLICY else own
        return str(render(self.spec["user_message"], ctx))

    def _value(self, spec, rng):
        t = spec["type"]
        if t == "choice":
            return copy.deepcopy(rng.choice(spec["values"]))
        if t == "int":
            return rng.randint(spec["min"], spec["max"])
        if t == "float":
            return round(rng.uniform(spec["min"], spec["max"]), 2)
        if t == "bool":
            return rng.random() < spec.get("p", 0.5)
        if t == "ref":
            return rng.choice(self.state[spec["entity"]])[key_field(self.spec, spec["entity"])]
        if t == "date":
            return (date.fromisoformat(spec["start"]) + timedelta(days=rng.randint(0, spec["days"]))).isoformat()
        if t == "const":
            return copy.deepcopy(spec["value"])
        if t == "pick":
            where = render(spec.get("where", {}), {"task": self.task})
            taken = [self.task[name] for name in spec.get("other_than", [])]
            found = [r for r in self.state[spec["entity"]] if all(r.get(k) == v for k, v in where.items())
                     and not any(r is t for t in taken)]
            if not found:
                raise SpecError(f"no {spec['entity']} record matches the pick's where {json.dumps(where)[:200]}"
                                + (f" other than {', '.join(spec['other_than'])}" if taken else ""))
            return rng.choice(found)  # the live record
        if t == "fact":
            return holds(spec["pred"], self, {"task": self.task})
        raise SpecError(f"unknown type {t!r}")

    @property
    def system_prompt(self):
        return self._system_prompt

    def _call(self, name, args):
        """One exposed tool's behaviour; errors are raised, and the contract turns them into text."""
        _check_arguments(name, args, next(t for t in self.tools if t["function"]["name"] == name))
        tool, ctx = self.spec["tools"][name], {"task": self.task, "args": args}
        if tool["kind"] == "const":
            out = render(tool["result"], ctx)
            return "" if out is None else out
        records = self.state[tool["entity"]]
        if tool["kind"] == "list":
            where = render(tool.get("where", {}), ctx)
            rows = [r for r in records if all(r.get(k) == v for k, v in where.items())]
            return [r.get(tool["project"]) for r in rows] if "project" in tool else copy.deepcopy(rows)
        field = tool.get("field") or key_field(self.spec, tool["entity"])
        value = args.get(tool["arg"])
        record = next((r for r in records if r.get(field) == value), None)
        if record is None:
            raise ValueError(f"{tool['entity'].replace('_', ' ').capitalize()} {value} not found")
        if tool["kind"] in ("update", "write"):
            ctx["record"] = record
            if "guard" in tool and not holds(tool["guard"], self, ctx):
                raise ValueError(render(tool.get("error", "this action is not allowed here"), ctx))
            record.update(render(tool.get("set", {}), ctx))
        return copy.deepcopy(record)

    def score(self):
        ctx = {"task": self.task}
        reward = self.spec["reward"]
        return {"components": {c["name"]: float(holds(c["pred"], self, ctx)) for c in reward},
                "weights": {c["name"]: float(c["weight"]) for c in reward}}

    def reference_actions(self):
        ctx, actions = {"task": self.task}, []
        for i, step in enumerate(self.spec["reference"]):
            if "when" in step and not holds(step["when"], self, ctx):
                continue
            if "call" in step:
                actions.append({"tool_calls": [{"id": f"r{i}", "name": step["call"],
                                                "arguments": render(step.get("args", {}), ctx)}]})
            else:
                actions.append({"content": str(render(step["reply"], ctx))})
        return actions


def key_field(spec, entity):
    """The entity's first id field: what refs and lookups match by default."""
    fields = spec["entities"][entity]["fields"]
    return next((f for f, s in fields.items() if isinstance(s, dict) and s.get("type") == "id"), None)


def _ids(pattern, n, rng):
    m = _ID.search(pattern)
    width = int(m.group(1) or 4)
    return [pattern[:m.start()] + str(v).zfill(width) + pattern[m.end():] for v in rng.sample(range(10 ** width), n)]


JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def _check_arguments(name, args, schema):
    """The target's tools reject unknown, missing and mistyped arguments: so do these."""
    params = schema["function"].get("parameters") or {}
    props = params.get("properties") or {}
    unknown = sorted(set(args) - set(props))
    if unknown:
        raise TypeError(f"{name}() got unexpected keyword arguments: {', '.join(unknown)}")
    missing = [a for a in params.get("required", []) if a not in args]
    if missing:
        raise TypeError(f"{name}() missing required arguments: {', '.join(missing)}")
    for arg, value in args.items():
        want = JSON_TYPES.get(props[arg].get("type") if isinstance(props[arg], dict) else None)
        if want and (not isinstance(value, want) or isinstance(value, bool) and want is not bool):
            raise TypeError(f"{name}(): {arg} must be of type {props[arg]['type']}")


# ---------------------------------------------------------------- static checks
def static_findings(spec, tools):
    """What is wrong with the spec without running it: shape, limits, names of tools, entities,
    fields and arguments. An empty list means SpecEnv can run it."""
    return _Checker(spec, tools).run()


class _Checker:
    def __init__(self, spec, tools):
        self.spec, self.findings, self.fixes = spec, [], []  # fixes: mechanical repairs (repair_spec)
        self.current_entity = None
        self.target = {t["function"]["name"]: t for t in tools if isinstance(t, dict) and
                       isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)}

    def bad(self, check, where, detail):
        """Note a finding (the first 40); False, for a check that stops here (`return self.bad(...)`)."""
        if len(self.findings) < 40:
            self.findings.append(finding(check, where, detail))
        return False

    def run(self):
        if not self.limits_ok(self.spec) or not self.keys("spec", self.spec, SPEC_KEYS):
            return self.findings
        s = self.spec
        if not 1 <= s.get("max_steps", 10) <= 50:
            self.bad("schema", "max_steps", "must be in 1..50")
        self.entities, self.task, self.values = {}, {}, 0
        for name, ent in s.get("entities", {}).items():
            self.current_entity = name
            self.entity(f"entities.{name}", name, ent)
        self.current_entity = None
        if self.values > 2000:
            self.bad("limits", "entities", "over 2000 values in all (records x fields): make the state smaller")
        # task facts come before the tools (whose templates read the task) but may name tools
        self.exposed = {n: t for n, t in s["tools"].items() if n in self.target and isinstance(t, dict)}
        for name, var in s.get("task", {}).items():
            if self.field_spec(f"task.{name}", var, TASK_TYPES):
                self.task[name] = var
        self.exposed = {}
        for name, tool in s["tools"].items():
            self.tool(f"tools.{name}", name, tool)
        if not s["tools"]:
            self.bad("schema", "tools", "expose at least one of the target's tools")
        self.expr("system_prompt", s["system_prompt"], {"task"})
        self.expr("user_message", s["user_message"], {"task"})
        self.reference(s["reference"])
        self.reward(s["reward"])
        return self.findings

    def limits_ok(self, spec):
        """Walk the raw JSON without recursion: size, depth, plain JSON values only."""
        stack, nodes, chars = [(spec, 0)], 0, 0
        while stack:
            node, depth = stack.pop()
            nodes, chars = nodes + 1, chars + (len(node) if isinstance(node, str) else 0)
            if depth > MAX_DEPTH or nodes > MAX_NODES or chars > MAX_CHARS:
                return self.bad("limits", "spec", f"nested deeper than {MAX_DEPTH}, or over {MAX_NODES} values or "
                                                  f"{MAX_CHARS} characters in all: simplify it")
            if isinstance(node, dict):
                if not all(isinstance(k, str) for k in node):
                    return self.bad("schema", "spec", "object keys must be strings")
                stack += [(v, depth + 1) for v in node.values()]
            elif isinstance(node, list):
                stack += [(v, depth + 1) for v in node]
            elif isinstance(node, str) and len(node) > MAX_TEXT or isinstance(node, float) and not math.isfinite(node):
                return self.bad("limits", "spec", f"a string over {MAX_TEXT} characters or a non-finite number")
            elif not isinstance(node, (str, int, float, bool, type(None))):
                return self.bad("schema", "spec", f"{type(node).__name__} is not a JSON value")
        return True

    def keys(self, where, obj, shape):
        """obj is an object with shape's required keys, of the right types, and no others."""
        if not isinstance(obj, dict):
            return self.bad("schema", where, f"must be an object, got {_kind(obj)}")
        required, optional = shape
        ok = True
        for key in sorted(set(required) - set(obj)):
            self.bad("schema", f"{where}.{key}", "missing (required)")
            ok = False
        for key, value in obj.items():
            want = required.get(key, optional.get(key))
            if key not in required and key not in optional:
                self.bad("schema", f"{where}.{key}", f"unknown key (allowed: {', '.join([*required, *optional])})")
                ok = False
            elif want is not ANY and not _is(value, want):
                self.bad("schema", f"{where}.{key}", f"must be {_TAGS[want]}, got {_kind(value)}")
                ok = False
        return ok

    def entity(self, where, name, ent):
        if not self.keys(where, ent, ENTITY_KEYS):
            return
        count, fields = ent["count"], ent["fields"]
        valid = all([self.field_spec(f"{where}.fields.{f}", s, FIELD_TYPES) for f, s in fields.items()])
        self.entities[name] = fields  # known from here on even when broken: one finding, not a cascade
        if len(count) != 2 or not all(_is(c, int) for c in count) or not 1 <= count[0] <= count[1] <= MAX_RECORDS:
            self.bad("schema", f"{where}.count", f"must be [lo, hi] with 1 <= lo <= hi <= {MAX_RECORDS}")
        elif len(self.entities) > MAX_ENTITIES or len(fields) > MAX_FIELDS:
            self.bad("limits", where, f"at most {MAX_ENTITIES} entities of {MAX_FIELDS} fields")
        else:
            self.values += count[1] * len(fields)
            ids = [s for s in fields.values() if valid and s["type"] == "id"]
            if ids and count[1] > 10 ** int(_ID.search(ids[0]["pattern"]).group(1) or 4):
                self.bad("schema", where, "more records than the id pattern has ids: widen {n:0Kd}")

    def field_spec(self, where, spec, types):
        if not isinstance(spec, dict) or spec.get("type") not in types:
            return self.bad("schema", f"{where}.type", f"must be one of {', '.join(types)}, got "
                                                       f"{_kind(spec.get('type') if isinstance(spec, dict) else spec)}")
        t, before = spec["type"], len(self.findings)
        required, optional = FIELD_KEYS[t]
        if not self.keys(where, spec, ({**required, "type": str}, optional)):
            return False
        if t == "id" and len(_ID.findall(spec["pattern"])) != 1 or t == "id" and "{" in _ID.sub("", spec["pattern"]):
            self.bad("schema", f"{where}.pattern", "must hold exactly one {n} or {n:0Kd} (K in 1..9), e.g. 'R{n:04d}'")
        elif t == "choice" and not 1 <= len(spec["values"]) <= 200:
            self.bad("schema", f"{where}.values", "must list 1 to 200 values")
        elif t in ("int", "float") and not -1e9 <= spec["min"] <= spec["max"] <= 1e9:
            self.bad("schema", where, "needs min <= max, both within +-1e9")
        elif t == "bool" and not 0 <= spec.get("p", 0.5) <= 1:
            self.bad("schema", f"{where}.p", "must be in [0, 1]")
        elif t == "date" and (not _iso_date(spec["start"]) or not 0 <= spec["days"] <= 3650):
            self.bad("schema", where, "start must be a date 'YYYY-MM-DD' and days in 0..3650")
        elif t in ("ref", "pick") and spec["entity"] not in self.entities:
            self.fixes.append(("add_entity", spec["entity"], self.current_entity))
            self.bad("unknown_entity", f"{where}.entity", f"{spec['entity']!r} is not an entity defined before this "
                                                          f"(defined: {', '.join(self.entities) or 'none'})")
        elif t == "ref" and key_field(self.spec, spec["entity"]) is None:
            self.bad("schema", f"{where}.entity", f"{spec['entity']!r} has no id field to refer to")
        elif t == "pick":
            for f, expr in spec.get("where", {}).items():
                self.field_name(f"{where}.where.{f}", spec["entity"], f)
                self.expr(f"{where}.where.{f}", expr, {"task"})
            picks = [n for n, v in self.task.items() if v.get("type") == "pick" and v.get("entity") == spec["entity"]]
            for i, name in enumerate(spec.get("other_than", [])):
                if name not in picks:
                    self.bad("schema", f"{where}.other_than[{i}]", f"{_kind(name)} is not an earlier pick of "
                             f"{spec['entity']!r} (those: {', '.join(picks) or 'none'})")
        elif t == "fact":
            self.pred(f"{where}.pred", spec["pred"], {"task"})
        return len(self.findings) == before

    def field_name(self, where, entity, field):
        if entity in self.entities and field not in self.entities[entity]:
            self.fixes.append(("add_field", entity, field))
            return self.bad("unknown_field", where, f"{entity!r} has no field {field!r} "
                                                    f"(fields: {', '.join(self.entities[entity])})")
        return True

    def tool(self, where, name, tool):
        if name not in self.target:
            if any(n in self.target for n in self.spec.get("tools", {})):
                self.fixes.append(("drop_tool", name))
            return self.bad("unknown_tool", where, f"{name!r} is not one of the target's tools "
                                                   f"(target's: {', '.join(sorted(self.target))})")
        if not isinstance(tool, dict) or tool.get("kind") not in KINDS:
            return self.bad("schema", f"{where}.kind", f"must be one of {', '.join(KINDS)}")
        required, optional = TOOL_KEYS[tool["kind"]]
        if not self.keys(where, tool, ({**required, "kind": str}, optional)):
            return
        self.exposed[name] = tool
        roots = {"task", "args", "record"} if tool["kind"] in ("update", "write") else {"task", "args"}
        entity = tool.get("entity")
        if entity is not None and entity not in self.entities:
            self.fixes.append(("add_entity", entity, None))
            return self.bad("unknown_entity", f"{where}.entity", f"{entity!r} is not an entity "
                                                                 f"(entities: {', '.join(self.entities) or 'none'})")
        if "arg" in tool:
            self.arg_name(f"{where}.arg", name, tool["arg"])
            if "field" in tool:
                self.field_name(f"{where}.field", entity, tool["field"])
            elif key_field(self.spec, entity) is None:
                self.bad("schema", f"{where}.field", f"{entity!r} has no id field: name the field to look up by")
        for key in ("set", "where"):
            for f, expr in tool.get(key, {}).items():
                self.field_name(f"{where}.{key}.{f}", entity, f)
                self.expr(f"{where}.{key}.{f}", expr, roots, name)
        if "project" in tool:
            self.field_name(f"{where}.project", entity, tool["project"])
        if "guard" in tool:
            self.pred(f"{where}.guard", tool["guard"], roots, name)
        for key in ("error", "result"):
            if key in tool:
                self.expr(f"{where}.{key}", tool[key], roots, name)

    def arg_name(self, where, tool, arg):
        props = (self.target[tool]["function"].get("parameters") or {}).get("properties") or {}
        if arg not in props:
            self.fixes.append(("drop_arg", tool, arg))
            self.bad("unknown_argument", where, f"{tool!r} takes no argument {arg!r} "
                                                f"(its arguments: {', '.join(props) or 'none'})")

    def exposed_tool(self, where, name):
        if name not in self.exposed and isinstance(name, str):
            if name in self.target:  # a target tool the spec forgot to expose
                self.fixes.append(("expose_tool", name))
            else:  # a tool of another domain (copied from the example): this one's tool with the same verb
                same = [t for t in self.target if t.split("_")[0] == name.split("_")[0]]
                if len(same) == 1:
                    self.fixes.append(("rename_tool", name, same[0]))
        if name not in self.exposed:
            return self.bad("unknown_tool", where, f"{name!r} is not an exposed tool (exposed: "
                                                   f"{', '.join(self.exposed)}): add it to tools or name one of those")
        return True

    def expr(self, where, expr, roots, tool=None):
        """Every template slot in expr names a path that exists."""
        for m in (m for x in _nodes(expr) if isinstance(x, str) for m in _SLOT.finditer(x)):
            if _slot_path(m) is not None:
                self.path(where, _slot_path(m), roots, tool)

    def path(self, where, path, roots, tool):
        segs = path.split(".")
        if not _PATH.fullmatch(path) or segs[0] not in roots:
            self.bad("unknown_field", where, f"'{{{path}}}' is not a path from {' / '.join(sorted(roots))} "
                                             "(write '{task.x}' or '{task.x.field}'; '{{' for a literal brace)")
        elif segs[0] == "args" and len(segs) > 1:
            self.arg_name(where, tool, segs[1])
        elif segs[0] == "record" and len(segs) > 1:
            self.field_name(where, self.exposed.get(tool, {}).get("entity"), segs[1])
        elif segs[0] == "task" and (len(segs) < 2 or segs[1] not in self.task):
            name = segs[1] if len(segs) > 1 else ""
            # task.reservation_id: the picked reservation's field `reservation_id` (or `id`)
            picked = next((f"{n}.{f}" for n, v in self.task.items() if name.startswith(n + "_")
                           and v.get("type") == "pick" for f in (name, name[len(n) + 1:])
                           if f in self.entities.get(v.get("entity"), {})), None)
            near = None if not name or name in (self.spec.get("task") or {}) else picked or _nearest(name, self.task)
            if near:  # task.reservation_id -> task.reservation.reservation_id; task.res -> task.reservation
                self.fixes.append(("rename_task", name, near))
            self.bad("unknown_field", where, f"'{{{path}}}': the task has no {segs[1] if len(segs) > 1 else 'name'!r} "
                                             f"here (task so far: {', '.join(self.task) or 'none'})")
        elif segs[0] == "task" and len(segs) > 2:
            var = self.task[segs[1]]
            if var["type"] == "pick":
                self.field_name(where, var["entity"], segs[2])
            elif var["type"] == "choice" and not all(isinstance(v, dict) and segs[2] in v for v in var["values"]):
                self.bad("unknown_field", where,
                         f"'{{{path}}}': not every value of task.{segs[1]} has a field {segs[2]!r}")
            elif var["type"] not in ("choice", "pick", "const"):
                self.bad("unknown_field", where, f"'{{{path}}}': task.{segs[1]} is a {var['type']}, with no fields")

    def pred(self, where, p, roots, tool=None):
        if not isinstance(p, dict) or not isinstance(p.get("op"), str) or p["op"] not in PREDICATES:
            return self.bad("schema", f"{where}.op", f"must be one of {', '.join(PREDICATES)}, got "
                                                     f"{_kind(p.get('op') if isinstance(p, dict) else p)}")
        required, optional = PREDICATES[p["op"]]
        if not self.keys(where, p, ({**required, "op": str}, optional)):
            return
        op = p["op"]
        if op in ("all", "any"):
            for i, q in enumerate(p["of"]):
                self.pred(f"{where}.of[{i}]", q, roots, tool)
        elif op in ("not", "if"):
            for key in ("of", "cond", "then", "else"):
                if key in p:
                    self.pred(f"{where}.{key}", p[key], roots, tool)
        elif op in ("called", "not_called"):
            self.call_pattern(where, p, roots, tool)
        elif op == "called_before":
            for key in ("first", "then"):
                if self.keys(f"{where}.{key}", p[key], CALL_KEYS):
                    self.call_pattern(f"{where}.{key}", p[key], roots, tool)
        elif op == "state_equals":
            self.path(f"{where}.path", _bare(p["path"]), roots, tool)
            self.expr(f"{where}.value", p["value"], roots, tool)
        elif op == "compare" and p["cmp"] not in CMPS:
            self.bad("schema", f"{where}.cmp", f"must be one of {' '.join(CMPS)}")
        else:
            for key in ("text", "left", "right"):
                if key in p:
                    self.expr(f"{where}.{key}", p[key], roots, tool)

    def call_pattern(self, where, p, roots, tool):
        if self.exposed_tool(f"{where}.tool", p["tool"]):
            for arg, expr in p.get("args", {}).items():
                self.arg_name(f"{where}.args.{arg}", p["tool"], arg)
                self.expr(f"{where}.args.{arg}", expr, roots, tool)

    def reference(self, steps):
        if not 1 <= len(steps) <= MAX_STEPS:
            self.bad("schema", "reference", f"must list 1 to {MAX_STEPS} steps")
        for i, step in enumerate(steps[:MAX_STEPS]):
            where = f"reference[{i}]"
            shape = STEP_KEYS[0] if isinstance(step, dict) and "call" in step else STEP_KEYS[1]
            if not self.keys(where, step, shape):
                continue
            if "when" in step:
                self.pred(f"{where}.when", step["when"], {"task"})
            if "reply" in step:
                self.expr(f"{where}.reply", step["reply"], {"task"})
            elif self.exposed_tool(f"{where}.call", step["call"]):
                params = self.target[step["call"]]["function"].get("parameters") or {}
                for arg in [a for a in params.get("required", []) if a not in step.get("args", {})]:
                    self.fixes.append(("fill_arg", i, arg))
                    self.bad("missing_argument", f"{where}.args", f"lacks {arg!r}, required by {step['call']!r}")
                for arg, expr in step.get("args", {}).items():
                    self.arg_name(f"{where}.args.{arg}", step["call"], arg)
                    self.expr(f"{where}.args.{arg}", expr, {"task"})

    def reward(self, components):
        if not 1 <= len(components) <= 20:
            self.bad("schema", "reward", "must list 1 to 20 components")
        names = set()
        for i, c in enumerate(components[:20]):
            where = f"reward[{i}]"
            if not self.keys(where, c, COMPONENT_KEYS):
                continue
            if c["name"] in names:
                self.bad("schema", f"{where}.name", f"{c['name']!r} is used twice")
            names.add(c["name"])
            if not 0 < c["weight"] <= 100:
                self.bad("schema", f"{where}.weight", "must be > 0 (and at most 100)")
            self.pred(f"{where}.pred", c["pred"], {"task"})


_TAGS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
         list: "a list"}


def _is(value, tag):
    if tag is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tag) and (tag is bool or not isinstance(value, bool))


def _kind(value):
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__) + (f" {value!r:.40}" if isinstance(value, (str, int, float)) else "")


def _iso_date(text):
    try:
        date.fromisoformat(text)
        return len(text) == 10
    except ValueError:
        return False


# ---------------------------------------------------------------- repairs (code does what a small model fumbles)
_INDEX = re.compile(r"\[(\d+)\]")
NUMERIC_WORDS = ("amount", "price", "total", "balance", "count", "cost", "fee", "refund", "number", "quantity",
                 "nights", "baggages", "bags", "limit", "age", "passengers", "gb", "minutes", "days", "points")


def _nearest(name, names):
    """The one known name that `name` abbreviates or misspells (res -> reservation), else None."""
    import difflib

    starts = [n for n in names if n.startswith(name)]
    if len(starts) == 1:
        return starts[0]
    close = difflib.get_close_matches(name, list(names), n=2, cutoff=0.75)
    return close[0] if len(close) == 1 else None


def _strings(x, fn):
    """x with fn applied to every string in it."""
    if isinstance(x, dict):
        return {k: _strings(v, fn) for k, v in x.items()}
    if isinstance(x, list):
        return [_strings(v, fn) for v in x]
    return fn(x) if isinstance(x, str) else x


def _index_paths(x, key=None):
    """`a[0].b` -> `a.0.b` inside template slots and path fields only (text keeps its brackets)."""
    if isinstance(x, dict):
        return {k: _index_paths(v, k) for k, v in x.items()}
    if isinstance(x, list):
        return [_index_paths(v) for v in x]
    if not isinstance(x, str):
        return x
    if key == "path":
        return _INDEX.sub(r".\1", x)
    return re.sub(r"\{[^{}]*\}", lambda m: _INDEX.sub(r".\1", m.group(0)), x)


def _values_used(spec, field):
    """Literal values the spec itself gives `field` (in set / where / compare), for a choice field."""
    out = []
    for x in _dicts(spec):
        if len(out) >= 8:
            break
        v = x.get(field)
        if isinstance(v, (str, int, float, bool)) and not (isinstance(v, str) and ("{" in v or v.strip(". ") == "")) \
                and v not in out:
            out.append(v)
        side, value = (x.get("left"), x.get("right")) if x.get("op") == "compare" else \
            (x.get("path"), x.get("value")) if x.get("op") == "state_equals" else (None, None)
        if isinstance(side, str) and side.rstrip("} ").endswith("." + field) and \
                isinstance(value, (str, int)) and value not in out:
            out.append(value)
    return out


def guess_field(field, spec):
    """A field spec for a field the spec uses but never declared, from its name and the values the
    spec itself gives it."""
    low = field.lower()
    if low == "id" or low.endswith("_id"):
        return {"type": "id", "pattern": (low[:1] or "x").upper() + "{n:04d}"}
    if "date" in low or low.endswith("_at"):
        return {"type": "date", "start": "2024-05-01", "days": 60}
    if low.startswith(("is_", "has_", "can_")):
        return {"type": "bool", "p": 0.5}
    if any(w in low for w in NUMERIC_WORDS):
        return {"type": "int", "min": 0, "max": 500}
    values = _values_used(spec, field)
    if values and all(isinstance(v, bool) for v in values):
        return {"type": "bool", "p": 0.5}
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return {"type": "int", "min": 0, "max": max(10, int(max(values)) * 2)}
    values = [str(v) for v in values][:6]
    return {"type": "choice", "values": values + [f"other_{field}"] if values else [f"{field}_{i}" for i in (1, 2, 3)]}


def _refers(ents, a, b, seen=()):
    """Whether entity `a`'s fields refer to `b`, directly or through other entities."""
    seen += (a,)
    fields = ents[a].get("fields") if isinstance(ents.get(a), dict) else None
    targets = {f.get("entity") for f in (fields if isinstance(fields, dict) else {}).values()
               if isinstance(f, dict) and f.get("type") in ("ref", "pick")}
    return b in targets or any(_refers(ents, x, b, seen) for x in targets if isinstance(x, str) and x not in seen)


def _apply(spec, fix, notes, suggestions):
    kind = fix[0]
    ents = spec.setdefault("entities", {})
    if kind == "add_field":
        _, entity, field = fix
        fields = (ents.get(entity) or {}).get("fields")
        if not isinstance(fields, dict) or field in fields or len(fields) >= MAX_FIELDS:
            return False
        fields[field] = guess_field(field, spec)
        notes.append(f"entities.{entity}.fields.{field}: declared by code as {json.dumps(fields[field])}")
        return True
    if kind == "add_entity":
        _, entity, before = fix
        if isinstance(entity, str) and entity in ents and before in ents:  # declared, but after what refers to it
            names = list(ents)
            if names.index(entity) < names.index(before) or _refers(ents, entity, before):
                return False  # a cycle: the builder's decision
            names.remove(entity)
            names.insert(names.index(before), entity)
            spec["entities"] = {k: ents[k] for k in names}
            notes.append(f"entities.{entity}: moved by code before {before}, which refers to it")
            return True
        if entity in ents or not isinstance(entity, str) or not _PATH.fullmatch(entity) or len(ents) >= MAX_ENTITIES:
            return False
        new = {"count": [3, 6], "fields": {f"{entity}_id": guess_field(f"{entity}_id", spec)}}
        order = list(ents.items())
        at = next((i for i, (k, _) in enumerate(order) if k == before), len(order))
        spec["entities"] = dict(order[:at] + [(entity, new)] + order[at:])
        notes.append(f"entities.{entity}: declared by code (an id field only) for what refers to it")
        return True
    if kind == "rename_task":
        _, old, new = fix
        pat = re.compile(r"\btask\." + re.escape(old) + r"\b")
        before = json.dumps(spec)
        for k in list(spec):  # every string, the task's own values too, but not its names (_strings keeps keys)
            spec[k] = _strings(spec[k], lambda x: pat.sub("task." + new, x))
        if json.dumps(spec) == before:
            return False
        notes.append(f"task.{old} -> task.{new}: renamed by code (no task value {old!r}; {new!r} is)")
        return True
    if kind == "expose_tool" and fix[1] in suggestions and isinstance(spec.get("tools"), dict):
        spec["tools"][fix[1]] = copy.deepcopy(suggestions[fix[1]])
        notes.append(f"tools.{fix[1]}: exposed by code with its suggested behaviour (the spec calls it)")
        return True
    if kind == "rename_tool":
        _, old, new = fix
        calls = [x for x in _dicts(spec) if x.get("tool") == old or x.get("call") == old]
        for x in calls:
            x["tool" if x.get("tool") == old else "call"] = new
        if calls:
            notes.append(f"{old} -> {new}: renamed by code ({old!r} is not a tool of this target)")
        return bool(calls)
    if kind == "drop_tool" and isinstance(spec.get("tools"), dict) and fix[1] in spec["tools"]:
        del spec["tools"][fix[1]]
        notes.append(f"tools.{fix[1]}: dropped by code (not a tool of this target)")
        return True
    if kind == "drop_arg":
        _, tool, arg = fix
        calls = [x for x in _dicts(spec) if (x.get("call") == tool or x.get("tool") == tool)
                 and isinstance(x.get("args"), dict) and arg in x["args"]]
        for x in calls:
            del x["args"][arg]
        if calls:
            notes.append(f"{tool}(..., {arg}=...): dropped by code ({tool!r} takes no argument {arg!r})")
        return bool(calls)
    if kind == "fill_arg":
        _, i, arg = fix
        step = (spec.get("reference") or [None] * (i + 1))[i]
        source = _task_source(spec, arg)
        if not isinstance(step, dict) or source is None:
            return False
        step.setdefault("args", {})[arg] = source
        notes.append(f"reference[{i}].args.{arg}: filled by code with {source!r}")
        return True
    return False


EXPOSED_TOOLS = 5  # an env trains with a few of the target's tools (the verifier allows 1 to 8)


def _trim_tools(spec, notes):
    """Exposing every tool of the target makes an env the verifier refuses: keep the
    tools the reference, reward, task and guards use, and others up to EXPOSED_TOOLS (distractors)."""
    exposed = spec.get("tools")
    if not isinstance(exposed, dict) or len(exposed) <= EXPOSED_TOOLS:
        return
    used = {x.get(key) for part in ("reference", "reward", "task", "tools") for x in _dicts(spec.get(part))
            for key in ("call", "tool")}  # a reference step's `when` names tools too
    keep = [n for n in exposed if n in used]
    keep += [n for n in exposed if n not in used][:max(0, EXPOSED_TOOLS - len(keep))]
    if len(keep) < len(exposed):
        notes.append(f"tools: {len(exposed)} exposed, kept {len(keep)} ({', '.join(keep)}): those the spec uses "
                     f"and others up to {EXPOSED_TOOLS}")
        spec["tools"] = {n: v for n, v in exposed.items() if n in keep}


def _nodes(x):
    """Every value inside x, x itself first (depth first, last child first)."""
    stack = [x]
    while stack:
        y = stack.pop()
        yield y
        if isinstance(y, (dict, list)):
            stack += list(y.values() if isinstance(y, dict) else y)


def _dicts(x):
    """Every object inside x."""
    return (y for y in _nodes(x) if isinstance(y, dict))


def _task_source(spec, arg):
    """A task path that holds `arg`: a task value of that name, or that field of a picked record."""
    task = spec.get("task") if isinstance(spec.get("task"), dict) else {}
    if arg in task:
        return "{task.%s}" % arg
    ents = spec.get("entities") if isinstance(spec.get("entities"), dict) else {}
    for name, var in task.items():
        if isinstance(var, dict) and var.get("type") == "pick" and arg in ((ents.get(var.get("entity")) or {})
                                                                          .get("fields") or {}):
            return "{task.%s.%s}" % (name, arg)
    return None


def repair_spec(spec, tools, rounds=6, suggestions=None):
    """(repaired copy, notes): what a small builder gets wrong mechanically, fixed by code and said:
    index syntax `a[0].b`, fields used but never declared (typed from their name and the values the
    spec gives them), entities referred to but never declared or declared after what refers to them
    (a reference cycle stays a finding), a task value named by an
    abbreviation, a target tool used but not exposed (`suggestions`: {tool: behaviour}, code's
    guesses made on the host), another domain's tool where this one has one with the same verb, a
    reference call's missing argument that a task value or picked record holds. Everything else
    stays a finding for the builder."""
    notes = []
    if not isinstance(spec, dict):
        return spec, notes
    try:
        fixed = _index_paths(copy.deepcopy(spec))
        if fixed != spec:
            notes.append("paths written a[0].b now read a.0.b")
        for _ in range(rounds):
            checker = _Checker(fixed, tools)
            checker.run()
            if not [_apply(fixed, f, notes, suggestions or {}) for f in dict.fromkeys(checker.fixes)].count(True):
                break
        _trim_tools(fixed, notes)
        return fixed, notes
    except Exception as err:  # a bug of ours: the spec as it was, and say so
        return spec, [f"repairs skipped: {type(err).__name__}: {str(err)[:200]}"]


# ---------------------------------------------------------------- checks that run the spec
def check_spec(spec, tools, seeds=range(5)):
    """Findings for the builder's next round (empty: the spec is sound). First the static checks
    (shape, limits, names of tools, entities, fields, arguments); then on each seed the reference
    must succeed, the verifier's do-nothing and refusal replies must neither succeed nor average
    over 0.2, a seed must replay exactly, and the task must vary. Never raises, whatever the spec."""
    try:
        return static_findings(spec, tools) or _run_findings(spec, tools, list(seeds)[:100])
    except Exception as err:  # a bug of ours is a finding too: the builder loop must go on
        return [finding("internal", "spec", f"{type(err).__name__}: {str(err)[:300]}")]


def _episode(env, seed, actions):
    """Replay actions from reset(seed), like the verifier's scripted policies; -> (reward, errors, trace)."""
    first = env.reset(seed)["messages"][0]["content"]
    plan = actions(env) if callable(actions) else actions
    errors, trace = [], [first, json.dumps([env.state, env.task], sort_keys=True, default=str)]
    for action in plan:
        if env.done:
            break
        out = env.step(action)
        trace.append(json.dumps([action, out], sort_keys=True))
        errors += [f"{c['name']}: {m['content'][:160]}" for c, m in zip(action.get("tool_calls") or [], out["messages"])
                   if m["content"].startswith("Error:")]
    while not env.done:
        env.step({"content": "Done."})
    return env.reward(), errors, trace


def _run_findings(spec, tools, seeds):
    out, env = [], SpecEnv(spec, tools)
    failing, trivial, firsts = [], {k: [] for k in TRIVIAL_REPLIES}, set()
    for seed in seeds:
        try:
            env.reset(seed)
            if not env.solve():
                out.append(finding("reference_fails", "reference", f"seed {seed}: no step applies (every 'when' is "
                                                                   "false): add a step for this case"))
                continue
            r, errors, trace = _episode(env, seed, lambda e: e.solve())
            firsts.add(trace[0] + env.system_prompt)  # the task may sit in the system prompt (tau2 solo)
            if not r["success"]:
                failing.append((seed, r, errors))
            if _episode(env, seed, lambda e: e.solve())[2] != trace:
                out.append(finding("determinism", "spec", f"seed {seed} does not replay the same episode"))
            for name, reply in TRIVIAL_REPLIES.items():
                trivial[name].append((seed, _episode(env, seed, [{"content": reply}])[0]))
        except Exception as err:  # SpecError (a path with nothing there), OverflowError (a date past 9999) ...
            out.append(finding("runtime", "spec", f"seed {seed}: {type(err).__name__}: {str(err)[:300]}"))
            if len(out) >= 5:
                break
    if failing:
        seed, r, errors = failing[0]
        off = [k for k, v in r["components"].items() if v < 1]
        out.append(finding("reference_fails", "reference", f"the reference solution fails on seeds "
                           f"{[s for s, _, _ in failing]}; on seed {seed} reward {r['reward']:.2f}, components "
                           f"{off} do not hold" + (f", tool errors: {'; '.join(errors)[:400]}" if errors else "")
                           + ". Fix the reference steps (args, when) or those predicates."))
    for name, results in trivial.items():
        wins = [seed for seed, r in results if r["success"]]
        mean = sum(r["reward"] for _, r in results) / max(1, len(results))
        if wins or mean > 0.2:  # the verifier fails a mean over 0.2 for these replies
            out.append(finding(name, "reward", f"replying only {TRIVIAL_REPLIES[name]!r} scores {mean:.2f} on "
                               f"average (max 0.2)" + (f" and succeeds on seeds {wins}" if wins else "")
                               + ": make every component need the capability's actions"))
    if len(seeds) >= 4 and len(firsts) < len(seeds) / 2:
        out.append(finding("variety", "user_message", f"only {len(firsts)} distinct tasks over {len(seeds)} seeds: "
                                                      "put sampled values ({task.x}) in the user message"))
    return out
