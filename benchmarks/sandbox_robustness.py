"""Hostile modules vs the session: how long until a flooding module's reply is cut, and how
long `close()` takes, for the misbehaving modules in tests/support/envs/ (target: both <= 2 s).
    .venv/bin/python benchmarks/sandbox_robustness.py [--repeats 3]
"""
import argparse
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trace_rl.sandbox.session import EnvSession, SandboxError, SessionLimits

ENVS = Path(__file__).resolve().parents[1] / "tests" / "support" / "envs"
CASES = {  # module -> what the host does
    "huge_reply": "50 MB with no newline on the protocol channel: cut at the reply cap",
    "flood_protocol": "garbage on the protocol channel from a thread, forever",
    "hang_on_seed": "reset(3) never returns: the call times out (call_timeout_s = 2)",
}


def one(name: str, limits: SessionLimits) -> tuple[float, float, str]:
    code = (ENVS / "sound.py").read_text() + "\n\n" + (ENVS / "misbehaving" / f"{name}.py").read_text()
    s = EnvSession(limits)
    s.load(code)
    t0 = time.perf_counter()
    kind = "none"
    try:
        s.call("reset", 3)
        s.call("step", {"content": "aaaa"})  # a flood may land after the first reply: the next one meets it
    except SandboxError as err:
        kind = err.kind
    cut = time.perf_counter() - t0  # includes the close() that a failure runs
    t1 = time.perf_counter()
    s.close()  # already closed by the failure: what a caller's close costs afterwards
    return cut, time.perf_counter() - t1, kind


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    limits = SessionLimits(call_timeout_s=2.0)
    table = Table("module", "what it does", "error kind", "failure → session gone, s (median)", "close after, s",
                  title=f"sandbox robustness ({args.repeats} repeats each; target ≤ 2 s, timeout case: 2 s + close)")
    for name, what in CASES.items():
        runs = [one(name, limits) for _ in range(args.repeats)]
        table.add_row(name, what, runs[0][2], f"{statistics.median(r[0] for r in runs):.2f}",
                      f"{statistics.median(r[1] for r in runs):.3f}")
    Console(width=170).print(table)


if __name__ == "__main__":
    main()
