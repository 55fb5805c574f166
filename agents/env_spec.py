"""Spec mode on the host: the schema a builder's JSON spec is decoded under, code's guess of each
target tool's behaviour (`suggest_behaviour`: spec mode offers it, pattern mode builds on it), and
the module text that carries a spec into the sandbox.

The builder (a small model) writes a spec, never Python; `EnvSpec.model_json_schema()` is the
`response_format` schema (llama.cpp turns it into a grammar). The spec runs only in the sandbox,
interpreted by sandbox/image/spec_env.py, whose docstring documents the format and whose
`check_spec` gives the findings (`check_in_sandbox` asks a sandbox for them). The models here define
the format; spec_env (stdlib only: it runs in the image) keeps the same shapes as tables, and
tests/sandbox/test_spec_runtime.py fails on any difference between the two.
"""
from __future__ import annotations

import json
import pprint
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from trace_rl.sandbox.session import SandboxError, SessionLimits, open_session


# An expression: any JSON value (strings are templates). Spelt out, as llama.cpp's grammar needs a type.
Expr = Annotated[Any, WithJsonSchema({"anyOf": [{"type": t} for t in ("string", "number", "boolean", "null",
                                                                      "array", "object")]})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)  # "0.2" is not a weight


# ---------------------------------------------------------------- predicates
class CallPattern(_Strict):
    tool: str
    args: dict[str, Expr] = Field(default_factory=dict, description="a subset the call's arguments must contain")


class Called(_Strict):
    op: Literal["called"]
    tool: str
    args: dict[str, Expr] = Field(default_factory=dict, description="a subset the call's arguments must contain")
    only: bool = Field(False, description="every call of the tool matched args")


class NotCalled(_Strict):
    op: Literal["not_called"]
    tool: str
    args: dict[str, Expr] = Field(default_factory=dict)


class CalledBefore(_Strict):
    op: Literal["called_before"]
    first: CallPattern
    then: CallPattern


class ReplyContains(_Strict):
    op: Literal["reply_contains"]
    text: Expr


class StateEquals(_Strict):
    op: Literal["state_equals"]
    path: str = Field(description="e.g. task.reservation.status")
    value: Expr


class Compare(_Strict):
    op: Literal["compare"]
    left: Expr
    cmp: Literal["==", "!=", "<", "<=", ">", ">=", "in"]
    right: Expr


class AllOf(_Strict):
    op: Literal["all"]
    of: list[Predicate]


class AnyOf(_Strict):
    op: Literal["any"]
    of: list[Predicate]


class Not(_Strict):
    op: Literal["not"]
    of: Predicate


class If(_Strict):
    op: Literal["if"]
    cond: Predicate
    then: Predicate
    else_: Predicate | None = Field(None, alias="else")


Predicate = Annotated[Union[Called, NotCalled, CalledBefore, ReplyContains, StateEquals, Compare, AllOf, AnyOf,
                            Not, If], Field(discriminator="op")]
for _model in (AllOf, AnyOf, Not, If):
    _model.model_rebuild()

# ---------------------------------------------------------------- state and task values
class IdField(_Strict):
    type: Literal["id"]
    pattern: str = Field(description="one {n} or {n:0Kd} slot, e.g. 'R{n:04d}'")


class ChoiceField(_Strict):
    type: Literal["choice"]
    values: list[Expr] = Field(min_length=1, max_length=200)


class IntField(_Strict):
    type: Literal["int"]
    min: int
    max: int


class FloatField(_Strict):
    type: Literal["float"]
    min: float
    max: float


class BoolField(_Strict):
    type: Literal["bool"]
    p: float = Field(0.5, ge=0, le=1)


class RefField(_Strict):
    type: Literal["ref"]
    entity: str


class DateField(_Strict):
    type: Literal["date"]
    start: str = Field(description="YYYY-MM-DD")
    days: int = Field(ge=0, le=3650)


class ConstField(_Strict):
    type: Literal["const"]
    value: Expr


