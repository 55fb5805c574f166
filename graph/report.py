"""The run report: what each stage produced, substituted or skipped, in words, plus the final
table. One reader of the typed records for report.json/report.md, `trace-rl status` and the web page."""
from __future__ import annotations

import json
from pathlib import Path

from trace_rl.agents.builders.pattern import attempt_level
from trace_rl.core.io import atomic_write_json, atomic_write_text
from trace_rl.core.records import PATTERN_NOTE, AdapterRecord, CapabilityRecord, EnvRecord
from trace_rl.core.rundir import Attempt, RunDir

# graph nodes whose wall time a stage row sums
STAGE_NODES = {"synthesise": ["synthesise", "approve_env"], "analyse": ["analyse", "select"]}
CAPABILITY_COLUMNS = ("name", "description", "cov_mean", "delta_mean", "runs_passed", "n_runs", "kept",
                      "below_threshold", "status", "reason")


def row_notes(s: dict) -> dict[str, str]:
    """Why an evaluation row is not a result of its own: {mode: note}."""
    adapters: dict[str, AdapterRecord] = s.get("adapters") or {}
    untrained = [k for k, v in adapters.items() if v.untrained]
    notes = {}
    if not s.get("composition"):
        why = (f"no trained adapter ({', '.join(untrained)}: weights never changed)" if untrained
               else "no adapter was trained")
        notes.update({"moe": f"moe = base: {why}", "router": f"router = base: {why}"})
    elif why := s.get("gates_untrained"):
        notes["moe"] = f"moe = base: gates untrained ({why if isinstance(why, str) else 'no example to train them on'})"
    elif s.get("gates"):
        notes["moe"] = s["gates"]
    routes = ((s.get("results") or {}).get("router") or {}).get("routes")
    if routes and set(routes) == {"base"}:
        notes["router"] = "router = base: the classifier sent every task to the base"
    for v in adapters.values():
        if v.substitute:
            notes[v.trained_on.name] = f"trained on a substitute: {v.substitute}"
    return notes


def verifier_report(env_path: str) -> dict | None:
    """The verifier's report written beside an environment module, None where there is none."""
    path = Attempt(Path(env_path).parent).verifier_report
    return json.loads(path.read_text()) if path.is_file() else None


def calibration_note(env: EnvRecord, run_dir: Path | None) -> str:
    """The synthesise row's word on calibration: off (the verifier's report has none), or unknown
    where that report is gone or unreadable."""
    if not env.env or env.substitute:  # a library env was verified where it was written: nothing to say
        return ""
    path = RunDir(run_dir).here(env.env) if run_dir is not None else env.env
    try:
        report = verifier_report(path)
    except (OSError, ValueError):
        report = None
    if not isinstance(report, dict):
        return "; calibration unknown (no verifier report at the recorded path)"
    return "" if report.get("calibration") is not None else "; not calibrated (calibrate is off)"


def pattern_level(env: EnvRecord, run_dir: Path | None) -> str:
    """", difficulty N" where a pattern-built env was expanded above level 1 (a calibration found the first
    too easy), else nothing: the reader of the table sees the env is not the pattern as first written."""
    path = RunDir(run_dir).here(env.env) if run_dir is not None and env.env else env.env
    try:
        level = attempt_level(Attempt(Path(path).parent)) if path else 1
    except (OSError, ValueError):  # a damaged difficulty.json (RunDirError): the row goes without its level
        return ""
    return f", difficulty {level}" if level > 1 else ""


