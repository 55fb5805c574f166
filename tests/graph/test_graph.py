"""The pipeline graph on scripted LLMs and tiny models: full path, verify→build loop, a
rejected environment, kill-and-resume at every node, the autonomous loop, config errors."""
import json
import re
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from graph_doubles import config
from trace_rl.graph.config import ConfigError, load_config
from trace_rl.graph.approvals import record_decision
from trace_rl.graph.pipeline import drive
from paths import SUPPORT

pytestmark = [pytest.mark.docker]
PYTHONPATH = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))  # children import what we do


def summary(state: dict) -> dict:
    """The parts of a final state that must not depend on how the run got there."""
    return {"envs": {k: v.model_dump(include={"status", "rounds", "source", "approved"}) for k, v in state["envs"].items()},
            "adapters": {k: {"steps": v.steps, "before": v.before.episodes, "after": v.after.episodes}
                         for k, v in state["adapters"].items()},
            "capabilities": [(c.name, c.kept, c.status) for c in state["capabilities"]],
            "results": {m: (r.get("passed"), r.get("episodes"), r.get("skipped")) for m, r in (state.get("results") or {}).items()},
            "composition": bool(state.get("composition")), "selected": state.get("selected")}


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def work_done(run: Path) -> dict:
    """Episodes stored anywhere in the run (each stored once) and LLM calls made."""
    stores = {str(p.relative_to(run)): lines(p) for p in run.rglob("trajectories.jsonl")}
    return {"episodes": stores, "calls": dict(Counter((run / "calls.log").read_text().split()))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, sandbox_image):
    run = tmp_path_factory.mktemp("reference")
    os.environ["TRACE_RL_CALL_LOG"] = str(run / "calls.log")
    try:
        result = drive(run, config(), resume=False, log=lambda *a: None)
    finally:
        del os.environ["TRACE_RL_CALL_LOG"]
    assert result["status"] == "done"
    return run, result["state"]


def test_full_path_keeps_the_planted_capability_and_loops_verify_to_build(reference):
    run, state = reference
    s = summary(state)
    assert s["capabilities"] == [("lookup_before_answering", True, "APPROVED"), ("polite_reply_style", False, "REJECTED")]
    assert s["envs"] == {"lookup_before_answering": {"status": "verified", "rounds": 2, "source": "builder", "approved": True}}
    r1 = json.loads((run / "envs/lookup_before_answering/attempt_01/verifier_report.json").read_text())
    assert not r1["passed"] and "trivial_do_nothing" in r1["feedback"]  # round 1 (reward always 1) failed, went back
    assert s["adapters"]["lookup_before_answering"]["steps"] == 2
    assert state["analysis"]["contrast"]["rule"] == "passed"  # which split the analysis ran reaches the report
    assert set(s["results"]) == {"base", "lookup_before_answering", "router", "moe"} and s["composition"]
    routes = state["results"]["router"]["routes"]  # what the router row ran, per episode
    assert set(routes) <= {"base", "lookup_before_answering"} and sum(routes.values()) == state["results"]["router"]["episodes"]
    assert "routed: " in (run / "report.md").read_text()
    for f in ("report.json", "report.md", "iter_0/eval/report.png", "iter_0/analysis/cov_delta.png",
              "train/lookup_before_answering/grpo/curve.png", "composition/moe.pt", "config.json"):
        assert (run / f).is_file(), f
    report = json.loads((run / "report.json").read_text())
    assert set(report["timings"]) >= {"rollout", "analyse", "synthesise", "train", "compose", "evaluate"}
    assert "| lookup_before_answering |" in (run / "report.md").read_text()
    synth = next(r for r in report["stages"] if r["stage"] == "synthesise")
    assert synth["detail"].endswith("not calibrated (calibrate is off)")  # the doubles' config turns it off
    transfer = state["results"]["base"]["transfer"]["lookup_before_answering"]  # measured by code on every row
    assert transfer["episodes"] == state["results"]["base"]["episodes"] and 0 <= transfer["rate"] <= 1
    assert "## Capability transfer" in (run / "report.md").read_text()
    facts = json.loads((run / "iter_0/analysis/facts.json").read_text())
    assert len(facts) == 12 and all("write_without_read" in f for f in facts.values())


