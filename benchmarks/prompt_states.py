"""τ²-bench rollouts on llama.cpp with and without saved prompt states (models/llama_server.PromptStates), and
with the solo ticket in the system prompt or after the tools (Tau2Options.ticket), side by side.

A pipeline stage starts its own llama.cpp server (rollout, then evaluation; a resumed or repeated run starts
new ones); without saved states each new server reads the domain's ~10k-token system prompt again, and in
upstream's layout each new task re-reads the ~4.6k tokens of tool schemas that follow its ticket. Each arm
runs two stages of E episodes, each on a fresh server, greedy (T=0). Arms of one layout must give identical
trajectories (checked); the after_tools arm is another prompt, so its episodes may take another course:
the table gives each stage's model turns per episode beside its time.
    .venv/bin/python benchmarks/prompt_states.py [--domain telecom] [--episodes 3] [--arms before,after_tools]
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from trace_rl.agents.base_agent import run_episode
from trace_rl.models.llm import LLM
from trace_rl.models.llama_server import LlamaServer
from trace_rl.evals.tau2_bench import Tau2Benchmark


# arm -> (where the solo ticket goes, saved prompt states)
ARMS = {"before": ("system", False), "states": ("system", True), "after_tools": ("after_tools", True)}


def stage(bench, split: str, n: int, model: str, states: Path | None, max_steps: int, max_tokens: int) -> dict:
    """One stage on a fresh server: n episodes of `split`; the first episode's time (it pays for the
    system prompt when nothing is restored) apart from the others'."""
    ids = [t.id for t in bench.tasks(split)][:n]
    with LlamaServer(model, n_ctx=16384, prompt_states=states) as srv:
        llm = LLM(model=srv.model_name, base_url=srv.base_url, api_key="x", max_tokens=max_tokens, temperature=0.0)
        times, trajs = [], []
        for tid in ids:
            t0 = time.perf_counter()
            trajs.append(run_episode(llm, bench.episode(tid), task_id=tid, benchmark=bench.name, max_steps=max_steps))
            times.append(time.perf_counter() - t0)
        restored = srv.log_path.read_text().count("trace-rl prompt state: restored")
    return {"split": split, "episodes": n, "wall_s": sum(times), "first_s": times[0],
            "others_s_per_episode": sum(times[1:]) / max(1, n - 1), "restored": restored,
            "prompt_tokens": llm.usage.prompt_tokens, "passed": sum(t.passed for t in trajs),
            "model_turns": sum(t.steps for t in trajs) / n, "terminations": sorted(t.termination for t in trajs),
            "turns": [turns(t.messages) for t in trajs]}


def turns(messages: list[dict]) -> list:
    """What the model saw and said, without the per-run tool-call ids."""
    return [(m["role"], m.get("content"), [(c["function"]["name"], c["function"]["arguments"])
                                           for c in m.get("tool_calls") or []]) for m in messages]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--domain", default="telecom")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--episodes", type=int, default=3, help="episodes per stage")
    ap.add_argument("--max-steps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    arms = {}
    for arm in args.arms.split(","):
        ticket, saved = ARMS[arm]
        bench = Tau2Benchmark(args.domain, ticket=ticket)
        with tempfile.TemporaryDirectory() as tmp:
            arms[arm] = [stage(bench, split, args.episodes, args.model, Path(tmp) if saved else None,
                               args.max_steps, args.max_tokens) for split in ("train", "test")]
    table = Table("arm", "stage", "episodes", "restored", "first episode s", "others s/episode", "stage s",
                  "episodes/min", "model turns / episode", "passed",
                  title=f"tau2:{args.domain}, {args.model} on llama.cpp, each stage on a fresh server, T=0")
    for arm, stages in arms.items():
        for s, name in zip(stages, ("1: rollout (train)", "2: evaluate (test)")):
            table.add_row(arm, name, str(s["episodes"]), str(s["restored"]), f"{s['first_s']:.0f}",
                          f"{s['others_s_per_episode']:.0f}", f"{s['wall_s']:.0f}",
                          f"{60 * s['episodes'] / s['wall_s']:.2f}", f"{s['model_turns']:.1f}", str(s["passed"]))
    console = Console()
    console.print(table)
    first, *rest = arms
    base = sum(s["wall_s"] for s in arms[first])
    same = {}
    for arm in rest:
        total = sum(s["wall_s"] for s in arms[arm])
        if ARMS[arm][0] == ARMS[first][0]:  # one prompt layout: the trajectories must match
            same[arm] = all(a["turns"] == b["turns"] for a, b in zip(arms[first], arms[arm]))
        console.print(f"{arm}: both stages {base:.0f} s -> {total:.0f} s ({base / total:.2f}x vs {first})"
                      + (f"; trajectories identical: {same[arm]}" if arm in same else "; another prompt layout"))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "identical": same,
                                         "arms": {a: [{k: v for k, v in s.items() if k != "turns"} for s in st]
                                                  for a, st in arms.items()}}, indent=1))


if __name__ == "__main__":
    main()
