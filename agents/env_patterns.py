"""Pattern mode: the builder model picks an environment shape and binds it to the target's tools;
code writes the whole spec.

A spec asks a small model for data, tools, task text, reference and reward at once (the embedded
models verified no spec-mode env in real runs: docs/observations.md). Here it makes only the
decisions it can: which pattern (each
trains a family of capabilities), which of the target's tools play which part, which argument
matters, and a few words of what the user asks. Code derives the rest from the chosen tools' own
JSON schemas (records, value pools, the task's text, the reference solution, the reward), and
`expand` returns a spec that EnvSpec validates and sandbox/image/spec_env.py runs, checks and
verifies like any other.

The answer's model is built per target (`choice_model`: tool and argument names are enums of the
target's own), and the grammar it is decoded under (`decode_schema`) offers only the bindings of
tools and arguments that code can expand. What neither can say (a pattern from another capability
family, a binding made outside the grammar) is a PatternError naming the field and what to choose
instead; it goes back to the model like a validation error.
The model's answer is hostile data: its words are stripped of template braces and cut short.
"""
from __future__ import annotations

import itertools
import json
import re
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel, create_model

from trace_rl.agents.env_spec import READ_VERBS, EnvSpec, suggest_behaviour
from trace_rl.core.records import Capability
from trace_rl.models.chat import extract_json


class PatternError(ValueError):
    """A choice that does not fit the target's tools: `field` is the answer's field to change."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field}: {detail}")
        self.field = field


class _Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")


# when to use each pattern: one sentence each, for the builder's prompt (the grammar holds the fields)
PATTERNS = {
    "lookup_then_act": "the user gives a key; the agent must look the record up with read_tool, then call "
                       "write_tool with a value only that record holds (revealed_argument). For capabilities "
                       "about gathering information before acting.",
    "guarded_action": "write_tool is allowed only when the looked-up record's condition_field is one of "
                      "allowed_values; on about half the tasks it is not and the agent must not call it. For "
                      "precondition, policy and eligibility checks.",
    "exact_arguments": "the user states every argument of write_tool in words; the agent must call it once "
                       "with exactly those values. For tool-call and argument precision.",
    "multi_write": "one request needs every one of write_tools called on the same record. For completing "
                   "multi-step transactions without stopping half way.",
    "compute_then_act": "the user gives a count and a price per item; the agent must call write_tool with "
                        "the product as amount_argument. For numerical reasoning before acting.",
}
# words a capability of each pattern's family is described with (compared by _stems); a
# capability that names another family's words and none of its chosen pattern's is a misfit
FAMILIES = {
    "lookup_then_act": "gather information look lookup find retrieve fetch identify read context before",
    "guarded_action": "precondition policy policies eligibility eligible verify verification check rule allowed "
                      "permission confirm refuse",
    "exact_arguments": "precision precise argument schema exact parameter format malformed",
    "multi_write": "multi step transaction complete completion every sequence through half",
    "compute_then_act": "numerical amount price total fee refund balance payment calculate compute math",
}


def _stems(text: str) -> set[str]:
    """Each word's first six letters: "precondition(s)" and "eligibility" match, "policies" and
    "policy" do not (the families list both forms where it matters). Strict on purpose: a looser
    match let a lookup pattern pass for tool-call precision ("looked-up records")."""
    return {w[:6] for w in re.findall(r"[a-z]+", text.lower().replace("_", " ")) if len(w) > 2}


def misfit(capability: Capability, pattern: str, patterns: list[str] | None = None) -> str | None:
    """Why `pattern` does not train this capability, by the words it is described with, or None: such an
    env verifies but trains something else. Only a clear misfit is one (no word of its family, some of
    another offered pattern's: `patterns`, default all)."""
    words = _stems(f"{capability.name} {capability.description}")
    shared = {p: len(words & _stems(family)) for p, family in FAMILIES.items() if patterns is None or p in patterns}
    if shared.get(pattern) or not any(shared.values()):
        return None
    best = sorted((p for p in shared if shared[p]), key=lambda p: -shared[p])
    return (f"{pattern} does not train {capability.name or 'this capability'}: its description reads like "
            f"{' or '.join(best[:2])} ({PATTERNS[best[0]].split('. For ')[-1].rstrip('.')})")


# plain words only: no formula or call as the user's request
Request = Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9 ,.'-]+$", description="what the user asks for, "
                                                                                       "in a few words, e.g. 'suspend my line'")]
Word = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.-]{0,29}$")]
FieldName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,29}$", description="a record field, e.g. 'status'")]


# ---------------------------------------------------------------- the target's tools, as code sees them
def _fn(tools: list[dict]) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"] for t in tools}


