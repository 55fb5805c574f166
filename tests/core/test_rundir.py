"""The run directory's layout is named in one place (core/rundir.py): the pipeline's stages and the
stage commands of the CLI find the same files."""
from pathlib import Path

from trace_rl.core.rundir import RunDir
from trace_rl.core.trajectory import Trajectory, TrajectoryStore


def traj(task: str, passed: bool) -> Trajectory:
    return Trajectory(task_id=task, benchmark="b", trial=0, model="m", messages=[], reward=float(passed),
                      passed=passed, termination="agent_stop", split="train")


def test_every_stage_folder_sits_where_the_pipeline_has_always_put_it(tmp_path):
    run = RunDir(tmp_path)
    rel = lambda p: Path(p).relative_to(tmp_path).as_posix()  # noqa: E731
    assert [rel(p) for p in (run.rollouts(), run.analysis().capabilities, run.eval(2).mode("moe"), run.config,
                             run.checkpoint, run.env("cap").attempt(3).verifier_report, run.env("cap").library.env,
                             run.train("cap").grpo.adapter, run.train("cap").heldout("after"), run.train_target.report,
                             run.composition)] == [
        "iter_0/rollouts", "iter_0/analysis/capabilities.json", "iter_2/eval/moe", "config.json", "graph.sqlite",
        "envs/cap/attempt_03/verifier_report.json", "envs/cap/library/env.py", "train/cap/grpo/adapter",
        "train/cap/heldout_after", "train_target/report.json", "composition"]
    assert run.stage_outputs("analyse") == ["iter_0/analysis"] and run.stage_outputs("train") == ["train", "train_target"]


def test_a_recorded_path_from_another_machine_is_found_under_this_run(tmp_path):
    run = RunDir(tmp_path / "here")
    adapter = run.train("cap").grpo.adapter
    adapter.mkdir(parents=True)
    assert run.here("/elsewhere/run/train/cap/grpo/adapter") == str(adapter)
    assert run.here("/elsewhere/run/nothing/like/it") == "/elsewhere/run/nothing/like/it"


def test_the_cli_reads_the_rollouts_and_capabilities_the_pipeline_wrote(tmp_path):
    """`trace-rl analyze RUN` reads the pipeline's rollouts (not the evaluation's episodes beside them) and
    writes where the pipeline's analysis is; `trace-rl build RUN` reads that capabilities.json."""
    from trace_rl.graph.cli import analysis_dir, rollout_trajectories

    run = RunDir(tmp_path)
    rollouts, evaluation = TrajectoryStore(run.rollouts()), TrajectoryStore(run.eval().mode("base"))
    rollouts.add(traj("t1", True))
    rollouts.add(traj("t2", False))
    evaluation.add(traj("e1", False))
    assert sorted(t.task_id for t in rollout_trajectories(run)) == ["t1", "t2"]
    assert analysis_dir(run).capabilities == tmp_path / "iter_0" / "analysis" / "capabilities.json"
    TrajectoryStore(run.rollouts(1)).add(traj("t3", False))  # the autonomous loop's next iteration
    assert [t.task_id for t in rollout_trajectories(run)] == ["t3"] and analysis_dir(run).root == run.analysis(1).root

    folder = RunDir(tmp_path / "eval-out")  # `trace-rl eval --out` made it: no iterations, every trajectory counts
    TrajectoryStore(folder.root).add(traj("x", True))
    assert [t.task_id for t in rollout_trajectories(folder)] == ["x"]


def test_a_stage_command_reaches_its_models_as_the_pipeline_does(tmp_path, monkeypatch):
    """`trace-rl analyze --serve hf` (any stage command) gets its models through the pipeline's components:
    served as the config says, where the commands used to make their own LLMs and serve=hf never reached them."""
    import trace_rl.models.llm as llm
    from trace_rl.graph.cli import _stage_config
    from trace_rl.graph.pipeline import Pipeline

    seen = []
    monkeypatch.setattr(llm, "served", lambda cfg, serve, rows=64, decode="auto", **kw: seen.append(serve) or cfg.model_copy(
        update={"base_url": f"http://{serve}.test/v1"}))
    cfg = _stage_config(RunDir(tmp_path), {"serve": "hf", "analyst": {"model": "qwen2.5-coder-0.5b", "base_url": None},
                                           "builder": {"max_tokens": None}})
    comps = Pipeline(tmp_path, cfg).comps
    assert comps.analyst.config.base_url == "http://hf.test/v1" and comps.analyst.config.model == "qwen2.5-coder-0.5b"
    assert comps.builder.config.max_tokens == cfg.builder.max_tokens and seen == ["hf", "hf"]
