"""Env-builder agent and the synthesis loop: write -> verify -> (findings back) -> rewrite.

The builder LLM gets the capability (name, description, example failed trajectories), the
target's tool schemas, policy and message format, the environment contract and a worked
reference environment, and answers with one Python module. The code is parsed here (never
executed on the host) and then run only inside the sandbox by the verifier. Every attempt
is kept: env.py, verifier_report.json (with calibration figures when run).
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, field_validator

from trace_rl import prompts
from trace_rl.agents import env_patterns
from trace_rl.agents.env_spec import EnvSpec, check_in_sandbox, render_module, repair_in_sandbox, suggest_behaviour
from trace_rl.agents.verifier import Finding, VerifierReport, VerifyConfig, verify
from trace_rl.core.io import atomic_write_json, atomic_write_text
from trace_rl.models.chat import ReplyError, StructuredOutputError
from trace_rl.core.records import PATTERN_NOTE, Capability, EnvRecord
from trace_rl.core.rundir import Attempt, EnvDir


class EnvDraft(BaseModel):
    code: str

    @field_validator("code")
    @classmethod
    def _valid_module(cls, code: str) -> str:
        try:
            tree = ast.parse(code)  # parsing only; the code runs nowhere but the sandbox
        except SyntaxError as err:
            raise ValueError(f"the code does not parse: line {err.lineno}: {err.msg}") from None
        if not any(isinstance(n, ast.ClassDef) and n.name == "Env" for n in tree.body):
            raise ValueError("the module must define `class Env(Environment)` at top level")
        banned = {"tau2", "requests", "socket", "subprocess"}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name.split(".")[0] in banned:
                    raise ValueError(f"do not import {name}: the environment must be standalone (stdlib only)")
        return code


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def parse_draft(text: str) -> EnvDraft:
    blocks = _FENCE.findall(text)
    code = max(blocks, key=len) if blocks else text
    return EnvDraft(code=code.strip() + "\n")


def reference_example() -> str:
    return (resources.files("trace_rl.sandbox") / "envs" / "precondition_verification_airline.py").read_text()


def contract_source() -> str:
    return (resources.files("trace_rl.sandbox") / "image" / "trace_env.py").read_text()


@dataclass
class Target:
    """What the environment must imitate."""
    name: str
    tools: list[dict]
    policy: str
    system_prompt_format: str  # how the target frames its system prompt

    @classmethod
    def of(cls, benchmark) -> "Target":
        spec = benchmark.spec()
        return cls(benchmark.name, spec["tools"], spec["policy"], spec["system_prompt"])


def build_messages(capability: Capability, target: Target, examples: list[str], feedback: str | None,
                   previous: str | None) -> list[dict]:
    tools = json.dumps(target.tools, indent=1)
    user = (f"# Capability to train\n{capability.name}: {capability.description}\n\n"
            f"# Failed trajectories that show the gap\n" + "\n\n".join(examples)[:6000] +
            f"\n\n# Target benchmark: {target.name}\n## Its tool schemas (copy the ones you use exactly)\n{tools[:12000]}"
            f"\n\n## Its policy (excerpt)\n{target.policy[:4000]}\n\n## Its system prompt format\n"
            f"{target.system_prompt_format[:1500]}")
    if previous is not None:
        user += f"\n\n# Your previous attempt\n```python\n{previous}\n```\n# Verifier findings to fix\n{feedback}"
    system = prompts.load("env_builder", contract=contract_source(), example=reference_example())
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


class BuilderError(ReplyError, ValueError):
    """The builder gave no valid module or spec."""


def _ask_builder(what: str, ask: Callable):
    """`ask()`, with every way it fails as a BuilderError: no valid `what` (the last answer kept),
    or an endpoint that failed (timeout, refused): either way this round fails, on the record."""
    try:
        return ask()
    except StructuredOutputError as err:
        raise BuilderError(f"env-builder produced no valid {what}: {err}", err.reply) from None
    except Exception as err:
        raise BuilderError(f"the builder's endpoint failed: {type(err).__name__}: {str(err)[:500]}") from err


def write_env(llm, capability: Capability, target: Target, examples: list[str], feedback=None, previous=None,
              attempts: int = 3) -> EnvDraft:
    return _ask_builder("module", lambda: llm.ask(build_messages(capability, target, examples, feedback, previous),
                                                 parse_draft, attempts, "Send the whole corrected module."))


# ---------------------------------------------------------------- spec mode (small local models)
BUILDER_MODES = ("auto", "spec", "pattern", "code")


def builder_mode(mode: str, llm) -> str:
    """auto: pattern for a local (embedded) builder model, which cannot write a whole module and
    verified no spec-mode env in real runs (docs/examples/pattern-build); code for a model at an
    endpoint (base_url), which is assumed strong. spec only when asked for."""
    if mode not in BUILDER_MODES:
        raise ValueError(f"builder_mode {mode!r}: use one of {', '.join(BUILDER_MODES)}")
    if mode != "auto":
        return mode
    return "code" if getattr(getattr(llm, "config", None), "base_url", None) else "pattern"


def starter_spec(tools: list[dict], name: str = "") -> dict:
    """A minimal valid spec that code writes on the target's own tools (look a record up by its id,
    tell the user a code only the record holds), for the builder to extend. A worked example from another domain made
    the 1.5B copy that domain's tools, ids and facts (docs/examples/spec-build)."""
    for t in tools:
        behaviour, entity, key = suggest_behaviour(t["function"])
        if behaviour["kind"] == "read" and "field" not in behaviour:
            tool, arg = t["function"]["name"], behaviour["arg"]
            break
    else:
        raise ValueError("the target has no tool that reads a record by its id: write the example by hand")
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
    entity, tool or slots is not an environment for any capability. The 1.5B sent it back unchanged
    for three of four capabilities and every automatic check passed it."""
    try:
        starter = starter_spec(tools)
    except ValueError:
        return False
    return _task_shape(spec, tools) == _task_shape(starter, tools)


def _task_shape(spec: dict, tools: list[dict]) -> str:
    """The user message, reference and reward with slots, tool names and arguments abstracted (the
    proof run's 1.5B passed the starter off as two capabilities' envs by looking the record up by
    phone number instead of id)."""
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
        # the request lists tools as `name(arguments)`; the 1.5B copied that form as the name: code strips it
        spec.tools = {n.split("(")[0].strip(): v for n, v in spec.tools.items()}
        if not any(n in names for n in spec.tools):  # some other domain's tools only: nothing to repair from
            raise ValueError(f"tools: {sorted(spec.tools)} are not tools of {target.name}; choose from "
                             f"{', '.join(names)}")
        return spec.to_spec()  # another domain's tool next to real ones: code drops it in the sandbox
    return _ask_builder("spec", lambda: llm.structured(
        spec_messages(capability, target, examples, feedback, previous), EnvSpec, attempts,
        check=known_tools,  # a bad spec costs a round, which has findings to fix
        **({"temperature": 0.7} if previous else {})))  # a later round must not repeat


# ---------------------------------------------------------------- pattern mode (smaller still)
def pattern_messages(capability: Capability, target: Target, feedback: str | None, previous: str | None,
                     patterns: list[str] | None = None) -> list[dict]:
    user = (f"# Capability to train\n{capability.name}: {capability.description}\n\n"
            f"# Target benchmark: {target.name}\n## Its tools (name(arguments): description)\n"
            + "\n".join(tool_line(t["function"]) for t in target.tools))
    if previous is not None:  # findings last, nearest the answer
        user += (f"\n\n# Your previous choice\n{previous}\n# What the checks found (fix every one)\n{feedback}"
                 "\nChoose again: another pattern or other tools. Do not send the previous choice unchanged.")
    system = prompts.load("env_builder_pattern", patterns=env_patterns.pattern_menu(target.tools, patterns))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def write_pattern(llm, capability: Capability, target: Target, feedback=None, previous=None,
                  attempts: int = 3, failed: list[dict] = ()) -> tuple[dict, dict]:
    """(the builder's choice as it wrote it, the spec code expanded from it). The choice is decoded
    under env_patterns.decode_schema (only bindings of the target's tools that expand, only patterns that fit
    the capability: env_patterns.fitting); a choice that does not fit the tools (env_patterns.PatternError),
    or binds the same pattern and tools as a `failed` choice of an earlier round, goes back to the model
    like a validation error (a choice is a few dozen tokens, so one more try than spec mode costs little)."""
    model = env_patterns.choice_model(target.tools)  # a target no pattern fits: a PatternError, this round's
    grammar = env_patterns.fitting(capability, env_patterns.decode_schema(target.tools))
    patterns = env_patterns.offered(grammar)
    binding = lambda c: {k: v for k, v in c.items() if k != "request"}  # noqa: E731 - the env, not its wording
    tried = [binding(c) for c in failed]

    def expanded(choice) -> tuple[dict, dict]:
        if why := env_patterns.misfit(capability, choice.root.pattern, patterns):
            raise env_patterns.PatternError("pattern", why)
        if binding(choice.model_dump()) in tried:  # the 0.5B sent round 1's choice again, word for word
            raise env_patterns.PatternError("pattern", "the same pattern and tools as your previous choice, which "
                                                       "failed the checks: choose another pattern or other tools")
        try:
            return choice.model_dump(), env_patterns.expand(choice.root, target.tools)
        except (KeyError, TypeError) as err:  # a tool schema code cannot read: the model's to route around
            raise env_patterns.PatternError("write_tool", f"code cannot expand this binding ({err!r}): choose "
                                                          "other tools") from None
    messages = pattern_messages(capability, target, feedback, previous, patterns)
    return _ask_builder("pattern choice", lambda: llm.structured(
        messages, model, attempts, check=expanded, decode_schema=grammar, **({"temperature": 0.7} if previous else {})))


def attempt_origin(adir: Path) -> str:
    """What wrote an attempt's env: "pattern:<name>" where code expanded a builder's pattern
    choice (builder_choice.json), else "builder" (a module or spec the builder wrote itself)."""
    choice = Attempt(adir).builder_choice
    return f"pattern:{json.loads(choice.read_text())['pattern']}" if choice.is_file() else "builder"


def build_attempt(builder, capability: Capability, target: Target, examples: list[str], out_dir: str | Path, rnd: int,
                  feedback: str | None = None, previous: str | None = None, mode: str = "code") -> dict:
    """Round `rnd` of the builder: attempt_XX/env.py (in spec and pattern mode also the spec.json it
    was rendered from; in pattern mode builder_choice.json, the model's choice), or
    attempt_XX/builder_error.json when the builder gave nothing valid. A round already on disk is
    returned as it is (resume)."""
    adir = EnvDir(out_dir).attempt(rnd)
    if adir.env.is_file():
        return {"round": rnd, "env": str(adir.env), "origin": attempt_origin(adir)}
    if adir.builder_error.is_file():
        return {"round": rnd, "error": json.loads(adir.builder_error.read_text())["error"]}
    adir.root.mkdir(parents=True, exist_ok=True)
    try:
        if mode == "spec":
            raw = write_spec(builder, capability, target, list(examples), feedback, previous)
            atomic_write_json(adir.builder_spec, raw)  # what the model wrote, as it wrote it
            suggestions = {t["function"]["name"]: suggest_behaviour(t["function"])[0] for t in target.tools}
            spec, repairs = repair_in_sandbox(raw, target.tools, suggestions)  # mechanical slips, fixed by code
            atomic_write_json(adir.repairs, repairs)
            atomic_write_json(adir.spec, spec)
            code = render_module(spec, target.tools, target.policy)  # schemas and policy: copied by code
        elif mode == "pattern":  # every earlier round's choice failed: none may come again
            earlier = (EnvDir(out_dir).attempt(r).builder_choice for r in range(1, rnd))
            failed = [json.loads(p.read_text()) for p in earlier if p.is_file()]
            choice, spec = write_pattern(builder, capability, target, feedback, previous, failed=failed)
            atomic_write_json(adir.builder_choice, choice)  # what the model wrote
            atomic_write_json(adir.spec, spec)  # what code expanded it into
            code = render_module(spec, target.tools, target.policy)
        else:
            code = write_env(builder, capability, target, list(examples), feedback, previous).code
    except ValueError as err:
        if getattr(err, "reply", ""):
            atomic_write_text(adir.builder_reply, err.reply)  # what it wrote, for whoever reads the findings
        atomic_write_json(adir.builder_error, {"error": str(err)})
        return {"round": rnd, "error": str(err)}
    atomic_write_text(adir.env, code)
    return {"round": rnd, "env": str(adir.env), "origin": attempt_origin(adir)}


def verify_attempt(attempt: dict, capability: Capability, target: Target, cfg: VerifyConfig = VerifyConfig(),
                   reviewer=None, base_policy=None) -> dict:
    """Verify one attempt (cached in verifier_report.json); writes the attempt's manifest.json.
    Returns the report as a dict, with `feedback` for the next round."""
    if "env" not in attempt:
        return {"passed": False, "feedback": f"the builder gave no valid module: {attempt['error']}"}
    env = Path(attempt["env"])
    adir = Attempt(env.parent)
    if adir.verifier_report.is_file():
        return json.loads(adir.verifier_report.read_text())
    code = env.read_text()
    spec = json.loads(adir.spec.read_text()) if adir.spec.is_file() else None
    static = [] if spec is None else [  # a spec's own checks first: findings that name its fields
        Finding(f["check"], False, f["detail"]) for f in check_in_sandbox(spec, target.tools)]
    if spec is not None and copies_starter(spec, target.tools):
        static.append(Finding("starter_copy", False, (
            "user_message, reference and reward are the example's (look a record up and tell its reference "
            f"code), which trains nothing: write a task where {capability.name} decides the reward "
            "(records and facts that make a careless agent fail on about half the seeds, the checks or steps "
            "the capability needs, and a reward component for each)")))
    report = VerifierReport(static) if static else verify(code, target.tools, capability, cfg, reviewer, base_policy)
    repairs = json.loads(adir.repairs.read_text()) if adir.repairs.is_file() else []
    out = {**report.to_dict(), "repairs": repairs, "feedback": report.feedback() + (
        "\nCode already fixed these in the spec above (keep them): " + "; ".join(repairs) if repairs else "")}
    tools = next((f.figures.get("tools") for f in report.findings if f.check == "tool_schemas"), None)
    origin = attempt.get("origin") or attempt_origin(env.parent)
    atomic_write_json(adir.manifest, {
        "capability": capability.name, "description": capability.description, "target": target.name,
        "round": attempt["round"], "origin": origin, **({"note": PATTERN_NOTE} if origin.startswith("pattern") else {}),
        "tools": tools, "passed": report.passed,
        "sha256": hashlib.sha256(code.encode()).hexdigest(),
        "calibration": {k: v for k, v in (report.calibration or {}).items() if k != "groups"} or None})
    atomic_write_json(adir.verifier_report, out)
    return out


def previous_round(out_dir: str | Path, rnd: int) -> tuple[str | None, str | None]:
    """(what the builder wrote: module, spec or pattern choice text, verifier feedback) of round `rnd` - 1."""
    prev = EnvDir(out_dir).attempt(rnd - 1)
    source = next((p for p in (prev.builder_choice, prev.spec) if p.is_file()), prev.env)
    code = source.read_text() if source.is_file() else None
    report, error = prev.verifier_report, prev.builder_error
    feedback = json.loads(report.read_text())["feedback"] if report.is_file() else \
        f"the builder gave no valid module: {json.loads(error.read_text())['error']}" if error.is_file() else None
    return code, feedback


def synthesize_round(capability: Capability, target: Target, builder, out_dir: str | Path, rnd: int, *,
                     examples: list[str] = (), reviewer=None, base_policy=None, cfg: VerifyConfig = VerifyConfig(),
                     max_rounds: int = 5, library_fallback: bool = False, mode: str = "code",
                     log=print) -> EnvRecord | None:
    """Round `rnd` of synthesis: the builder writes (with the last round's findings), the verifier
    tests it in the sandbox. Returns the outcome once synthesis has ended (verified; or, after the
    last round, a verified library substitute or `needs_human`), None when another round is due.
    Everything is cached in the round's folder, so a killed round resumes where it stopped.
    `mode`: "code" (the builder writes a Python module), "spec" (a JSON spec; see write_spec) or
    "pattern" (a pattern choice that code expands into a spec; see write_pattern)."""
    out = Path(out_dir)
    previous, feedback = previous_round(out, rnd)
    attempt = build_attempt(builder, capability, target, list(examples), out, rnd, feedback, previous, mode)
    report = verify_attempt(attempt, capability, target, cfg, reviewer, base_policy)
    failed = [f["check"] for f in report.get("findings", []) if not f["passed"]] or ["builder"]
    log(f"{capability.name} round {rnd}: {'passed' if report['passed'] else 'failed: ' + ', '.join(failed)}")
    if report["passed"]:
        return EnvRecord(status="verified", env=attempt["env"], rounds=rnd, source=attempt.get("origin", "builder"))
    if rnd < max_rounds:
        return None
    lib = library_match(capability, target.name) if library_fallback else None
    if lib is not None:  # verified like any other environment, in its own attempt folder
        lib_env = EnvDir(out).library.env
        if not lib_env.is_file():
            atomic_write_text(lib_env, lib["path"].read_text())
        lib_report = verify_attempt({"round": "library", "env": str(lib_env), "origin": "library"},
                                    capability, target, cfg, reviewer, base_policy)
        if lib_report["passed"]:
            log(f"{capability.name}: builder failed {rnd} round(s); SUBSTITUTE: library environment "
                f"{lib['capability'].name} ({lib['why']})")
            return EnvRecord(status="verified", env=str(lib_env), rounds=rnd, source=f"library:{lib['capability'].name}",
                             substitute=f"library environment {lib['capability'].name} ({lib['why']}): the builder's {rnd} "
                                        "round(s) failed", findings=report["feedback"],
                             trained_on=lib["capability"])
    why = ("library_fallback is off" if not library_fallback else "no library environment matches"
           if lib is None else f"the matching library environment {lib['capability'].name} failed verification too")
    return EnvRecord(status="needs_human", env=attempt.get("env"), rounds=rnd, findings=report["feedback"],
                     source=attempt.get("origin", "builder"), reason=f"{rnd} builder round(s) failed verification; {why}")


def synthesize(capability: Capability, target: Target, builder, out_dir: str | Path, max_rounds: int = 5,
               **kw) -> EnvRecord:
    """Build and verify until the environment passes or `max_rounds` are spent (`trace-rl build`);
    the pipeline runs the same rounds one graph step at a time."""
    rnd, record = 0, None
    while record is None:  # the last round always returns one
        rnd += 1
        record = synthesize_round(capability, target, builder, out_dir, rnd, max_rounds=max_rounds, **kw)
    atomic_write_json(EnvDir(out_dir).result, record.model_dump())
    return record


def library() -> dict[str, Path]:
    """Hand-written, verified environments shipped with trace-rl: {module name: path}.
    Named `<capability>_<target domain>.py`; a human (or an unattended run that allows it)
    can use one when the builder's attempts for that capability all fail."""
    root = resources.files("trace_rl.sandbox") / "envs"
    return {p.name[:-3]: Path(str(p)) for p in root.iterdir() if p.name.endswith(".py")}


STOP_WORDS = frozenset("""a an and any are as at be before by can do does for from has have in into is it its
it's not of on or that the their them then this to use uses using when which with without agent agents user users
capability task tasks tool tools call calls calling environment reference right one two""".split())
LIBRARY_ALIASES: dict[str, str] = {  # discovered names that mean a library capability, by a person's reading
    "argument_precision": "tool_call_precision", "exact_tool_arguments": "tool_call_precision",
    "tool_argument_precision": "tool_call_precision", "schema_adherence": "tool_call_precision",
    "precondition_checking": "precondition_verification", "policy_precondition_checking": "precondition_verification",
    "eligibility_verification": "precondition_verification", "stateful_diagnosis": "mobile_data_troubleshooting",
    "diagnose_before_acting": "mobile_data_troubleshooting",
}


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower().replace("_", " ")) if len(w) > 2 and w not in STOP_WORDS}


def library_match(capability: Capability, target: str, min_shared: int = 4, min_share: float = 0.25) -> dict | None:
    """The library environment for `target` (e.g. tau2:telecom) that trains this capability, or None.

    A match is the library capability's own name, an alias of it (LIBRARY_ALIASES), or at least
    `min_shared` content words (no stop words), and `min_share` of the capability's, shared with
    its name and docstring. Returns {"path", "capability", "why"}; the adapter is then named
    and described after the library capability, not the discovered one."""
    domain = target.split(":")[-1].split("@")[0]  # tau2:airline@tau3 -> airline
    name = capability.name
    words = content_words(name + " " + capability.description)
    best = None
    for module, path in sorted(library().items()):
        if not module.endswith("_" + domain):
            continue
        lib_name = module[: -len(domain) - 1]
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        entry = {"path": path, "capability": Capability(name=lib_name, description=" ".join(doc.split("\n\n")[0].split()))}
        if name == lib_name or LIBRARY_ALIASES.get(name) == lib_name:
            return {**entry, "why": "same capability" if name == lib_name else f"alias of {lib_name}"}
        shared = words & content_words(lib_name + " " + doc)
        if len(shared) >= min_shared and len(shared) >= min_share * len(words) and \
                (best is None or len(shared) > len(best["shared"])):
            best = {**entry, "shared": shared}
    if best is None:
        return None
    shared = sorted(best.pop("shared"))
    return {**best, "why": f"shares {len(shared)} content words: {', '.join(shared)}"}