def _params(fn: dict) -> tuple[dict, list[str], dict]:
    """(properties, required argument names, $defs) of a tool's JSON schema."""
    p = fn.get("parameters") or {}
    return p.get("properties") or {}, list(p.get("required") or []), p.get("$defs") or {}


def read_tools(tools: list[dict]) -> list[str]:
    """Tools that fetch one record by one argument (get_order_details(order_id)): the lookups."""
    return _reads(_fn(tools))


def _reads(fns: dict) -> list[str]:
    return [n for n, fn in fns.items() if suggest_behaviour(fn)[0]["kind"] == "read"
            and len(_params(fn)[1] or _params(fn)[0]) == 1]


def write_tools(tools: list[dict]) -> list[str]:
    """Tools that do something (no read verb) and take arguments: what an agent acts with."""
    return _writes(_fn(tools))


def _writes(fns: dict) -> list[str]:
    return [n for n, fn in fns.items() if n.split("_")[0] not in READ_VERBS and _params(fn)[0]]


def _type(prop: dict, defs: dict) -> dict | None:
    """The argument's schema with $ref and anyOf resolved to the first option that is not null."""
    for _ in range(5):
        if "$ref" in prop:
            prop = defs.get(prop["$ref"].split("/")[-1]) or {}
        elif "anyOf" in prop or "oneOf" in prop:
            options = [o for o in prop.get("anyOf") or prop.get("oneOf") if o.get("type") != "null"]
            prop = options[0] if options else {}
        else:
            return prop
    return None


def _words(name: str) -> str:
    return name.replace("_", " ")


def _id_pattern(arg: str) -> str:
    """An id pattern for a record field an argument names (a spec_env `id` field: unique per record)."""
    if "phone" in arg:
        return "555-{n:04d}"
    if "email" in arg:
        return "user{n:04d}@example.com"
    initials = "".join(w[:1] for w in arg.removesuffix("_id").split("_")).upper() or "X"
    return initials + "{n:04d}" if arg == "id" or arg.endswith("_id") else arg + "_{n:04d}"


def value_pool(arg: str, fn: dict, unique: bool = False) -> dict | None:
    """A spec_env field (value pool) for argument `arg` of tool `fn`, from its JSON schema: its enum,
    small numbers, dates, made-up codes for strings (an id field, one per record, when `unique`),
    lists of those for arrays. None where code cannot make values up (objects, untyped)."""
    props, _, defs = _params(fn)
    prop = _type(props.get(arg) or {}, defs)
    if not prop:
        return None
    if isinstance(prop.get("enum"), list):
        values = [v for v in prop["enum"] if isinstance(v, (str, int, float, bool))][:20]
        return {"type": "choice", "values": values} if values else None
    t = prop.get("type")
    if t == "boolean":
        return {"type": "bool", "p": 0.5}
    if t in ("integer", "number"):
        return {"type": "int", "min": 1, "max": 9}
    if t == "string" and "date" in arg:
        return {"type": "date", "start": "2024-05-01", "days": 60}
    if t == "string":
        pattern = _id_pattern(arg)
        return {"type": "id", "pattern": pattern} if unique else \
            {"type": "choice", "values": [pattern.replace("{n:04d}", str(n)) for n in (1042, 2387, 3719, 4560, 5823)]}
    if t == "array":
        item = value_pool(arg, {"parameters": {"properties": {arg: prop.get("items") or {}}, "$defs": defs}})
        samples = item["values"] if item and item["type"] == "choice" else [1, 2, 3, 4] if item and \
            item["type"] == "int" else []
        if len(samples) >= 2:
            s = (samples * 2)[:4]
            return {"type": "choice", "values": [[s[0]], [s[1]], [s[0], s[2]], [s[1], s[3]]]}
    return None


def _numeric(fn: dict, arg: str) -> bool:
    props, _, defs = _params(fn)
    return (_type(props.get(arg) or {}, defs) or {}).get("type") in ("integer", "number")


