"""The train stage for one capability: held-out success of the base, GRPO, held-out success after.

Everything lands in one folder (tools.json, heldout_before/, grpo/, heldout_after/, report.json);
each part resumes from what is there, so a killed run redoes nothing finished.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from trace_rl.core.io import atomic_write_json
from trace_rl.core.records import AdapterRecord, Capability, HeldOut
from trace_rl.core.rundir import GRPODir, TrainDir
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.evals.report import summarize
from trace_rl.evals.rollout import rollout
from trace_rl.evals.synthetic import SyntheticBenchmark
from trace_rl.models.hf_policy import HFPolicy
from trace_rl.training.grpo import CapabilityGRPO, GRPOSettings, adapter_changed, plot_curve

HELDOUT_START = 10**6  # held-out seeds start here: disjoint from the training seeds


def env_benchmark(name: str, code: str, seeds: range, sandbox: str | None = None) -> SyntheticBenchmark:
    """A capability's environment to train and measure on: one that was verified (or approved); `sandbox`:
    the backend it runs in (docker, or subprocess where Docker is not: the run config's `sandbox`)."""
    return SyntheticBenchmark(code, name=f"env:{name}", seeds=seeds, pool_size=1, verified=True, backend=sandbox)


def grpo(name: str, bench, task_ids: list[str], load_base: Callable[[], tuple], out: GRPODir, settings: GRPOSettings,
         log=print, decode: str = "auto", rollout_url: str | None = None) -> tuple[str, int, str | None, bool]:
    """(adapter path, steps, curve PNG, untrained) of GRPO on `bench`'s `task_ids` — from disk when
    the adapter is already there. `decode`: the engine's decode step (the run config's `decode`);
    `rollout_url`: a vLLM server of the same base weights that generates the groups (serve=vllm)."""
    if out.finished():
        history = json.loads(out.log.read_text())
        if not out.curve.is_file():  # trained by a version that plotted after the log: draw it again
            plot_curve(history, out.curve, f"GRPO: {name}")
        return str(out.adapter), len(history), str(out.curve), not adapter_changed(out.adapter)
    model, tok = load_base()
    res = CapabilityGRPO(model, tok, bench, task_ids, out, settings, name=name, decode=decode,
                         rollout_url=rollout_url).train()
    untrained = not adapter_changed(res.adapter)
    if untrained:
        log(f"{name}: UNTRAINED: after {res.steps} GRPO steps every LoRA B matrix is still zero "
            "(no step had a reward signal); the adapter is left out")
    return res.adapter, res.steps, res.curve, untrained


def train_on_target(bench, task_ids: list[str], out_dir: str | Path, load_base: Callable[[], tuple],
                    settings: GRPOSettings, log=print, decode: str = "auto",
                    rollout_url: str | None = None) -> AdapterRecord:
    """The baseline TRACE is judged against (the paper's "GRPO on the target environment"): one
    LoRA trained by GRPO on the benchmark's own episodes (`task_ids`: its train split; its sparse
    reward; no hints), with the settings and the rollout budget of the capabilities' GRPO."""
    out = GRPODir(out_dir)
    adapter, steps, curve, untrained = grpo("grpo_target", bench, task_ids, load_base, out, settings, log, decode,
                                             rollout_url)
    record = AdapterRecord(trained_on=Capability(name="target", description=f"{bench.name}: {len(task_ids)} tasks"),
                           adapter=adapter, steps=steps, curve=curve, untrained=untrained)
    atomic_write_json(out.report, {"capability": "grpo_target", **record.model_dump()})
    log(f"GRPO on {bench.name}: {steps} steps x {settings.group_size * settings.groups_per_step} episodes"
        + (" (UNTRAINED: no step had a reward signal)" if untrained else ""))
    return record


def target_policy(record: AdapterRecord, load_base: Callable[[], tuple], max_new_tokens: int,
                  rows: Callable[[Any], int | None] = lambda model: None, decode: str = "auto") -> HFPolicy:
    """The GRPO-on-target row's agent: the frozen base with the target's adapter. `rows(model)`: the
    engine's rows for this model (None: the engine's default)."""
    from peft import PeftModel

    model, tok = load_base()
    return HFPolicy(PeftModel.from_pretrained(model, record.adapter).eval(), tok, "grpo_target",
                    max_new_tokens=max_new_tokens, rows=rows(model), decode=decode)


def train_capability(name: str, env: str | Path, out_dir: str | Path, load_base: Callable[[], tuple],
                     settings: GRPOSettings, *, trained_on: Capability, train_seeds: int = 1000,
                     heldout_seeds: int = 20, substitute: str | None = None, log=print, decode: str = "auto",
                     sandbox: str | None = None, rollout_url: str | None = None) -> AdapterRecord | None:
    """Held-out before, GRPO, held-out after, for one capability's environment module `env` (run in the
    `sandbox` backend; `decode`: the engine's decode step).

    Under torchrun (WORLD_SIZE > 1) every process trains and rank 0 alone then measures
    held-out success (no process waits in a collective while another evaluates); the other
    ranks return None."""
    out, code = TrainDir(out_dir), Path(env).read_text()
    if not out.tools.is_file():  # before training: a kill after the adapter is saved must find it too
        with env_benchmark(name, code, range(1), sandbox) as bench:  # what the router's gate examples are rendered with
            atomic_write_json(out.tools, bench.spec()["tools"])
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1

    def measure(model, tok, tag: str) -> HeldOut:
        """Held-out success of the base ("base") or the trained adapter, on seeds disjoint from training."""
        ids = range(HELDOUT_START, HELDOUT_START + heldout_seeds)
        policy = HFPolicy(model, tok, tag, max_new_tokens=settings.max_turn_tokens, decode=decode)
        with env_benchmark(name, code, ids, sandbox) as bench:
            trajs = rollout(bench, policy, [str(x) for x in ids], split="heldout", max_steps=settings.max_steps,
                            store=TrajectoryStore(out.heldout("before" if tag == "base" else "after")))
        figs = next(iter(summarize(trajs).values()))
        return HeldOut(success=figs["pass@1"], mean_reward=figs["mean_reward"], episodes=figs["episodes"])

    before = None if distributed else measure(*load_base(), "base")
    with env_benchmark(name, code, range(train_seeds), sandbox) as bench:
        adapter, steps, curve, untrained = grpo(name, bench, [str(x) for x in range(train_seeds)], load_base,
                                                out.grpo, settings, log, decode, rollout_url)
    if distributed:
        if int(os.environ.get("RANK", "0")):
            return None
        before = measure(*load_base(), "base")
    from peft import PeftModel

    model, tok = load_base()
    after = measure(PeftModel.from_pretrained(model, adapter).eval(), tok, name)
    record = AdapterRecord(trained_on=trained_on, before=before, after=after, adapter=adapter, steps=steps,
                           curve=curve, untrained=untrained, substitute=substitute)
    atomic_write_json(out.report, {"capability": name, **record.model_dump()})
    log(f"{name}: held-out success {before.success:.0%} -> {after.success:.0%}")
    return record