def stage_summary(s: dict, run_dir: Path | None = None) -> list[dict]:
    """What each stage produced, substituted or skipped, in words: the report's first table.
    `run_dir`: where the state's recorded paths are looked for when the run moved machines."""
    rows = []
    figs = (s.get("rollout_figures") or [{}])[-1]
    if figs:
        rows.append({"stage": "rollout", "outcome": "produced",
                     "detail": f"{figs['episodes']} episodes of {figs['model']}, {figs['passed']} passed"})
    caps: list[CapabilityRecord] = s.get("capabilities") or []
    analysis = s.get("analysis") or {}
    runs = analysis.get("labelling_runs") or []
    unl = ", ".join(f"{r['unlabelled']}/{r['pairs']}" + (f" (+{r['unverified']} unverified)" if r.get("unverified")
                                                        else "") + ("" if r["reliable"] else " unreliable") for r in runs)
    hollow = analysis.get("hollow") or []
    kept = [c.name for c in caps if c.kept]
    forced = [c.name for c in caps if c.below_threshold]
    if caps:
        rows.append({"stage": "analyse", "outcome": "produced" if kept else "substituted" if forced else "nothing kept",
                     "detail": f"{len(caps)} candidates, kept: {', '.join(kept) or 'none'}"
                               + (f"; trained below threshold (train_unkept): {', '.join(forced)}" if forced else "")
                               + (f"; unlabelled pairs per run: {unl}" if unl else "")
                               + (f"; {len(hollow)} hollow episodes left out (the user simulator ended them "
                                  "before the agent acted)" if hollow else "")
                               + (f"; {analysis['no_contrast']}" if analysis.get("no_contrast") else "")
                               + (f"; contrast split by {(analysis.get('contrast') or {})['rule']}: "
                                  f"{analysis['contrast']['why']}"
                                  if (analysis.get("contrast") or {}).get("rule", "passed") != "passed" else "")})
    env: EnvRecord
    for name, env in (s.get("envs") or {}).items():
        outcome = "substituted" if env.substitute else "produced" if env.status == "verified" else env.status
        rows.append({"stage": "synthesise", "outcome": outcome, "detail": f"{name}: " + (
            env.substitute or env.reason or f"{env.status} after {env.rounds} builder round(s)") + (
            f"; {PATTERN_NOTE} ({env.source.split(':', 1)[1]}{pattern_level(env, run_dir)})"
            if env.source.startswith("pattern:") else "") + calibration_note(env, run_dir)})
    a: AdapterRecord
    for cap, a in (s.get("adapters") or {}).items():
        held = f", held-out success {a.before.success:.0%} → {a.after.success:.0%}" if a.before and a.after else ""
        if a.before and a.before.success >= 1.0:  # GRPO had nothing to teach
            held += (f" (the base, decoding greedily, already passed all {a.before.episodes} held-out seeds: they "
                     "cannot show a gain; calibration samples at the agent's temperature)")
        source = getattr((s.get("envs") or {}).get(cap), "source", "")
        rows.append({"stage": "train", "outcome": "untrained" if a.untrained else "produced",
                     "detail": f"{a.trained_on.name}: {a.steps} GRPO steps"
                               + (" (weights never changed)" if a.untrained else "") + held
                               + (f"; on a {PATTERN_NOTE.split(':')[0]} env" if source.startswith("pattern:") else "")})
    if (t := s.get("target_adapter")) is not None:
        rows.append({"stage": "baseline", "outcome": "untrained" if t.untrained else "produced",
                     "detail": f"GRPO on the target ({t.trained_on.description}): {t.steps} steps"
                               + (" (weights never changed)" if t.untrained else "")})
    if s.get("results") is not None:
        rows.append({"stage": "compose", "outcome": "skipped" if not s.get("composition") else
                     "gates untrained" if s.get("gates_untrained") else "produced",
                     "detail": row_notes(s).get("moe", s.get("composition") or "")})
    return rows


def report_data(s: dict, run_dir: Path, benchmark: str) -> dict:
    """report.json: the state's records as plain JSON, with the stage summary."""
    return {"run_dir": str(run_dir), "benchmark": benchmark, "iteration": s.get("iteration", 0),
            "rollouts": s.get("rollout_figures"),
            "capabilities": [c.model_dump(include=set(CAPABILITY_COLUMNS)) for c in s.get("capabilities") or []],
            "analysis": s.get("analysis"),
            "environments": {k: v.model_dump() for k, v in (s.get("envs") or {}).items()},
            "adapters": {k: v.model_dump() for k, v in (s.get("adapters") or {}).items()},
            "composition": s.get("composition"), "gates_untrained": s.get("gates_untrained"), "gates": s.get("gates"),
            "target_adapter": (s.get("target_adapter") or None) and s["target_adapter"].model_dump(),
            "evaluation": s.get("results"), "stages": stage_summary(s, run_dir), "notes": row_notes(s),
            "timings": s.get("timings")}