# ---------------------------------------------------------------- the answer's schema, per target
def choice_model(tools: list[dict]) -> type[RootModel]:
    """The model of a builder's answer on this target: one pattern per object, on `pattern`. Only the
    patterns the target's tools can fill are offered; tool and argument names are enums of its own."""
    reads, writes = read_tools(tools), write_tools(tools)
    if not writes:
        raise PatternError("tools", "the target has no tool that acts (every tool reads or takes no argument): "
                                    "use builder_mode spec or code")
    fns = _fn(tools)
    Read, Write = (Literal[tuple(reads)] if reads else None), Literal[tuple(writes)]
    args = sorted({a for n in writes for a in _params(fns[n])[0]})
    numeric = sorted({a for n in writes for a in _params(fns[n])[0] if _numeric(fns[n], a)  # an amount, not an id
                      and a != "id" and not a.endswith("_id")})

    def model(name: str, **fields):
        return create_model("".join(w.title() for w in name.split("_")), __base__=_Choice, __doc__=PATTERNS[name],
                            pattern=(Literal[name], ...), **fields, request=(Request, ...))
    models = []
    if reads:
        models.append(model("lookup_then_act", read_tool=(Read, ...), write_tool=(Write, ...), revealed_argument=(
            Literal[tuple(args)], Field(description="the argument of write_tool whose value only the record holds"))))
        models.append(model("guarded_action", read_tool=(Read, ...), write_tool=(Write, ...),
                            condition_field=(FieldName, ...),
                            allowed_values=(list[Word], Field(min_length=1, max_length=3)),
                            blocked_values=(list[Word], Field(min_length=1, max_length=3))))
    models.append(model("exact_arguments", write_tool=(Write, ...)))
    if len(writes) >= 2:
        models.append(model("multi_write", write_tools=(list[Write], Field(min_length=2, max_length=3))))
    if numeric:
        models.append(model("compute_then_act", write_tool=(Write, ...), amount_argument=(
            Literal[tuple(numeric)], Field(description="the write tool's number argument that gets the total")),
            unit=(Word, Field(description="what the user buys, counted, e.g. 'data pack'"))))
    union = Annotated[Union[tuple(models)], Field(discriminator="pattern")] if len(models) > 1 else models[0]
    return create_model("PatternChoice", __base__=RootModel[union])


def pattern_models(model: type[RootModel]) -> tuple[type[BaseModel], ...]:
    """The pattern models of a `choice_model` (one, or the union's members)."""
    ann = model.model_fields["root"].annotation
    return typing.get_args(ann) or (ann,)


# what a guarded_action's condition may be on (the env makes the field up): a field like these, never a key
CONDITION_FIELDS = ("status", "plan", "tier", "state", "level", "category", "membership", "region")
# a stand-in for each free field, to try a binding of the tools before the model is offered it
_SAMPLE = {"request": "do it", "condition_field": "status", "allowed_values": ["open"], "blocked_values": ["closed"],
           "unit": "item"}
BOUND = ("read_tool", "write_tool", "amount_argument", "revealed_argument")  # in the order they are decided


def decode_schema(tools: list[dict]) -> dict:
    """The schema the builder decodes under (llama.cpp's or xgrammar's grammar): `choice_model`'s, with
    each pattern split into one alternative per pair of tools that expands, each naming only the
    arguments that fit it: the grammar cannot write a binding code would refuse (a refusal alone does not
    stop a small model sending it again)."""
    model = choice_model(tools)
    alternatives = []
    for pattern in pattern_models(model):
        sub = pattern.model_json_schema()
        props = sub["properties"]
        bound = [f for f in BOUND if f in props]
        if not bound:
            alternatives.append(sub)
            continue
        last, pairs = bound[-1], {}
        for values in itertools.product(*(props[f].get("enum") or [props[f]["const"]] for f in bound)):
            choice = {"pattern": props["pattern"]["const"], **_SAMPLE, **dict(zip(bound, values))}
            choice = {k: v for k, v in choice.items() if k in props}
            try:
                expand(model.model_validate(choice).root, tools)
            except (ValueError, KeyError, TypeError):  # a binding code refuses (or a tool schema it cannot read)
                continue
            pairs.setdefault(values[:-1], []).append(values[-1])
        for head, tails in pairs.items():  # one alternative per binding of all but the last bound field
            fixed = {f: {"const": v, "type": "string"} for f, v in zip(bound, head)}
            alternatives.append({**sub, "properties": {**props, **fixed, last: {**props[last], "enum": tails}}})
    if not alternatives:
        raise PatternError("tools", "no pattern can be bound to this target's tools: use builder_mode spec or code")
    fns = _fn(tools)
    for alt in alternatives:  # the guard's field is made up for the env: any name but the lookup's key
        props = alt["properties"]
        if "condition_field" in props:
            key = _lookup(fns, props["read_tool"]["const"])[1]
            props["condition_field"] = {**props["condition_field"], "enum": [f for f in CONDITION_FIELDS if f != key]}
            props["condition_field"].pop("pattern", None)
    return {"title": "PatternChoice", "anyOf": _merged(alternatives)}


