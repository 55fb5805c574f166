"""rollout() locally vs executor=ray on 1, 2 and 3 simulated nodes (ray.cluster_utils.Cluster on this machine, one
`sandbox` and one CPU each): episodes/s and the per-episode dispatch overhead in ms.

Two envs from tests/support/ray_doubles.py, played by a scripted agent (no model): `cheap` (two steps of pure Python,
~1 ms of work) measures what dispatching costs; `waiting` (each step sleeps --wait-ms, as an episode waits on a
model endpoint or a container) shows what spreading episodes over nodes buys when an episode mostly waits. On a
machine of few cores the simulated nodes share them: the point is the overhead, not a speed-up.

    taskset -c 0 python benchmarks/ray_rollouts.py [--episodes 200] [--wait-ms 50] [--json results/ray_rollouts.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "tests" / "support"  # the doubles live there
sys.path.insert(0, str(SUPPORT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))  # nodes too
NODE = {"num_cpus": 1, "resources": {"sandbox": 1}, "object_store_memory": 100 * 2**20}


def timed(bench, n: int, **kw) -> float:
    """Seconds for one rollout of n episodes into a fresh store."""
    from ray_doubles import letters_agent
    from trace_rl.core.trajectory import TrajectoryStore
    from trace_rl.evals.rollout import rollout

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        trajs = rollout(bench, letters_agent(), [str(i) for i in range(n)], TrajectoryStore(d), progress=False, **kw)
        seconds = time.perf_counter() - t0
    assert len(trajs) == n and all(t.termination == "agent_stop" for t in trajs)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=200, help="episodes of the cheap env per setting")
    ap.add_argument("--waiting-episodes", type=int, default=60, help="episodes of the waiting env per setting")
    ap.add_argument("--wait-ms", type=float, default=50.0, help="the waiting env's sleep per step (2 steps/episode)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster
    from ray_doubles import SlowLetters

    cheap, waiting = SlowLetters(args.episodes), SlowLetters(args.waiting_episodes, args.wait_ms / 1000)
    rows = []

    def row(setting: str, nodes: int, **kw) -> None:
        timed(cheap, 6, **kw)  # warm: worker processes started, the benchmark built on each
        c = timed(cheap, args.episodes, **kw)
        w = timed(waiting, args.waiting_episodes, **kw)
        rows.append({"setting": setting, "nodes": nodes, "cheap_eps": args.episodes / c,
                     "cheap_ms": 1000 * c / args.episodes, "waiting_eps": args.waiting_episodes / w})
        print(f"  {setting}: {rows[-1]['cheap_eps']:.1f} cheap eps/s, {rows[-1]['waiting_eps']:.1f} waiting eps/s",
              file=sys.stderr, flush=True)

    row("local, 1 thread", 0, concurrency=1)
    row("local, 3 threads", 0, concurrency=3)
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        start_s = time.perf_counter() - t0
        for nodes in (1, 2, 3):
            if nodes > 1:
                cluster.add_node(**NODE)
                cluster.wait_for_nodes()
            row(f"ray, {nodes} node{'s' * (nodes > 1)}", nodes, executor="ray")
        # one episode at a time: the round trip of one task (submit, schedule, play, return, store)
        one = [timed(cheap, 1, executor="ray") for _ in range(20)]
        local_one = [timed(cheap, 1) for _ in range(20)]
    finally:
        ray.shutdown()
        cluster.shutdown()

    base = rows[0]["cheap_ms"]
    for r in rows:
        r["overhead_ms"] = r["cheap_ms"] - base
    from rich.console import Console
    from rich.table import Table

    table = Table("setting", "cheap env eps/s", "ms / episode", "dispatch overhead ms / episode",
                  f"waiting env ({2 * args.wait_ms:g} ms/episode) eps/s",
                  title=f"rollout(): local vs executor=ray, {os.cpu_count()} cores visible, "
                        f"{len(os.sched_getaffinity(0))} usable")
    for r in rows:
        table.add_row(r["setting"], f"{r['cheap_eps']:.1f}", f"{r['cheap_ms']:.2f}",
                      "-" if not r["nodes"] else f"{r['overhead_ms']:.2f}", f"{r['waiting_eps']:.1f}")
    Console().print(table)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    extra = {"round_trip_ms": 1000 * median(one), "local_one_ms": 1000 * median(local_one),
             "cluster_start_s": start_s}
    print(f"one episode at a time (median of 20 rollouts of 1 episode): ray {extra['round_trip_ms']:.1f} ms, "
          f"local {extra['local_one_ms']:.1f} ms; starting the head node: {start_s:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, **extra}, indent=1))


if __name__ == "__main__":
    main()
