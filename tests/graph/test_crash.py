"""SIGKILL at random wall-clock moments, not only at node boundaries: a doubles-driven run
killed, its resume killed too, then resumed to the end must match an uninterrupted run in
final state, trajectory stores and report."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_graph import PYTHONPATH, summary
from paths import SUPPORT

pytestmark = [pytest.mark.docker]
CODE = ("import sys, json; from graph_doubles import config; from trace_rl.graph.pipeline import drive\n"
        "r = drive(sys.argv[1], config(), resume=sys.argv[2] == '1', log=lambda *a: None)\n"
        "print('STATUS', r['status'])")


def start(run: Path, resume: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    env.pop("TRACE_RL_KILL_AT", None)
    return subprocess.Popen([sys.executable, "-c", CODE, str(run), "1" if resume else "0"], cwd=SUPPORT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stores(run: Path) -> dict:
    """Each store's episode keys; a key twice (or a line that is not an episode) fails the test."""
    out = {}
    for p in sorted(run.rglob("trajectories.jsonl")):
        if "stale" in p.parts:
            continue
        keys = [json.loads(l)["task_id"] + "/" + str(json.loads(l)["trial"]) for l in p.read_text().splitlines()]
        assert len(keys) == len(set(keys)), f"{p}: an episode stored twice"
        out[str(p.parent.relative_to(run))] = sorted(keys)
    return out


def report(run: Path) -> dict:
    """report.json without wall times (the only thing a kill may change)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("timings", "run_dir", "seconds")}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(json.loads((run / "report.json").read_text().replace(str(run), "RUN")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, sandbox_image):
    run = tmp_path_factory.mktemp("uninterrupted")
    t0 = time.monotonic()
    p = start(run, resume=False)
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0 and "STATUS done" in out, err[-3000:]
    from graph_doubles import config
    from trace_rl.graph.pipeline import THREAD, compiled

    app = compiled(run, config())
    return run, time.monotonic() - t0, summary(app.get_state(THREAD).values)


@pytest.mark.parametrize("seed", range(int(os.environ.get("CRASH_SEEDS", "5"))))
def test_random_sigkills_then_resume_match_an_uninterrupted_run(tmp_path, uninterrupted, seed):
    ref, wall, ref_summary = uninterrupted
    rng = random.Random(seed)
    run = tmp_path / "run"
    for resume in (False, True):  # kill the first run, then kill its resume as well
        p = start(run, resume)
        try:
            p.wait(timeout=rng.uniform(0.1, 0.9) * wall)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    p = start(run, resume=True)
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0 and "STATUS done" in out, err[-3000:]
    from graph_doubles import config
    from trace_rl.graph.pipeline import THREAD, compiled

    app = compiled(run, config())
    got = summary(app.get_state(THREAD).values)
    assert got == ref_summary, differences(got, ref_summary)
    assert stores(run) == stores(ref), differences(stores(run), stores(ref))
    assert report(run) == report(ref), differences(report(run), report(ref))


def differences(got, want, path: str = "") -> str:
    """Where two nested values differ, for the failure message (a flaky seed must say why)."""
    if isinstance(got, dict) and isinstance(want, dict):
        return "; ".join(d for k in sorted(set(got) | set(want), key=str)
                         if (d := differences(got.get(k), want.get(k), f"{path}.{k}"))) if got != want else ""
    return "" if got == want else f"{path or '.'}: {str(got)[:200]} != {str(want)[:200]}"