def _merged(alternatives: list[dict]) -> list[dict]:
    """Alternatives that differ only in their first bound tool, as one with that tool an enum: the same
    bindings, fewer alternatives (BFCL's 128 tools made 1,189 of them, a 1 MB schema that xgrammar took
    25 s to compile on a 320-token vocabulary; most reads pair with a write the same way)."""
    groups: dict[str, tuple[dict, str | None, list]] = {}
    for alt in alternatives:
        props = alt["properties"]
        first = next((f for f in BOUND if "const" in (props.get(f) or {})), None)
        rest = {k: v for k, v in props.items() if k != first}
        key = json.dumps([alt.get("title"), rest], sort_keys=True)
        groups.setdefault(key, (alt, first, []))[2].append(props[first]["const"] if first else None)
    out = []
    for alt, first, values in groups.values():
        if first and len(values) > 1:
            alt = {**alt, "properties": {**alt["properties"], first: {"enum": values, "type": "string"}}}
        out.append(alt)
    return out


def offered(schema: dict) -> list[str]:
    """The patterns a `decode_schema` offers, in order."""
    return list(dict.fromkeys(a["properties"]["pattern"]["const"] for a in schema["anyOf"]))


def fitting(capability: Capability, schema: dict) -> dict:
    """`schema` offering only the patterns that can train this capability (no `misfit`), or all of them
    when none is a clear fit: what code can decide, the grammar decides (told the misfit, a small model
    chooses it again)."""
    names = offered(schema)
    keep = [p for p in names if not misfit(capability, p, names)]
    return {**schema, "anyOf": [a for a in schema["anyOf"] if a["properties"]["pattern"]["const"] in keep]}


def parse_choice(answer: str | dict, tools: list[dict]) -> BaseModel:
    """The builder's answer (its text, or the parsed JSON) as a validated choice; ValueError otherwise."""
    return choice_model(tools).model_validate(extract_json(answer) if isinstance(answer, str) else answer).root


def pattern_menu(tools: list[dict], patterns: list[str] | None = None) -> str:
    """The patterns this target offers (or those of `patterns`), one line each with when to use it and its fields."""
    lines = []
    for sub in pattern_models(choice_model(tools)):
        name = sub.model_fields["pattern"].annotation.__args__[0]
        fields = ", ".join(f for f in sub.model_fields if f != "pattern")
        if patterns is None or name in patterns:
            lines.append(f"- {name}: {sub.__doc__}\n  fields: {fields}")
    return "\n".join(lines)


# ---------------------------------------------------------------- expansion into a spec
def _text(s: str, limit: int = 100) -> str:
    """Model-written words for a template: no braces (no slot can be smuggled in), one line, short."""
    return " ".join(re.sub(r"[{}]", "", str(s)).split())[:limit].rstrip(" .")


# difficulty: 1 is each pattern as first written; a level above makes the same capability harder to
# exercise (calibration found the env too easy), decided here, never by the model
LEVELS = (1, 2, 3)
HARDER = {  # what each level above 1 changes, per pattern: said to the builder and in docs/builder-modes.md
    "lookup_then_act": {2: "more records, and the user also names the value another record holds for the argument "
                           "only the lookup tells (a stale one)",
                        3: "as 2, and the user's key is said beside that other record's key, near-identical "
                           "('not X, it is Y')"},
    "guarded_action": {2: "blocked values that differ from an allowed one only slightly ('Active pending', "
                          "'formerly Active')",
                       3: "four such near-misses of each allowed value, and the user claims the record is allowed"},
    "exact_arguments": {2: "one more optional argument to state, and one value said beside a decoy ('not X, it is Y')",
                        3: "two more optional arguments, and every value, the record's key too, said beside a decoy"},
    "multi_write": {2: "the request is for two records: every write on each", 3: "three records"},
    "compute_then_act": {2: "a discount off the total (count x price - discount)",
                         3: "two items at different prices, less a discount"},
}
COUNTS = {1: [3, 6], 2: [6, 10], 3: [10, 16]}  # records per level
NEAR = "10{n:02d}"  # level 3's id slot: keys like C1042 and C1024, near-identical, where level 1 draws C4821, C0937


def _values(pool: dict) -> list | None:
    """The values a value pool draws from, for a decoy beside each: None where there are too many."""
    t = pool["type"]
    if t == "choice":
        return pool["values"]
    if t == "int":
        return list(range(pool["min"], pool["max"] + 1)) if pool["max"] - pool["min"] < 50 else None
    if t == "bool":
        return [True, False]
    if t == "date":
        return ["2024-05-03", "2024-05-12", "2024-05-21", "2024-06-02", "2024-06-11", "2024-06-20"]
    return None


def _decoyed(pool: dict) -> dict | None:
    """A choice of (decoy, value) pairs from the pool's values, each value beside each other one, or None
    where the pool has fewer than two values."""
    vals = _values(pool) or []
    pairs = [{"wrong": vals[(i + k) % len(vals)], "right": v} for k in range(1, len(vals)) for i, v in enumerate(vals)
             if vals[(i + k) % len(vals)] != v]
    return {"type": "choice", "values": pairs[:200]} if pairs else None


