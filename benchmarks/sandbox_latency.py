"""Sandboxed vs in-process environment: warm step latency and episode throughput.

Runs the reference environment's solver episodes both ways, side by side, and prints a
table. Target: warm per-step overhead of the sandbox under 5 ms.
    .venv/bin/python benchmarks/sandbox_latency.py [--episodes 200] [--backend docker|subprocess] [--starts 5]
"""
import argparse
import statistics
import sys
import importlib
import time
from importlib import resources

from rich.console import Console
from rich.table import Table

from trace_rl.sandbox.session import open_session


def in_process_env(code: str):
    """Trusted, hand-written reference code only: the baseline of the comparison."""
    sys.path.insert(0, str(resources.files("trace_rl.sandbox") / "image"))
    sys.modules.setdefault("reward", importlib.import_module("trace_rl.core.reward"))  # what the image copies in
    ns: dict = {"__name__": "bench_env"}
    exec(compile(code, "env.py", "exec"), ns)
    return ns["Env"]()


def episodes(call, n: int) -> tuple[list[float], float]:
    """`n` solver episodes through `call(method, *args)`: (seconds per step, wall seconds)."""
    steps, t0 = [], time.perf_counter()
    for seed in range(n):
        call("reset", seed)
        for action in call("solve"):
            t = time.perf_counter()
            out = call("step", action)
            steps.append(time.perf_counter() - t)
            if out["done"]:
                break
        call("reward")
    return steps, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--backend", default="docker", choices=["docker", "subprocess"])
    ap.add_argument("--starts", type=int, default=5, help="cold starts (open, load, close) timed")
    args = ap.parse_args()
    code = (resources.files("trace_rl.sandbox") / "envs" / "precondition_verification_airline.py").read_text()
    colds = []
    for _ in range(args.starts):
        t = time.perf_counter()
        session = open_session(backend=args.backend, verified=True)  # a shipped, hand-written env
        session.load(code)
        colds.append(time.perf_counter() - t)
        session.close()
    cold = statistics.median(colds)
    session = open_session(backend=args.backend, verified=True)  # a shipped, hand-written env
    session.load(code)
    episodes(session.call, 5)  # warm-up
    env = in_process_env(code)
    rows = {"in-process": episodes(lambda method, *a: getattr(env, method)(*a), args.episodes),
            f"sandbox ({args.backend}, warm)": episodes(session.call, args.episodes)}
    session.close()
    table = Table("backend", "step p50 (ms)", "step p95 (ms)", "episodes/s", title=f"{args.episodes} solver episodes, {args.backend}")
    for name, (steps, wall) in rows.items():
        q = statistics.quantiles(steps, n=20)
        table.add_row(name, f"{statistics.median(steps) * 1e3:.3f}", f"{q[18] * 1e3:.3f}", f"{args.episodes / wall:.1f}")
    Console().print(table)
    over = statistics.median(rows[f"sandbox ({args.backend}, warm)"][0]) - statistics.median(rows["in-process"][0])
    Console().print(f"warm per-step overhead: {over * 1e3:.2f} ms (target < 5 ms); cold session start (median of {args.starts}) {cold:.2f} s")


if __name__ == "__main__":
    main()