def _run(run: Path, resume: bool, kill: str | None = None) -> subprocess.CompletedProcess:
    code = ("import sys, json; from graph_doubles import config; from trace_rl.graph.pipeline import drive\n"
            f"r = drive({str(run)!r}, config(), resume={resume}, log=lambda *a: None)\n"
            "print('STATUS', r['status'])")
    env = {**os.environ, "TRACE_RL_CALL_LOG": str(run / "calls.log"), "PYTHONPATH": PYTHONPATH}
    env.pop("TRACE_RL_KILL_AT", None)
    if kill:
        env["TRACE_RL_KILL_AT"] = kill
    return subprocess.run([sys.executable, "-c", code], cwd=SUPPORT, env=env, capture_output=True, text=True, timeout=600)


KILL_POINTS = ["rollout", "analyse", "select", "next_capability", "synthesise", "approve_env", "train", "compose",
               "evaluate", "report"]


@pytest.mark.parametrize("node", KILL_POINTS)
def test_killed_at_any_node_resumes_to_the_same_end_without_redoing_work(tmp_path, reference, node):
    ref_run, ref_state = reference
    killed = _run(tmp_path, resume=False, kill=node)
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL after the node's work, before its checkpoint
    resumed = _run(tmp_path, resume=True)
    assert resumed.returncode == 0 and "STATUS done" in resumed.stdout, resumed.stderr[-3000:]
    from trace_rl.graph.pipeline import THREAD, compiled

    app = compiled(tmp_path, config())
    assert summary(app.get_state(THREAD).values) == summary(ref_state)
    assert work_done(tmp_path) == work_done(ref_run)  # no episode stored twice, no LLM call paid twice


def test_a_rejected_environment_is_not_trained(tmp_path, sandbox_image):
    cfg = config(auto_approve=False, approvals=["environments"])
    out = drive(tmp_path, cfg, resume=False, wait=False, log=lambda *a: None)
    assert out["status"] == "waiting" and out["pending"]["kind"] == "environment"
    assert out["pending"]["env"]["status"] == "verified"
    record_decision(tmp_path, out["pending"]["id"], {"action": "reject", "reason": "reward too lenient"})
    done = drive(tmp_path, cfg, resume=True, wait=False, log=lambda *a: None)
    st = done["state"]
    assert done["status"] == "done" and st["envs"]["lookup_before_answering"].status == "rejected"
    assert st["envs"]["lookup_before_answering"].reason == "reward too lenient"
    assert not st.get("adapters") and not st.get("composition") and (tmp_path / "report.json").is_file()
    assert not (tmp_path / "train").exists()


def test_every_environment_is_built_before_any_is_trained(tmp_path, sandbox_image):
    """Two capabilities (train_unkept=2 adds the unkept one): both environments are built and
    approved before the first training (the Docker machine's part, then the GPU's), in build order."""
    logged = []
    st = drive(tmp_path, config(train_unkept=2), resume=False, log=logged.append)["state"]
    nodes = [m[1:-len("] start")] for m in logged if m.startswith("[") and m.endswith("] start")]
    assert "train" in nodes  # a node interrupted for an approval starts again: count no visits
    assert max(i for i, n in enumerate(nodes) if n in ("synthesise", "approve_env")) < nodes.index("train")
    assert list(st["envs"]) == list(st["adapters"]) == ["lookup_before_answering", "polite_reply_style"]
    assert all(e.status == "verified" and e.approved for e in st["envs"].values())


def test_until_train_stops_with_every_environment_approved_and_nothing_trained(tmp_path, sandbox_image):
    """The Docker machine's part: both environments asked for in turn (no training in between), then
    a stop before train; a resume without `until` (the GPU machine's part) trains both."""
    names = ["lookup_before_answering", "polite_reply_style"]
    cfg = config(train_unkept=2, auto_approve=False, approvals=["environments"])
    go = lambda **kw: drive(tmp_path, cfg, resume=True, wait=False, log=lambda *a: None, **kw)  # noqa: E731
    for name in names:  # an approval before the breakpoint is asked as without one
        out = go(until="train")
        assert out["status"] == "waiting" and out["pending"]["capability"]["name"] == name
        record_decision(tmp_path, out["pending"]["id"], {"action": "approve"})
    out = go(until="train")
    assert out["status"] == "stopped" and out["before"] == "train"
    st = out["state"]
    assert list(st["envs"]) == names and all(e.status == "verified" and e.approved for e in st["envs"].values())
    assert all(Path(st["envs"][n].env).is_file() and (tmp_path / "envs" / n) in Path(st["envs"][n].env).parents
               for n in names)
    assert not st.get("adapters") and not (tmp_path / "train").exists()
    assert go(until="train")["status"] == "stopped" and not (tmp_path / "train").exists()  # asked again: stays
    # the GPU machine's part, elsewhere: the run packed, unpacked under another path, the original gone
    from trace_rl.core.rundir import RunDir, unpack

    RunDir(tmp_path).pack(tmp_path.parent / f"{tmp_path.name}-parts")
    moved = unpack(tmp_path.parent / f"{tmp_path.name}-parts", tmp_path.parent / f"{tmp_path.name}-gpu")
    shutil.rmtree(tmp_path)
    done = drive(moved, cfg, resume=True, wait=False, log=lambda *a: None)
    assert done["status"] == "done" and list(done["state"]["adapters"]) == names
    assert all((moved / "train" / n / "grpo" / "adapter").is_dir() for n in names)