class _Draft:
    """A spec being written for one target: one entity (the records), the picked record, the
    values the user states (one task value per argument name, said once), at a difficulty level:
    more records (COUNTS), near-identical keys at 3, and `decoys` stated values said beside a wrong one."""

    def __init__(self, fns: dict, entity: str, key: str, fields: dict | None = None, say_key: bool = True,
                 level: int = 1, decoy_key: bool = False):
        self.fns, self.entity, self.key, self.level = fns, entity, key, level
        self.fields = {key: {"type": "id", "pattern": _id_pattern(key)}, **(fields or {})}
        self.task: dict[str, Any] = {"record": {"type": "pick", "entity": entity}}
        self.stated: dict[str, str] = {}  # argument -> the template of its value
        self.decoys = 0
        if say_key and decoy_key:
            self.said = [f"My {_words(key)} is not {{task.{self.other()}.{key}}}, it is {{task.record.{key}}}."]
        else:
            self.said = [f"My {_words(key)} is {{task.record.{key}}}."] if say_key else []

    def other(self) -> str:
        """The task name of a second record, never the task's own: a decoy the agent must not act on."""
        self.task.setdefault("other", {"type": "pick", "entity": self.entity, "other_than": ["record"]})
        return "other"

    def args(self, where: str, tool: str, bound: dict, extra: int = 0) -> dict:
        """Arguments for a call of `tool`: `bound` ones (that the tool takes), then each required one
        as a value the user states; `extra` optional ones too where the tool has them."""
        props, required, _ = _params(self.fns[tool])
        out = {a: v for a, v in bound.items() if a in props}
        optional = [a for a in props if a not in required and a not in out and value_pool(a, self.fns[tool])]
        for arg in [a for a in required if a not in out] + optional[:extra]:
            pool = value_pool(arg, self.fns[tool])
            if pool is None:
                kind = (_type(props.get(arg) or {}, _params(self.fns[tool])[2]) or {}).get("type", "untyped")
                raise PatternError(where, f"{tool}'s argument {arg!r} ({kind}) is not one code can make values "
                                          "for: choose another tool")
            if arg not in self.stated:
                name = f"stated_{arg}"
                if self.decoys > 0 and (pairs := _decoyed(pool)):
                    self.decoys -= 1
                    self.task[name] = pairs
                    self.said.append(f"My {_words(arg)} is not {{task.{name}.wrong}}, it is {{task.{name}.right}}.")
                    self.stated[arg] = f"{{task.{name}.right}}"
                else:
                    self.task[name] = pool
                    self.said.append(f"My {_words(arg)} is {{task.{name}}}.")
                    self.stated[arg] = f"{{task.{name}}}"
            out[arg] = self.stated[arg]
        return out

    def spec(self, name: str, tools: dict, request: str, system: str, reference: list, reward: list,
             said_first: str = "", max_steps: int | None = None) -> dict:
        request = _text(request)
        if not request:
            raise PatternError("request", "write what the user asks for in a few words, e.g. 'suspend my line'")
        message = " ".join([request[:1].upper() + request[1:] + ".", *([said_first] if said_first else []), *self.said])
        fields = {f: {**v, "pattern": v["pattern"].replace("{n:04d}", NEAR)} if self.level >= 3 and v["type"] == "id"
                  else v for f, v in self.fields.items()}
        return {"name": name, "entities": {self.entity: {"count": COUNTS[self.level], "fields": fields}},
                "task": self.task, "tools": tools, "system_prompt": system, "user_message": message,
                "reference": reference, "reward": reward, **({"max_steps": max_steps} if max_steps else {})}


def string_key(fn: dict, arg: str) -> bool:
    """Whether `arg` of `fn` can take a record's key: spec_env's ids are strings (BFCL's tweet_id and
    ticket_id are integers: a string id there is a type error on every call, the reference's too)."""
    props, _, defs = _params(fn)
    return (_type(props.get(arg) or {}, defs) or {}).get("type") in (None, "string")


def _lookup(fns: dict, read_tool: str) -> tuple[str, str, dict]:
    """(entity, key argument, behaviour) of a read tool: the record it fetches and by which argument."""
    behaviour, entity, _ = suggest_behaviour(fns[read_tool])
    key = behaviour["arg"]
    if not string_key(fns[read_tool], key):
        raise PatternError("read_tool", f"{read_tool} looks records up by {key!r}, which is no string: code makes "
                                        "string ids only; choose another read_tool")
    return entity, key, {"kind": "read", "entity": entity, "arg": key, "field": key}


