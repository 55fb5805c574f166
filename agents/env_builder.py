"""The synthesis loop: build (one of the builder modes, agents/builders/) -> verify in the sandbox ->
findings back -> build again, one round per folder. Every round is kept: what the model wrote, env.py,
verifier_report.json (with calibration figures when run), manifest.json; a killed round resumes."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from trace_rl.agents.builders import Builder, Target
from trace_rl.agents.builders import code as by_code, pattern as by_pattern, spec as by_spec
from trace_rl.agents.builders.spec import copies_starter
from trace_rl.agents.env_library import library_match
from trace_rl.agents.env_spec import check_in_sandbox
from trace_rl.agents.verifier import Finding, VerifierReport, VerifyConfig, verify
from trace_rl.core.io import atomic_write_json, atomic_write_text
from trace_rl.core.records import PATTERN_NOTE, Capability, EnvRecord
from trace_rl.core.rundir import Attempt, EnvDir

BUILDERS: dict[str, Builder] = {"code": by_code.write, "spec": by_spec.write, "pattern": by_pattern.write}
BUILDER_MODES = ("auto", *BUILDERS)


def builder_mode(mode: str, llm) -> str:
    """auto: pattern for a local (embedded) builder model, which cannot write a whole module and
    verified no spec-mode env in real runs (docs/examples/pattern-build); code for a model at an
    endpoint (base_url), which is assumed strong. spec only when asked for."""
    if mode not in BUILDER_MODES:
        raise ValueError(f"builder_mode {mode!r}: use one of {', '.join(BUILDER_MODES)}")
    if mode != "auto":
        return mode
    return "code" if getattr(getattr(llm, "config", None), "base_url", None) else "pattern"


def attempt_origin(adir: Path) -> str:
    """What wrote an attempt's env: "pattern:<name>" where code expanded a builder's pattern
    choice (builder_choice.json), else "builder" (a module or spec the builder wrote itself)."""
    choice = Attempt(adir).builder_choice
    return f"pattern:{json.loads(choice.read_text())['pattern']}" if choice.is_file() else "builder"


def build_attempt(builder, capability: Capability, target: Target, examples: list[str], out_dir: str | Path, rnd: int,
                  feedback: str | None = None, previous: str | None = None, mode: str = "code") -> dict:
    """Round `rnd` of the builder in `mode` (BUILDERS): attempt_XX/env.py and what the mode writes beside
    it, or attempt_XX/builder_error.json when the builder gave nothing valid. A round already on disk is
    returned as it is (resume)."""
    folder = EnvDir(out_dir)
    adir = folder.attempt(rnd)
    if adir.env.is_file():
        return {"round": rnd, "env": str(adir.env), "origin": attempt_origin(adir)}
    if adir.builder_error.is_file():
        return {"round": rnd, "error": json.loads(adir.builder_error.read_text())["error"]}
    adir.root.mkdir(parents=True, exist_ok=True)
    try:
        module = BUILDERS[mode](builder, capability, target, list(examples), adir, feedback, previous,
                                [folder.attempt(r) for r in range(1, rnd)])
    except ValueError as err:
        if getattr(err, "reply", ""):
            atomic_write_text(adir.builder_reply, err.reply)  # what it wrote, for whoever reads the findings
        atomic_write_json(adir.builder_error, {"error": str(err)})
        return {"round": rnd, "error": str(err)}
    atomic_write_text(adir.env, module)
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
        **({"difficulty": by_pattern.attempt_level(adir)} if adir.difficulty.is_file() else {}),
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