class Pick(_Strict):
    type: Literal["pick"]
    entity: str
    where: dict[str, Expr] = Field(default_factory=dict)
    other_than: list[str] = Field(default_factory=list, description="earlier picks of the entity this one is not")


class Fact(_Strict):
    type: Literal["fact"]
    pred: Predicate


_FIELDS = (IdField, ChoiceField, IntField, FloatField, BoolField, RefField, DateField, ConstField)
FieldSpec = Annotated[Union[_FIELDS], Field(discriminator="type")]
TaskVar = Annotated[Union[(*_FIELDS, Pick, Fact)], Field(discriminator="type")]


class Entity(_Strict):
    count: list[int] = Field(min_length=2, max_length=2, description="[lo, hi] records")
    fields: dict[str, FieldSpec]


# ---------------------------------------------------------------- tools, reference, reward
class Read(_Strict):
    kind: Literal["read"]
    entity: str
    arg: str = Field(description="the tool argument holding the key")
    field: str | None = None


class Update(Read):
    kind: Literal["update", "write"]
    set: dict[str, Expr] = Field(default_factory=dict)
    guard: Predicate | None = None
    error: str | None = None


class ListTool(_Strict):
    kind: Literal["list"]
    entity: str
    where: dict[str, Expr] = Field(default_factory=dict)
    project: str | None = None


class Const(_Strict):
    kind: Literal["const"]
    result: Expr


Tool = Annotated[Union[Read, Update, ListTool, Const], Field(discriminator="kind")]


class CallStep(_Strict):
    call: str
    args: dict[str, Expr] = Field(default_factory=dict)
    when: Predicate | None = None


class ReplyStep(_Strict):
    reply: str
    when: Predicate | None = None


class Component(_Strict):
    name: str
    weight: float = Field(gt=0, le=100)
    pred: Predicate


class EnvSpec(_Strict):
    """A training environment as data (format: sandbox/image/spec_env.py). The fields are in the
    order a small model should decide them (data, then the tools over it, then the task's text,
    the answer and the reward); `entities` and `task` are required so a grammar cannot skip them."""
    name: str = ""
    entities: dict[str, Entity] = Field(min_length=1, description="the records the tools read and change")
    task: dict[str, TaskVar] = Field(min_length=1, description="what one task picks and derives, in order")
    tools: dict[str, Tool] = Field(description="target tool name -> behaviour")
    system_prompt: str
    user_message: str
    hint: str = ""
    reference: list[Union[CallStep, ReplyStep]] = Field(min_length=1, max_length=30)
    reward: list[Component] = Field(min_length=1, max_length=20)
    max_steps: int = Field(10, ge=1, le=50)

    def to_spec(self) -> dict:
        """The plain dict spec_env runs (defaults left out, `else` spelt as such)."""
        return self.model_dump(by_alias=True, exclude_unset=True)


# ---------------------------------------------------------------- code's guess of a tool's behaviour
READ_VERBS = ("get", "find", "check", "search", "list", "calculate", "lookup", "show")