def _acting_on(entity: str, key: str) -> dict:
    """A write tool's behaviour: it finds the record by `key` (an unknown key is an error, as on the
    target) and changes nothing the reward reads."""
    return {"kind": "update", "entity": entity, "arg": key, "field": key}


def _called(tool: str, args: dict | None = None, **kw) -> dict:
    return {"op": "called", "tool": tool, "args": args or {}, **kw}


def _component(name: str, weight: float, pred: dict) -> dict:
    return {"name": name, "weight": weight, "pred": pred}


SYSTEM = "You are a customer service agent. Use the tools to do what the user asks, then tell them."


def _lookup_then_act(c, fns: dict, level: int = 1) -> dict:
    entity, key, read = _lookup(fns, c.read_tool)
    arg, props = c.revealed_argument, _params(fns[c.write_tool])[0]
    if arg not in props:
        raise PatternError("revealed_argument", f"{c.write_tool} takes no argument {arg!r}: name one of "
                                                f"{', '.join(props)}")
    if arg == key:
        raise PatternError("revealed_argument", f"{arg!r} is the key the user states to look the record up with "
                                                f"{c.read_tool}: name another argument of {c.write_tool}, one only "
                                                f"the record holds ({', '.join(a for a in props if a != key)})")
    pool = value_pool(arg, fns[c.write_tool], unique=True)
    if pool is None:
        raise PatternError("revealed_argument", f"code cannot make values for {c.write_tool}'s {arg!r}: name "
                                                "another argument, or choose another write_tool")
    d = _Draft(fns, entity, key, {arg: pool}, level=level, decoy_key=level >= 3)
    args = d.args("write_tool", c.write_tool, {arg: f"{{task.record.{arg}}}", key: f"{{task.record.{key}}}"})
    if level >= 2:  # a real value, of another record: acting on it without the lookup acts on that one
        d.said.append(f"I think my {_words(arg)} is {{task.{d.other()}.{arg}}}, but I am not sure.")
    write = _acting_on(entity, arg) if pool["type"] == "id" else {"kind": "const", "result": "Done."}
    lookup = {key: f"{{task.record.{key}}}"}
    return d.spec("lookup_then_act", {c.read_tool: read, c.write_tool: write}, c.request, SYSTEM,
                  [{"call": c.read_tool, "args": lookup}, {"call": c.write_tool, "args": args}, {"reply": "Done."}],
                  [_component("looked_up_first", 0.3, {"op": "called_before", "first": {"tool": c.read_tool,
                                                       "args": lookup}, "then": {"tool": c.write_tool, "args": {}}}),
                   _component("acted_with_the_record", 0.7, _called(c.write_tool, args))])


# near-misses of an allowed value (level 2 the first two, 3 all): blocked, though they read almost alike
NEAR_MISSES = ("{} pending", "formerly {}", "pre-{}", "{} (expired)")


def _guarded_action(c, fns: dict, level: int = 1) -> dict:
    entity, key, read = _lookup(fns, c.read_tool)
    props = _params(fns[c.write_tool])[0]
    if key not in props:
        writes = [n for n in _writes(fns) if key in _params(fns[n])[0]]
        reads = [n for n in _reads(fns) if _lookup(fns, n)[1] in props]
        raise PatternError("write_tool", f"{c.write_tool} takes no argument {key!r}, the key {c.read_tool} looks "
                                         f"records up by: choose a write_tool that takes it ({', '.join(writes) or 'none'})"
                                         f" or a read_tool keyed by an argument of {c.write_tool} "
                                         f"({', '.join(reads) or 'none'})")
    field = c.condition_field
    allowed, blocked = ([_text(v, 30) for v in vs if _text(v, 30)] for vs in (c.allowed_values, c.blocked_values))
    if field == key:
        raise PatternError("condition_field", f"{field!r} is the record's key: name a field like 'status'")
    if not allowed or not blocked or set(allowed) & set(blocked):
        raise PatternError("blocked_values", f"allowed_values {allowed} and blocked_values {blocked} must both be "
                                             "non-empty and share no value")
    near = [m.format(v) for m in NEAR_MISSES[:{1: 0, 2: 2, 3: 4}[level]] for v in allowed]
    blocked += [v for v in dict.fromkeys(near) if v not in allowed and v not in blocked]
    balanced = allowed * len(blocked) + blocked * len(allowed)  # allowed on about half the tasks
    d = _Draft(fns, entity, key, {field: {"type": "choice", "values": balanced}}, level=level)
    lookup = {key: f"{{task.record.{key}}}"}
    args = d.args("write_tool", c.write_tool, lookup)
    if level >= 3:  # true on about half the tasks: the record decides, not what the user says
        d.said.append(f"My {_words(field)} is {allowed[0]}, so it is allowed.")
    ok = {"op": "compare", "left": f"{{task.record.{field}}}", "cmp": "in", "right": allowed}
    rule = (f"Policy: call {c.write_tool} only for a {_words(entity)} whose {_words(field)} is "
            f"{' or '.join(allowed)}. Otherwise do not call it, and tell the user it is not allowed.")
    return d.spec("guarded_action", {c.read_tool: read, c.write_tool: _acting_on(entity, key)},
                  c.request, f"{SYSTEM}\n{rule}",
                  [{"call": c.read_tool, "args": lookup}, {"call": c.write_tool, "args": args, "when": ok},
                   {"reply": "Done.", "when": ok},
                   {"reply": f"Sorry, that is not allowed: the {_words(field)} is {{task.record.{field}}}.",
                    "when": {"op": "not", "of": ok}}],
                  [_component("checked_first", 0.4, {"op": "called_before", "first": {"tool": c.read_tool,
                                                     "args": lookup}, "then": {"tool": c.write_tool, "args": {}}}),
                   _component("right_decision", 0.6, {"op": "all", "of": [_called(c.read_tool, lookup), {
                       "op": "if", "cond": ok, "then": _called(c.write_tool, args),
                       "else": {"op": "not_called", "tool": c.write_tool, "args": {}}}]})])