def eval_note(r: dict, mode: str, figures: dict) -> str:
    """An evaluation row's note: why it is not a result of its own, and where the router sent the tasks."""
    routes = figures.get("routes")
    where = "routed: " + ", ".join(f"{m} {n}" for m, n in sorted(routes.items(), key=lambda x: -x[1])) if routes else ""
    return "; ".join(x for x in ((r.get("notes") or {}).get(mode, ""), where) if x)


EVAL_COLUMNS = ("mode", "backend", "tasks × trials", "pass@1", "95% CI", "passed", "mean reward (95% CI)", "note")


def evaluation_rows(r: dict) -> list[list[str]]:
    """The before/after table of a report (`report_data`'s evaluation and notes), one row per
    mode: report.md and `trace-rl status` print the same cells. `backend`: what produced the row (llama.cpp,
    vllm, engine; "–" in runs evaluated before rows recorded it)."""
    rows = []
    for mode, g in (r.get("evaluation") or {}).items():
        if "skipped" in g:
            rows.append([mode, "–", "–", "–", "–", "–", "–", f"not evaluated: {g['skipped']}"])
            continue
        rows.append([mode, g.get("backend") or "–", f"{g['tasks']} × {g.get('trials', 1)}", f"{g['pass@1']:.1%}",
                     f"{g['ci95'][0]:.0%}–{g['ci95'][1]:.0%}", f"{g['passed']}/{g['episodes']}",
                     f"{g['mean_reward']:.2f}" + (f" ({g['reward_ci95'][0]:.2f}–{g['reward_ci95'][1]:.2f})"
                                                  if g.get("reward_ci95") else ""), eval_note(r, mode, g)])
    return rows


def render_markdown(r: dict) -> str:
    lines = [f"# trace-rl run: {r['benchmark']}", "", "## What each stage produced", "",
             "| stage | outcome | detail |", "|---|---|---|"]
    lines += [f"| {x['stage']} | {x['outcome']} | {x['detail']} |" for x in r.get("stages") or []]
    lines += ["", "## Capabilities", "", "| capability | Cov | Δ | runs passed | kept | status | why not |",
              "|---|---|---|---|---|---|---|"]
    for c in r.get("capabilities") or []:
        kept = "yes" if c["kept"] else "no (trained anyway: train_unkept)" if c.get("below_threshold") else "no"
        lines.append(f"| {c['name']} | {c['cov_mean']:.2f} | {c['delta_mean']:+.2f} | {c['runs_passed']}/{c['n_runs']} | "
                     f"{kept} | {c['status']} | {c.get('reason') or ''} |")
    if rows := evaluation_rows(r):
        lines += ["", "## Evaluation", "", "| " + " | ".join(EVAL_COLUMNS) + " |", "|---" * len(EVAL_COLUMNS) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    transfer = {m: g["transfer"] for m, g in (r.get("evaluation") or {}).items() if g.get("transfer")}
    if transfer:  # lower is better: the failure each trained capability is about, measured by code
        modes = list(transfer)
        lines += ["", "## Capability transfer (share of episodes with the failure; lower is better)", "",
                  "| capability | measured by | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
        for cap, first in transfer[modes[0]].items():
            cells = [f"{transfer[m][cap]['rate']:.0%} ({transfer[m][cap]['ci95'][0]:.0%}–{transfer[m][cap]['ci95'][1]:.0%}"
                     f", n={transfer[m][cap]['episodes']})" if cap in transfer[m] else "–" for m in modes]
            lines.append(f"| {cap} | {first['metric']} | " + " | ".join(cells) + " |")
    lines += ["", "## Wall time per stage (s)", ""] + [f"- {k}: {v:.0f}" for k, v in (r.get("timings") or {}).items()]
    return "\n".join(lines) + "\n"


def write_run_report(s: dict, run_dir: Path, benchmark: str) -> dict:
    report = report_data(s, run_dir, benchmark)
    atomic_write_json(RunDir(run_dir).report_json, report)
    atomic_write_text(RunDir(run_dir).report_md, render_markdown(report))
    return report