def suggest_behaviour(fn: dict) -> tuple[dict, str | None, str | None]:
    """(behaviour, entity, key field) code guesses for a target tool from its name and schema,
    so a small builder copies a working line instead of inventing one: `get_order_details(order_id)`
    reads entity `order` by `order_id`; `cancel_reservation(reservation_id)` updates `reservation`;
    `find_user_id_by_email(email)` reads `user` by its `email` field; no arguments: a constant."""
    name = fn["name"]
    params = fn.get("parameters") or {}
    args = list(params.get("required") or params.get("properties") or [])
    words = name.split("_")
    ids = [a for a in args if a == "id" or a.endswith("_id")]
    if not args or words[0] == "calculate" or (not ids and words[0] not in READ_VERBS):
        return {"kind": "const", "result": "..."}, None, None
    named = [a for a in ids if a.removesuffix("_id") in words[1:]]
    if ids:
        arg = (named or ids)[0]
        entity = arg.removesuffix("_id") if arg != "id" else "record"
        field = None
    else:  # looked up by another field: search_direct_flight -> flight, find_user_id_by_email -> user
        arg, field = args[0], args[0]
        entity = words[-1].removesuffix("s") if words[0] in ("list", "search") else words[1] if len(words) > 1 \
            else "record"
    if words[0] in ("list", "search"):
        behaviour = {"kind": "list", "entity": entity, "where": {a: f"{{args.{a}}}" for a in args}}
    elif words[0] in READ_VERBS:
        behaviour = {"kind": "read", "entity": entity, "arg": arg, **({"field": field} if field else {})}
    else:  # what it changes is the builder's to say; a cancel sets a status code can name
        behaviour = {"kind": "update", "entity": entity, "arg": arg,
                     "set": {"status": "cancelled"} if words[0] == "cancel" else {}}
    return behaviour, entity, field or arg


# ---------------------------------------------------------------- into the sandbox
def exposed_tools(spec: dict, target_tools: list[dict]) -> list[dict]:
    """The target's own schemas of the tools the spec names (copied, never retyped by the model)."""
    names = spec.get("tools") if isinstance(spec, dict) and isinstance(spec.get("tools"), dict) else {}
    return [t for t in target_tools if t["function"]["name"] in names]


def render_module(spec: dict, target_tools: list[dict], policy: str = "") -> str:
    """An env module for the existing loader and verifier: the spec, the target's schemas and its
    policy as literals (pprint's repr of JSON values: the spec's text cannot become code)."""
    fmt = lambda x: pprint.pformat(x, width=110, sort_dicts=False)  # noqa: E731
    return ('"""A spec-built environment: the data below, run by spec_env.SpecEnv (sandbox/image/spec_env.py)."""\n'
            "from spec_env import SpecEnv\n\n"
            f"SPEC = {fmt(spec)}\n\n"
            f"TOOLS = {fmt(exposed_tools(spec, target_tools))}\n\n"
            f"POLICY = {policy!r}\n\n\n"
            "class Env(SpecEnv):\n"
            "    SPEC = SPEC\n"
            "    TOOLS = TOOLS\n"
            "    POLICY = POLICY\n")


def _in_sandbox(call: str, *args):
    """`spec_env.<call>(*args)` run inside a sandbox (a spec is hostile data: its size, depth and
    loops are handled there); its JSON result. Raises SandboxError, or ValueError/TypeError when the
    arguments are no JSON."""
    payload = json.dumps(list(args))
    snippet = f"import json, spec_env\nprint(json.dumps(spec_env.{call}(*json.loads({payload!r}))))\n"
    with open_session(SessionLimits()) as session:
        return json.loads(session.exec(snippet, timeout=60))


def repair_in_sandbox(spec: dict, target_tools: list[dict], suggestions: dict) -> tuple[dict, list[str]]:
    """spec_env.repair_spec in a sandbox: (repaired spec, notes), or the spec as it was and a note why."""
    try:
        fixed, notes = _in_sandbox("repair_spec", spec, target_tools, 6, suggestions)
        return (fixed, [str(n) for n in notes]) if isinstance(fixed, dict) else (spec, [])
    except (SandboxError, TypeError, ValueError) as err:
        return spec, [f"repairs did not run: {str(err)[:300]}"]


def check_in_sandbox(spec: dict, target_tools: list[dict]) -> list[dict]:
    """spec_env.check_spec in a sandbox (5 seeds): the findings, or one finding saying why none came."""
    try:
        return _in_sandbox("check_spec", spec, target_tools)
    except (TypeError, ValueError) as err:
        return [{"check": "schema", "passed": False, "detail": f"spec: not JSON or no answer ({str(err)[:300]})"}]
    except SandboxError as err:
        return [{"check": "sandbox", "passed": False, "detail": f"spec: the checks did not run: {str(err)[:500]}"}]