def _draft_for(fns: dict, tool: str, level: int = 1, decoy_key: bool = False) -> tuple[_Draft, dict, dict]:
    """(draft, bound key argument, behaviour) for a write tool alone: the record its id argument names,
    or, for a tool with no id argument, a placeholder record (EnvSpec needs one) it never reads."""
    behaviour, entity, key = suggest_behaviour(fns[tool])
    if behaviour["kind"] == "update" and string_key(fns[tool], key):
        return (_Draft(fns, entity, key, level=level, decoy_key=decoy_key), {key: f"{{task.record.{key}}}"},
                _acting_on(entity, key))
    return _Draft(fns, "ticket", "ticket_id", say_key=False, level=level), {}, {"kind": "const", "result": "Done."}


def _exact_arguments(c, fns: dict, level: int = 1) -> dict:
    d, bound, behaviour = _draft_for(fns, c.write_tool, level, decoy_key=level >= 3)
    d.decoys = {1: 0, 2: 1, 3: len(_params(fns[c.write_tool])[0])}[level]
    args = d.args("write_tool", c.write_tool, bound, extra=level)
    if len(args) < 2:
        fit = [n for n in _writes(fns) if len(_params(fns[n])[0]) >= 2]
        raise PatternError("write_tool", f"{c.write_tool} takes {len(args)} argument(s) code can fill; choose a "
                                         f"tool with two or more ({', '.join(fit) or 'none'})")
    return d.spec("exact_arguments", {c.write_tool: behaviour}, c.request,
                  f"{SYSTEM} Call each tool once, with exactly the values the user gives.",
                  [{"call": c.write_tool, "args": args}, {"reply": "Done."}],
                  # a wrong write has already happened when a retry gets it right: most of the reward is the first try
                  [_component("every_value", 0.3, _called(c.write_tool, args)),
                   _component("first_try", 0.7, _called(c.write_tool, args, only=True))])


def _multi_write(c, fns: dict, level: int = 1) -> dict:
    tools = list(c.write_tools)
    if len(set(tools)) < len(tools):
        raise PatternError("write_tools", f"{tools} names a tool twice: name two or three different tools")
    d, bound, behaviour = _draft_for(fns, tools[0], level)
    key = next(iter(bound), None)
    if lacking := [t for t in tools[1:] if key is None or key not in _params(fns[t])[0]]:
        fit = [n for n in _writes(fns) if key and key in _params(fns[n])[0]]
        raise PatternError("write_tools", f"{', '.join(lacking)} cannot act on the record {tools[0]} names "
                                          f"({key or 'it takes no id'}): choose tools that all take the same id "
                                          f"argument ({', '.join(fit) or 'none with ' + tools[0]})")
    records = ["record", "record_2", "record_3"][:level]  # one record per level, each a different one
    for i, name in enumerate(records[1:], 1):
        d.task[name] = {"type": "pick", "entity": d.entity, "other_than": records[:i]}
    if level > 1:
        keys = [f"{{task.{r}.{key}}}" for r in records]
        d.said[0] = f"My {_words(key)}s are {', '.join(keys[:-1])} and {keys[-1]}."
    calls = [(t, r, d.args("write_tools", t, {key: f"{{task.{r}.{key}}}"})) for r in records for t in tools]
    todo = f"It needs all of: {', '.join(_words(t) for t in tools)}" + (
        "." if level == 1 else f", for each of my {_words(key)}s.")
    suffix = lambda r: "" if r == "record" else r.removeprefix("record")  # noqa: E731 - called_<tool>_2
    return d.spec("multi_write", {t: {**behaviour} for t in tools}, c.request,
                  f"{SYSTEM} Finish every part of a request before you reply.",
                  [*({"call": t, "args": a} for t, _, a in calls), {"reply": "Done."}],
                  [_component(f"called_{t}{suffix(r)}", round(1 / len(calls), 3), _called(t, a)) for t, r, a in calls],
                  said_first=todo, max_steps=len(calls) + 4 if level > 1 else None)