def test_capability_approval_can_reject_a_capability(tmp_path, sandbox_image):
    cfg = config(auto_approve=False, approvals=["capabilities"])
    out = drive(tmp_path, cfg, resume=False, wait=False, log=lambda *a: None)
    assert out["pending"]["kind"] == "capabilities"
    assert [c["name"] for c in out["pending"]["items"]] == ["lookup_before_answering"]
    record_decision(tmp_path, out["pending"]["id"], {"approve": [], "reject": {"lookup_before_answering": "not now"}})
    st = drive(tmp_path, cfg, resume=True, wait=False, log=lambda *a: None)["state"]
    assert [c.status for c in st["capabilities"]] == ["REJECTED", "REJECTED"] and not st.get("envs")
    saved = json.loads((tmp_path / "iter_0/analysis/capabilities.json").read_text())["capabilities"]
    assert saved[0]["status"] == "REJECTED"


def test_autonomous_loop_rolls_out_the_composed_model_and_stops_when_nothing_new(tmp_path, sandbox_image):
    st = drive(tmp_path, config(loop={"enabled": True, "max_iterations": 3}), resume=False, log=lambda *a: None)["state"]
    assert st["iteration"] == 1 and [f["model"] for f in st["rollout_figures"]] == ["scripted-agent", "composed:moe"]
    assert st["selected"] == 0  # the second analysis found nothing new to train: the loop ended
    assert (tmp_path / "iter_1/analysis/capabilities.json").is_file()


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("benchmark: tau2:telecom\ngrpo:\n  group_size: 1\nanalysis:\n  k: 12\nbuild_roundz: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    msg = str(err.value)
    assert msg.startswith(f"{bad}: invalid run configuration")  # the file is named, not "config"
    assert "grpo.group_size" in msg and "greater than or equal to 2" in msg
    assert "analysis.k" in msg and "build_roundz: unknown field" in msg
    with pytest.raises(ConfigError, match="benchmark: unknown benchmark 'nope:x'"):
        load_config(overrides={"benchmark": "nope:x"})
    with pytest.raises(ConfigError, match="eval_split: tau2:telecom has no split 'dev'"):
        load_config(overrides={"eval_split": "dev"})
    toml = tmp_path / "run.toml"
    toml.write_text('benchmark = "tau2:airline"\n[grpo]\ngroup_size = 8\n')
    cfg = load_config(toml, preset="demo")
    assert cfg.benchmark == "tau2:airline" and cfg.grpo.group_size == 8 and cfg.rollout_tasks == 9
    assert cfg.benchmark_options == {}  # the preset's options belong to the benchmark the file replaced
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(preset="fast")


def test_cli_run_status_approve_resume(tmp_path, sandbox_image):
    """The commands a person types: a run that stops at an approval, status, approve, resume."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    cli = [sys.executable, "-m", "trace_rl.graph.cli"]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({**config(auto_approve=False, approvals=["capabilities"]).model_dump(),
                               "components": "graph_doubles:components"}))
    run = tmp_path / "run"
    out = subprocess.run(cli + ["run", "-c", str(cfg), "--run-dir", str(run), "--no-wait"], cwd=SUPPORT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "waiting for a decision" in out.stdout, out.stdout + out.stderr[-2000:]
    st = subprocess.run(cli + ["status", str(run)], cwd=SUPPORT, env=env, capture_output=True, text=True)
    assert "pending:" in st.stdout and "capabilities@0" in st.stdout and "next: select" in st.stdout
    bad = subprocess.run(cli + ["approve", str(run), "--reject", "nope"], cwd=SUPPORT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "'nope' is not pending" in bad.stdout
    ok = subprocess.run(cli + ["approve", str(run)], cwd=SUPPORT, env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and "recorded" in ok.stdout
    again = subprocess.run(cli + ["run", "-c", str(cfg), "--run-dir", str(run)], cwd=SUPPORT, env=env,
                           capture_output=True, text=True)
    assert again.returncode == 2 and "trace-rl resume" in again.stdout
    stop = subprocess.run(cli + ["resume", str(run), "--until", "train"], cwd=SUPPORT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert stop.returncode == 0 and f"stopped before train: continue with `trace-rl resume {run}`" in stop.stdout, \
        stop.stdout + stop.stderr[-2000:]
    assert (run / "envs" / "lookup_before_answering").is_dir() and not (run / "train").exists()
    refused = subprocess.run(cli + ["resume", str(run), "--set", "grpo.steps=5"], cwd=SUPPORT, env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "may change only how the run is served" in refused.stdout
    res = subprocess.run(cli + ["resume", str(run), "--set", "agent.concurrency=3"], cwd=SUPPORT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "done" in res.stdout and "before / after" in res.stdout, res.stderr[-2000:]
    assert json.loads((run / "report.json").read_text())["adapters"]["lookup_before_answering"]["steps"] == 2
    assert json.loads((run / "config.json").read_text())["agent"]["concurrency"] == 3  # another machine's setting


def test_train_unkept_takes_the_best_candidate_only_when_asked(tmp_path, sandbox_image, monkeypatch):
    """A weak analyst (everything PRESENT) keeps nothing: by default nothing is trained; with
    train_unkept=1 the best-ranked candidate is, and it is marked below_threshold."""
    monkeypatch.setenv("TRACE_RL_WEAK_ANALYST", "1")
    st = drive(tmp_path / "a", config(), resume=False, log=lambda *a: None)["state"]
    assert not any(c.kept for c in st["capabilities"]) and not st.get("adapters") and st["selected"] == 0
    st = drive(tmp_path / "b", config(train_unkept=1), resume=False, log=lambda *a: None)["state"]
    best = st["capabilities"][0]
    assert best.name == "lookup_before_answering" and not best.kept and best.below_threshold
    assert list(st["adapters"]) == ["lookup_before_answering"]
    assert "no (trained anyway: train_unkept)" in (tmp_path / "b" / "report.md").read_text()


def test_an_untrained_adapter_is_left_out_and_the_table_says_so(tmp_path, sandbox_image, monkeypatch):
    """GRPO that never moved the weights: the adapter is `untrained`, nothing is composed, and
    the final table has the base row plus rows that say why they are not results."""
    import trace_rl.training.train as train

    monkeypatch.setattr(train, "adapter_changed", lambda path: False)
    st = drive(tmp_path, config(), resume=False, log=lambda *a: None)["state"]
    assert st["adapters"]["lookup_before_answering"].untrained and not st.get("composition")
    assert st["results"]["base"]["episodes"] == 2 * 2 and st["results"]["base"]["trials"] == 2  # 2 test tasks x 2
    assert st["results"]["moe"]["skipped"].startswith("moe = base: no trained adapter")
    md = (tmp_path / "report.md").read_text()
    assert "| train | untrained |" in md and "not evaluated: moe = base" in md
    assert re.search(r"\| base \| [a-z.]+ \| 2 × 2 \|", md)  # mode, the backend that served it, tasks × trials
    assert "| compose | skipped |" in md


def library_env(doc: str) -> str:
    """The doubles' sound env under another docstring (what library matching reads)."""
    import graph_doubles

    return f'"""Reference environment: {doc}."""\n' + graph_doubles.ENV.split("\n", 1)[1]


@pytest.mark.parametrize("matching", [True, False])
def test_a_library_substitute_is_marked_everywhere_or_refused(tmp_path, sandbox_image, monkeypatch, matching):
    import graph_doubles
    import trace_rl.agents.env_library as env_library

    lib = tmp_path / ("facts_lookup_cities.py" if matching else "multilingual_poetry_generation_cities.py")
    lib.write_text(library_env("facts lookup. Looks the facts up with the tools before answering" if matching
                               else "writes sonnets in French"))
    monkeypatch.setattr(env_library, "library", lambda: {lib.stem: lib})
    monkeypatch.setattr(graph_doubles, "builder_script",  # every round breaks the reward
                        lambda: lambda messages, tools: f"```python\n{graph_doubles.BROKEN_ENV}```")
    st = drive(tmp_path / "run", config(build_rounds=1, library_fallback=True), resume=False, log=lambda *a: None)["state"]
    env = st["envs"]["lookup_before_answering"]
    md = (tmp_path / "run" / "report.md").read_text()
    if not matching:
        assert env.status == "needs_human" and "no library environment matches" in env.reason
        assert not st.get("adapters") and "| synthesise | needs_human |" in md
        return
    assert env.source == "library:facts_lookup" and "facts_lookup" in env.substitute
    envs_dir = next((tmp_path / "run").rglob("library/manifest.json"))
    assert json.loads(envs_dir.read_text())["origin"] == "library"  # never "builder": it is hand-written
    assert st["adapters"]["lookup_before_answering"].trained_on.name == "facts_lookup"
    manifest = json.loads((tmp_path / "run" / "composition" / "manifest.json").read_text())
    assert manifest["adapters"] == ["facts_lookup"]  # named after what it trained on; the router reads that
    assert "facts" in manifest["capabilities"][0]["description"]
    assert "| synthesise | substituted |" in md and "trained on a substitute" in md


def test_a_changed_config_reruns_that_stage_and_everything_after(tmp_path, reference):
    ref_run, _ = reference
    import shutil

    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    calls_before = (run / "calls.log").read_text()
    os.environ["TRACE_RL_CALL_LOG"] = str(run / "calls.log")
    logged = []
    try:
        grpo = {**config().grpo.model_dump(), "steps": 3}
        st = drive(run, config(grpo=grpo), resume=False, log=logged.append)["state"]
    finally:
        del os.environ["TRACE_RL_CALL_LOG"]
    assert any("config changed (grpo): re-running train, compose, evaluate" in m for m in logged), logged
    assert st["adapters"]["lookup_before_answering"].steps == 3
    calls = Counter((run / "calls.log").read_text().split()) - Counter(calls_before.split())
    assert calls["analyst"] == 0 and calls["builder"] == 0 and calls["reviewer"] == 0  # unchanged stages: reused
    stale = list((run / "stale").iterdir())
    assert len(stale) == 1 and (stale[0] / "train").is_dir() and (stale[0] / "composition").is_dir()
    assert not (stale[0] / "envs").exists()  # synthesis was not stale
    again = []
    drive(run, config(grpo=grpo), resume=True, log=again.append)
    assert not any("config changed" in m for m in again)


def test_trials_without_sampling_are_refused():
    with pytest.raises(ConfigError, match="agent.temperature"):
        load_config(overrides={"trials": 2, "agent": {"temperature": 0}})
    assert load_config(preset="demo").trials >= 2 and load_config(preset="paper").trials >= 2
    assert load_config(preset="demo").verify.calibration_gate  # the method's gate, the demo included


def test_a_misbehaving_module_is_a_finding_and_the_next_round_comes(tmp_path, sandbox_image, monkeypatch):
    """Round 1's module kills its own process on one seed: the verify node records findings
    (it does not raise and get stuck on resume) and round 2 is built and verified."""
    import graph_doubles

    envs = SUPPORT / "envs"
    exits = (envs / "sound.py").read_text() + "\n\n" + (envs / "misbehaving" / "exit_on_seed.py").read_text()
    answers = iter([f"```python\n{exits}```", f"```python\n{graph_doubles.ENV}```"])
    monkeypatch.setattr(graph_doubles, "builder_script", lambda: lambda messages, tools: next(answers))
    st = drive(tmp_path, config(), resume=False, log=lambda *a: None)["state"]
    env = st["envs"]["lookup_before_answering"]
    assert env.status == "verified" and env.rounds == 2
    r1 = json.loads((tmp_path / "envs/lookup_before_answering/attempt_01/verifier_report.json").read_text())
    assert not r1["passed"] and "seed 2" in r1["feedback"] and "[crashed]" in r1["feedback"]


def test_fingerprints_ignore_settings_that_change_no_result():
    from trace_rl.graph.config import stage_fingerprints

    base = stage_fingerprints(config())
    assert stage_fingerprints(config(agent={"concurrency": 4}, approvals=[])) == base
    # where episodes play (#44): how this machine runs the run, like serve and sandbox (`resume --set` takes it)
    assert stage_fingerprints(config(executor="ray", ray_address="head:6379", ray_retries=0)) == base
    changed = stage_fingerprints(config(analysis={"n_candidates": 2, "n_runs": 4, "k": 2}))
    assert changed["rollout"] == base["rollout"] and changed["analyse"] != base["analyse"]
    assert changed["evaluate"] != base["evaluate"]  # chained: everything after a change changes


def test_the_grpo_on_target_baseline_gets_the_same_budget_and_a_row(tmp_path, sandbox_image):
    """target_baseline: after compose, GRPO on the target's own rollout tasks with as many steps as
    the capabilities' GRPO together; its row is measured, or says why it is not a result."""
    st = drive(tmp_path, config(target_baseline=True), resume=False, log=lambda *a: None)["state"]
    trace_steps = sum(a.steps for a in st["adapters"].values())
    target = st["target_adapter"]
    assert target.trained_on.name == "target" and target.steps == trace_steps > 0
    assert (tmp_path / "train_target" / "adapter" / "adapter_config.json").is_file()
    row = st["results"]["grpo_target"]
    assert ("skipped" in row) == target.untrained
    assert row.get("episodes") == st["results"]["base"]["episodes"] or row["skipped"].startswith("grpo_target = base")
    assert "| baseline |" in (tmp_path / "report.md").read_text()


def test_a_packed_run_unpacks_elsewhere_and_resumes(tmp_path, reference):
    """Moving a run between machines: pack in parts, unpack elsewhere, resume to the same state;
    a damaged part or an existing run of that name is refused."""
    from trace_rl.core.rundir import RunDir, RunDirError, unpack

    ref_dir, ref_state = reference
    parts = RunDir(ref_dir).pack(tmp_path / "parts", part_mb=1)
    assert parts and all(p.stat().st_size <= 1 << 20 for p in parts)
    moved = unpack(tmp_path / "parts", tmp_path / "elsewhere")
    assert not list(moved.rglob("checkpoint-*"))  # GRPO optimizer states stay behind
    assert (moved / "train" / "lookup_before_answering" / "grpo" / "adapter").is_dir()
    st = drive(moved, config(), resume=True, log=lambda *a: None)["state"]
    assert summary(st) == summary(ref_state)
    with pytest.raises(RunDirError, match="exists"):
        unpack(tmp_path / "parts", tmp_path / "elsewhere")
    parts[0].write_bytes(parts[0].read_bytes()[:-1] + b"x")
    with pytest.raises(RunDirError, match="do not match their manifest"):
        unpack(tmp_path / "parts", tmp_path / "third")


def test_llama_cpp_serves_the_base_row_and_each_trained_adapter_alone(tmp_path):
    """With a lora_agent (serve=llama.cpp, a local GGUF base) those rows leave the slow in-process model;
    an untrained adapter is no row, and two adapters trained on one library env keep apart."""
    from dataclasses import replace

    from graph_doubles import components
    from trace_rl.core.records import AdapterRecord, Capability
    from trace_rl.graph.pipeline import Pipeline

    pipe = Pipeline(tmp_path, config())
    assert pipe.comps.lora_agent is None and pipe._llama_cpp_rows({}) == {}  # the doubles: all in-process
    pipe.__dict__["comps"] = replace(components(pipe.cfg), lora_agent=lambda adapter: f"llama.cpp+{adapter}")
    lib = Capability(name="library_env", description="a library env")
    adapters = {"a": AdapterRecord(trained_on=lib, adapter="/ad/a"), "b": AdapterRecord(trained_on=lib, adapter="/ad/b"),
                "c": AdapterRecord(trained_on=Capability(name="c"), adapter="/ad/c", untrained=True)}
    assert pipe._llama_cpp_rows({"adapters": adapters}) == {
        "base": "llama.cpp+None", "library_env": "llama.cpp+/ad/a", "library_env@b": "llama.cpp+/ad/b"}
    moe = {"moe": AdapterRecord(trained_on=Capability(name="moe"), adapter="/ad/m")}  # a mode's name is reserved
    assert pipe._llama_cpp_rows({"adapters": moe}) == {"base": "llama.cpp+None", "moe@moe": "llama.cpp+/ad/m"}


def test_fingerprints_of_a_fixed_config_stay_as_they_were():
    """A field added to a config model must not re-run the stages of runs made before it (values of
    2026-12-05, before LLMConfig.lora): resume would move finished work to stale/."""
    from trace_rl.graph.config import stage_fingerprints

    assert stage_fingerprints(config(user_model={"model": "qwen2.5-coder-0.5b"})) == {
        "rollout": "dee195020c75a899", "analyse": "468ac120702f68a4", "synthesise": "015850029d81e600",
        "train": "a0dfc94c81955888", "compose": "2d25c76db2eabebc", "evaluate": "3b92bdc4aa4c75ac"}


def test_a_component_made_on_first_use_is_made_once_and_only_when_used():
    import threading

    from trace_rl.graph.pipeline import OnFirstUse

    made = []

    class Server:
        name = "analyst"

    lazy = OnFirstUse(lambda: made.append(1) or Server())
    assert made == []  # a resumed run that never asks the analyst starts nothing
    threads = [threading.Thread(target=lambda: lazy.name) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lazy.name == "analyst" and made == [1]


def test_rows_llama_cpp_serves_do_not_load_the_in_process_composition(tmp_path, monkeypatch):
    """Evaluating only the base and adapter rows under llama.cpp never loads the composed model (fp32 on a
    CPU); asking for the router too does."""
    import json
    from dataclasses import replace

    import trace_rl.evals.evaluate as ev
    from graph_doubles import components
    from trace_rl.core.records import AdapterRecord, Capability
    from trace_rl.graph.pipeline import Pipeline

    (tmp_path / "composition").mkdir()
    (tmp_path / "composition" / "manifest.json").write_text(json.dumps({"adapters": ["lookup"]}))
    adapters = {"lookup": AdapterRecord(trained_on=Capability(name="lookup"), adapter="/ad/lookup")}
    state = {"composition": str(tmp_path / "composition"), "adapters": adapters}
    seen = []
    monkeypatch.setattr(ev, "evaluate", lambda bench, policies, *a, **kw: seen.append(dict(policies)) or {})
    loads = []

    class Comp:
        def policy(self, mode):
            return f"in-process {mode}"

    for modes in (["base", "lookup"], ["base", "router"]):
        pipe = Pipeline(tmp_path, config(eval_modes=modes))
        pipe.__dict__["comps"] = replace(components(pipe.cfg), lora_agent=lambda adapter: f"llama.cpp+{adapter}")
        pipe._composition = lambda: loads.append(1) or Comp()
        pipe.evaluate(state)
    assert seen[0] == {"base": "llama.cpp+None", "lookup": "llama.cpp+/ad/lookup"}
    assert seen[1] == {"base": "llama.cpp+None", "router": "in-process router"} and loads == [1]


def test_a_router_that_sent_every_task_to_the_base_is_marked_as_the_base():
    """A router row whose classifier chose the base everywhere measures the base model again."""
    from trace_rl.graph.report import eval_note, row_notes

    figures = {"tasks": 5, "routes": {"base": 5}}
    s = {"composition": "c", "results": {"router": figures}}
    notes = row_notes(s)
    assert notes["router"] == "router = base: the classifier sent every task to the base"
    assert eval_note({"notes": notes}, "router", figures) == notes["router"] + "; routed: base 5"
    mixed = {"tasks": 5, "routes": {"base": 2, "lookup": 3}}
    assert "router" not in row_notes({"composition": "c", "results": {"router": mixed}})
    assert eval_note({"notes": {}}, "router", mixed) == "routed: lookup 3, base 2"


def test_report_and_status_print_the_same_evaluation_cells(capsys, monkeypatch):
    """report.md and `trace-rl status` share one row builder: the router's routes and the CI in both."""
    from rich.console import Console

    from trace_rl.graph import cli
    from trace_rl.graph.cli import _print_status

    monkeypatch.setattr(cli, "console", Console(width=250))  # no wrapped cells (and the module's console untouched)
    from trace_rl.graph.report import evaluation_rows, render_markdown

    figures = {"tasks": 5, "trials": 2, "pass@1": 0.4, "ci95": [0.17, 0.69], "passed": 4, "episodes": 10,
               "mean_reward": 0.41, "routes": {"base": 2, "lookup": 3}, "backend": "engine"}
    st = {"composition": "c", "results": {"router": figures, "moe": {"skipped": "no adapter"}}}
    rows = evaluation_rows({"evaluation": st["results"], "notes": {}})
    assert rows[0] == ["router", "engine", "5 × 2", "40.0%", "17%–69%", "4/10", "0.41", "routed: lookup 3, base 2"]
    assert rows[1][-1] == "not evaluated: no adapter"
    md = render_markdown({"benchmark": "b", "evaluation": st["results"], "notes": {}})
    assert "| " + " | ".join(rows[0]) + " |" in md
    _print_status("run", st)
    out = capsys.readouterr().out
    assert "routed: lookup 3, base 2" in out and "17%–69%" in out and "not evaluated: no adapter" in out


def test_the_moe_row_carries_what_its_gates_trained_on_unless_they_are_untrained():
    from trace_rl.graph.report import row_notes

    gates = "gates trained on 72 successful rollouts (a: 72, b: 0), 3 epochs, loss 1.138 → 1.139"
    assert row_notes({"composition": "c", "gates": gates})["moe"] == gates
    untrained = row_notes({"composition": "c", "gates_untrained": "0 successful rollouts", "gates": "x"})
    assert untrained["moe"] == "moe = base: gates untrained (0 successful rollouts)"


def test_a_moved_run_still_says_its_envs_were_not_calibrated(tmp_path):
    """The GPU's report of a run built on the CPU machine once dropped "not calibrated": the recorded
    env path was the CPU's, no report was found there, and a missing report read as calibrated."""
    import json

    from trace_rl.core.records import EnvRecord
    from trace_rl.graph.report import stage_summary

    env_dir = tmp_path / "run" / "envs" / "cap" / "attempt_01"
    env_dir.mkdir(parents=True)
    (env_dir / "env.py").write_text("")
    (env_dir / "verifier_report.json").write_text(json.dumps({"passed": True, "findings": [], "calibration": None}))
    record = EnvRecord(status="verified", env="/elsewhere/runs/x/envs/cap/attempt_01/env.py", rounds=1)
    synth = lambda run_dir: next(r for r in stage_summary({"envs": {"cap": record}}, run_dir)  # noqa: E731
                                 if r["stage"] == "synthesise")["detail"]
    assert synth(tmp_path / "run").endswith("; not calibrated (calibrate is off)")
    assert synth(None).endswith("; calibration unknown (no verifier report at the recorded path)")
    (env_dir / "verifier_report.json").write_text(json.dumps({"calibration": {"mean_reward": 0.4}}))
    assert synth(tmp_path / "run") == "cap: verified after 1 builder round(s)"


def test_a_train_row_says_when_the_base_already_passed_every_held_out_seed():
    from trace_rl.core.records import AdapterRecord, Capability, HeldOut
    from trace_rl.graph.report import stage_summary

    def row(before: float) -> str:
        a = AdapterRecord(trained_on=Capability(name="cap", description=""), steps=4,
                          before=HeldOut(success=before, mean_reward=before, episodes=16),
                          after=HeldOut(success=1.0, mean_reward=1.0, episodes=16))
        return next(r for r in stage_summary({"adapters": {"cap": a}}) if r["stage"] == "train")["detail"]

    assert row(1.0).endswith("held-out success 100% → 100% (the base, decoding greedily, already passed all 16 "
                             "held-out seeds: they cannot show a gain; calibration samples at the agent's temperature)")
    assert "cannot show a gain" not in row(0.5)


def test_the_stage_commands_run_the_pipelines_steps_on_a_pipeline_made_run(reference, tmp_path):
    """`trace-rl analyze RUN` and `trace-rl build RUN` on a run the pipeline made: they find its rollouts,
    analysis and attempts where the pipeline put them (iter_0/..., envs/...), on the run's own config
    (here its scripted components), so every cached step is reused and nothing lands beside them."""
    from typer.testing import CliRunner

    from trace_rl.graph.cli import app

    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    before = json.loads((run / "iter_0/analysis/capabilities.json").read_text())["capabilities"]
    analysed = CliRunner().invoke(app, ["analyze", str(run)])
    assert analysed.exit_code == 0, analysed.output
    assert "12 trajectories, 6 failed" in analysed.output and not (run / "analysis").exists()
    after = json.loads((run / "iter_0/analysis/capabilities.json").read_text())["capabilities"]
    assert [(c["name"], c["kept"]) for c in after] == [(c["name"], c["kept"]) for c in before]
    built = CliRunner().invoke(app, ["build", str(run), "--capability", "lookup_before_answering"])
    assert built.exit_code == 0, built.output
    result = json.loads((run / "envs/lookup_before_answering/result.json").read_text())
    assert (result["status"], result["rounds"], result["cost"]["builder_calls"]) == ("verified", 2, 0)  # both cached
    assert sorted(p.name for p in (run / "envs/lookup_before_answering").glob("attempt_*")) == ["attempt_01", "attempt_02"]
