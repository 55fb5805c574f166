"""Real spec- or pattern-mode builds with an embedded model: four τ²-bench capabilities, each built and
verified (automatic checks in the Docker sandbox + the same model as LLM reviewer) for up to
--rounds rounds. Writes OUT/<capability>/attempt_XX/ (spec.json, env.py, verifier_report.json)
and OUT/summary.json, OUT/README.md.

    .venv/bin/python scripts/spec_builds.py --model qwen2.5-coder-1.5b --out docs/examples/spec-build/1.5b
    .venv/bin/python scripts/spec_builds.py --mode pattern --out docs/examples/pattern-build/qwen2.5-coder-1.5b
"""
import argparse
import json
import time
from pathlib import Path

from trace_rl.agents.builders import Target
from trace_rl.agents.env_builder import synthesize
from trace_rl.agents.verifier import VerifyConfig
from trace_rl.core.io import atomic_write_json, atomic_write_text
from trace_rl.models.llm import LLM, LLMConfig
from trace_rl.evals.benchmark import load_benchmark
from trace_rl.core.records import Capability

CAPABILITIES = [
    ("tau2:airline", "precondition_verification",
     "Checks the policy's preconditions with read tools (who the user is, the reservation's state, the "
     "eligibility rules) before calling a tool that changes the database. When a precondition fails it does "
     "not make the change and tells the user why."),
    ("tau2:retail", "multi_step_transaction_completion",
     "Carries a multi-step request through to the end: finds the user and the order, checks the order's status, "
     "then makes every change the request needs with the exact ids. Agents without it stop after the first "
     "lookup or act on the wrong order."),
    ("tau2:airline", "numerical_and_payment_reasoning",
     "Works out amounts from the records it looked up (prices, fees, refunds, balances) and uses a payment "
     "method the user really has, with enough balance. Agents without it quote wrong totals or pay with a "
     "method that is not on file."),
    ("tau2:telecom", "tool_call_precision",
     "Calls tools with exactly the argument names, types and ids that the schema and the looked-up records "
     "require, such as the customer's phone number or line id, instead of guessed or malformed arguments."),
]


def round_summary(adir: Path) -> dict:
    """One builder round: what code repaired, whether it verified, the findings that went back."""
    read = lambda n: json.loads((adir / n).read_text()) if (adir / n).is_file() else None  # noqa: E731
    report, error = read("verifier_report.json"), read("builder_error.json")
    return {"round": adir.name, "repairs": len(read("repairs.json") or []),
            "passed": bool(report and report["passed"]),
            "findings": (report["feedback"].split("\nCode already fixed")[0][:800] if report else None)
            if not (report and report["passed"]) else None,
            "builder_error": error["error"][:300] if error else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--mode", choices=["spec", "pattern"], default="spec", help="what the builder writes")
    ap.add_argument("--only", default=None, help="one capability name")
    ap.add_argument("--no-review", action="store_true", help="automatic checks only (no LLM review): cheaper on a CPU")
    args = ap.parse_args()
    out = Path(args.out)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    for bench_name, name, description in CAPABILITIES:
        if (args.only and name != args.only) or name in summary:
            continue
        target = Target.of(load_benchmark(bench_name))
        llm = LLM(LLMConfig(model=args.model, max_tokens=args.max_tokens, temperature=0.3))
        t0 = time.perf_counter()
        record = synthesize(Capability(name=name, description=description), target, llm, out / name,
                            max_rounds=args.rounds, mode=args.mode, reviewer=None if args.no_review else llm,
                            cfg=VerifyConfig(), log=print)
        u = llm.usage
        summary[name] = {"target": bench_name, "mode": args.mode, "status": record.status, "rounds": record.rounds,
                         "review": not args.no_review,
                         "wall_seconds": round(time.perf_counter() - t0), "calls": u.calls,
                         "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                         "per_round": [round_summary(a) for a in sorted((out / name).glob("attempt_*"))]}
        atomic_write_json(out / "summary.json", summary)
        print(f"{name}: {record.status} after {record.rounds} round(s), {summary[name]['wall_seconds']} s")
    rows = [f"| {n} | {s['target']} | {s['status']} | {s['rounds']} | "
            f"{', '.join(str(r['repairs']) for r in s.get('per_round', []))} | {s['wall_seconds']} | "
            f"{s['prompt_tokens']}+{s['completion_tokens']} |" for n, s in summary.items()]
    atomic_write_text(out / "README.md", f"# {args.mode.capitalize()}-mode builds with {args.model}\n\n"
                      f"`.venv/bin/python scripts/spec_builds.py --mode {args.mode} --model {args.model} --out {out}` "
                      f"(up to {args.rounds} rounds; automatic checks in the Docker sandbox"
                      + ("" if args.no_review else " and the same model as LLM reviewer") + "; no calibration)"
                      "\n\n| capability | target | outcome | rounds | code repairs per round | wall s | "
                      "tokens |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
