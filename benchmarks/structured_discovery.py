"""Discovery on the engine's server, three arms side by side on one run's real rollouts: no help, the
schema prefix (models/engine_server.schema_prefix), and the grammar (models/grammar.py, xgrammar). Does the
analyst's structured call come back as valid candidates, and after how many attempts?

    python benchmarks/structured_discovery.py RUN_DIR [--model qwen2.5-coder-0.5b] [--attempts 5]

RUN_DIR: a run with iter_0/rollouts and iter_0/analysis/facts.json (e.g. the GPU proof run's
phase A, docs/examples/gpu). Each arm calls agents.analyst.discover exactly as the analyse stage
does (same messages, same retries with the validation error), against an in-process server.
"""
import argparse
import json
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from trace_rl.agents.analyst import AnalystError, discover
from trace_rl.models.chat import StructuredOutputError
from trace_rl.models.llm import LLM, LLMConfig
from trace_rl.models.endpoints import free_port
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.core.rundir import RunDir
from trace_rl.graph.config import load_saved_config
from trace_rl.models import engine_server as serve, grammar
from trace_rl.models.hf_policy import HFPolicy


ARMS = {"no prefix, no grammar": "none", "schema prefix": "prefix", "grammar (xgrammar)": "grammar"}


def arm(policy, name: str, mode: str, trajs, run_cfg, facts, attempts: int) -> dict:
    real, real_available = serve.schema_prefix, grammar.available
    serve.schema_prefix = real if mode == "prefix" else (lambda rf: "")
    grammar.available = real_available if mode == "grammar" else (lambda: False)
    port = free_port()
    httpd = serve.Server(("127.0.0.1", port), serve.make_handler(policy, name))
    grammar.available = real_available
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    llm = LLM(LLMConfig(model=name, base_url=f"http://127.0.0.1:{port}/v1", max_tokens=run_cfg.analyst.max_tokens,
                        temperature=run_cfg.analyst.temperature, retries=0))
    calls, t0, outcome = [], time.perf_counter(), ""
    real_complete = llm._complete
    llm._complete = lambda *a, **kw: calls.append(1) or real_complete(*a, **kw)
    try:
        caps = discover(llm, trajs, run_cfg.analysis, attempts=attempts, facts=facts)
        outcome = "valid: " + ", ".join(c.name for c in caps)
    except (AnalystError, StructuredOutputError) as err:  # no valid answer: what the stage reports
        outcome = f"{type(err).__name__}: {str(err).splitlines()[-2][:60]} | last reply: " \
                  f"{' '.join(str(getattr(err, 'reply', '')).split())[:150]}"
    finally:
        httpd.shutdown()
        serve.schema_prefix = real
    return {"calls": len(calls), "seconds": time.perf_counter() - t0, "outcome": outcome}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--attempts", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--arms", nargs="+", default=list(ARMS.values()), choices=list(ARMS.values()))
    args = ap.parse_args()
    run = RunDir(args.run_dir)
    run_cfg = load_saved_config(run)
    trajs = TrajectoryStore(run.rollouts()).all()
    facts = json.loads(run.analysis().facts.read_text())
    policy = HFPolicy.load(args.model, rows=2, max_len=args.max_len)
    rows = {label: arm(policy, args.model, mode, trajs, run_cfg, facts, args.attempts) for label, mode in ARMS.items()
            if mode in args.arms}
    table = Table(title=f"discovery on the engine server: {args.model}, {len(trajs)} trajectories, "
                        f"up to {args.attempts} attempts")
    for col in ("arm", "calls", "seconds", "outcome"):
        table.add_column(col)
    for label, r in rows.items():
        table.add_row(label, str(r["calls"]), f"{r['seconds']:.0f}", r["outcome"])
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