def _amounts(level: int) -> list[dict]:
    """The task's amounts: count x price (1), less a discount (2), two items at different prices less a
    discount (3); every total positive, at most 200 of them."""
    if level == 1:
        return [{"count": n, "each": e, "total": n * e} for n in (2, 3, 4, 5) for e in (3, 4, 6, 12, 15, 25)]
    if level == 2:
        return [{"count": n, "each": e, "discount": k, "total": n * e - k}
                for n in (2, 3, 4, 5) for e in (3, 4, 6, 12, 15, 25) for k in (1, 2, 5)]
    lines = itertools.product((2, 3, 4), (4, 6, 12, 15), (2, 3, 5), (3, 7, 25))
    return [{"count": n, "each": e, "count2": n2, "each2": e2, "discount": k, "total": n * e + n2 * e2 - k}
            for i, (n, e, n2, e2) in enumerate(lines) for k in [(1, 2, 5)[i % 3]]]


def _compute_then_act(c, fns: dict, level: int = 1) -> dict:
    arg = c.amount_argument
    if arg not in _params(fns[c.write_tool])[0] or not _numeric(fns[c.write_tool], arg) or arg.endswith("_id"):
        numbers = [a for a in _params(fns[c.write_tool])[0] if _numeric(fns[c.write_tool], a) and not a.endswith("_id")]
        raise PatternError("amount_argument", f"{c.write_tool} takes no number argument {arg!r} (its number "
                                              f"arguments: {', '.join(numbers) or 'none: choose another write_tool'})")
    d, bound, behaviour = _draft_for(fns, c.write_tool, level)
    d.task["amount"] = {"type": "choice", "values": _amounts(level)}
    args = d.args("write_tool", c.write_tool, {**bound, arg: "{task.amount.total}"})
    unit = _text(c.unit, 30) or "item"
    items = f"{{task.amount.count}} x {unit} at {{task.amount.each}} each" + (
        f" and {{task.amount.count2}} x {unit} at {{task.amount.each2}} each" if level >= 3 else "")
    said = f"It is for {items}; the {_words(arg)} is the total." if level == 1 else \
        f"It is for {items}, with {{task.amount.discount}} off the total; the {_words(arg)} is what is left."
    return d.spec("compute_then_act", {c.write_tool: behaviour}, c.request, SYSTEM,
                  [{"call": c.write_tool, "args": args}, {"reply": "Done."}],
                  [_component("right_total", 0.5, _called(c.write_tool, {arg: "{task.amount.total}"})),
                   _component("whole_call", 0.5, _called(c.write_tool, args))], said_first=said)


EXPANDERS = {"lookup_then_act": _lookup_then_act, "guarded_action": _guarded_action,
             "exact_arguments": _exact_arguments, "multi_write": _multi_write, "compute_then_act": _compute_then_act}


def expand(choice: BaseModel | str | dict, tools: list[dict], difficulty: int = 1) -> dict:
    """The spec (EnvSpec-valid, in spec_env's format) code writes for a builder's choice on the
    target's `tools`, at `difficulty` (LEVELS; 1: the pattern as first written, HARDER says what the
    others change). A choice that does not fit raises PatternError (or pydantic's ValidationError
    for a malformed one): both are ValueErrors that name the field to change."""
    if type(difficulty) is not int or difficulty not in LEVELS:
        raise PatternError("difficulty", f"must be one of {', '.join(map(str, LEVELS))} (1: the pattern as first "
                                         f"written), got {difficulty!r}")
    c = choice if isinstance(choice, BaseModel) else parse_choice(choice, tools)
    names = {t["function"]["name"] for t in tools}
    for field in ("read_tool", "write_tool", "write_tools"):  # a choice validated against another target
        for name in [getattr(c, field, None)] if field != "write_tools" else getattr(c, field, []):
            if name is not None and name not in names:
                raise PatternError(field, f"{name!r} is not a tool of this target: choose from {', '.join(sorted(names))}")
    return EnvSpec.model_validate(EXPANDERS[c.pattern](c, _fn(tools), difficulty)).to_spec()
