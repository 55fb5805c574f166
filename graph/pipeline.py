"""The TRACE pipeline as a LangGraph state machine, resumable after any crash.

    rollout → analyse → select → next_capability ─┬→ synthesise ─┬→ approve_env → next_capability …
                                                  │   ↑__________│ (another round, ≤ build_rounds)
                                                  │ (queue empty: every environment built)
                                                  └→ train → train … (each approved environment) → compose
                                                     → train_target (the GRPO-on-target baseline, when configured)
                                                     → evaluate → report → (autonomous loop: rollout again) → END

Every environment is built and approved before any is trained: building needs Docker (a CPU
machine), training a GPU (no Docker), and a human approves all environments in one sitting
before the expensive part (`drive(until="train")` stops there; a `resume` elsewhere goes on).

Each node calls one stage function (evals.rollout, agents.analyst.analyze / select_capabilities,
agents.env_builder.synthesize_round, training.train.train_capability, training.compose.compose_trained,
evals.evaluate.evaluate), which works through on-disk caches (the trajectory store, the analyst's
label cache, one folder per builder round, GRPO checkpoints, the composition artefact): a node
killed half-way and re-entered on resume redoes nothing. The state holds typed records
(core/records.py) and paths; artefacts live in the run directory. Approvals are LangGraph
interrupts; decisions are kept in RUN_DIR/approvals.json (graph/approvals.py).
"""
from __future__ import annotations

import importlib
import json
import operator
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Callable, TypedDict

from trace_rl.core.io import atomic_write_json
from trace_rl.core.records import RECORD_TYPES, AdapterRecord, Capability, CapabilityRecord, EnvRecord
from trace_rl.core.trajectory import TrajectoryStore
from trace_rl.core.rundir import CHECKPOINT, RunDir, RunDirError, read_control
from trace_rl.graph.approvals import (THREAD, auto_decision, check_decision, pending, pending_item, read_decisions,
                                      record_decision)
from trace_rl.graph.config import (STAGE_FIELDS, ConfigError, RunConfig, load_saved_config, save_config,
                                   stage_fingerprints)
from trace_rl.graph.report import row_notes, write_run_report


# ---------------------------------------------------------------- state
def _merge(a: dict, b: dict) -> dict:
    return {**(a or {}), **(b or {})}


def _add_times(a: dict, b: dict) -> dict:
    a = a or {}
    return {**a, **{k: round(a.get(k, 0.0) + v, 2) for k, v in (b or {}).items()}}


class State(TypedDict, total=False):
    iteration: int
    capabilities: list[CapabilityRecord]  # this iteration's analysis, with the human's decisions
    analysis: dict  # this iteration's labelling figures: trajectories, passed, unlabelled pairs per run
    queue: list[str]  # approved capabilities still to build
    current: str | None  # the capability being built
    rounds: int  # builder rounds spent on `current`
    envs: Annotated[dict[str, EnvRecord], _merge]
    adapters: Annotated[dict[str, AdapterRecord], _merge]
    composition: str | None
    target_adapter: AdapterRecord | None  # the baseline: GRPO on the target benchmark itself
    gates_untrained: str | bool | None  # why the composition's gates saw no example (moe = base); True in old runs
    gates: str | None  # what the gates trained on and how their loss moved (report, the moe row's note)
    results: dict  # final evaluation per mode
    rollout_figures: Annotated[list, operator.add]  # one per iteration
    timings: Annotated[dict, _add_times]  # seconds per node, summed over iterations and retries
    selected: int  # capabilities approved by the last selection (0 ends the autonomous loop)


# ---------------------------------------------------------------- components
@dataclass
class Components:
    """What the stages run on. `default_components` builds the real ones from the config;
    `RunConfig.components` may name another factory (tests use scripted LLMs and tiny models).
    `after_node(name)`, when given, is called as each node finishes (observers, fault injection)."""
    benchmark: Any  # the target Benchmark
    agent: Any  # base-agent policy for rollouts (an LLM endpoint)
    analyst: Any
    builder: Any
    reviewer: Any | None
    calibration: Any | None  # base-model policy for environment calibration
    load_base: Callable[[], tuple]  # fresh (transformers model, tokenizer) of the base
    after_node: Callable[[str], None] | None = None
    # adapter folder (None: no adapter) -> the base agent with that one LoRA on llama.cpp (GGUF LoRA) or on vLLM (a
    # LoRA request), greedy like the in-process rows; None: single-adapter rows decode in-process, and so does the
    # base row once composed
    lora_agent: Callable[[str | None], Any] | None = None
    labeller: Any | None = None  # labels the analysis' pairs; None: the analyst


class OnFirstUse:
    """A component made when first used. Under serve=hf each role's model is an engine server started
    when made, so a run resumed on a GPU machine for training would start servers for the analyst and
    the builder, whose models need not even be there (and `trace-rl analyze` one for the agent)."""

    def __init__(self, make: Callable[[], Any]):
        self._make, self._made, self._lock = make, None, threading.Lock()

    def __getattr__(self, name: str):
        with self._lock:
            if self._made is None:
                self._made = self._make()
        return getattr(self._made, name)


def default_components(cfg: RunConfig) -> Components:
    """The real components, each model reached as the config says (`served`: llama.cpp, or an engine server
    under serve=hf), each made when first used: the pipeline's nodes and the stage commands run on these."""
    from trace_rl.evals.benchmark import load_benchmark
    from trace_rl.models.hf_policy import load_model
    from trace_rl.models.llm import LLM, served

    def serve(llm):  # under vllm the base model's server serves its adapters too, from the weights they trained on
        base = llm.model == cfg.base_model
        return served(llm.model_copy(update={"flash_attn": True}) if cfg.flash_attn else llm, cfg.serve,
                      cfg.serve_rows, cfg.decode, lora_capable=base, weights=cfg.train_model if base else None,
                      gpu_memory=cfg.vllm_gpu_memory)
    agent = OnFirstUse(lambda: LLM(serve(cfg.agent_llm())))
    opts = lambda: {"max_steps": cfg.agent.max_steps, "user_llm": serve(  # noqa: E731
        cfg.user_model or cfg.agent_llm().model_copy(update={"temperature": 0.0}))}
    # adapters are trained on the GGUF's own weights (no train_model): llama.cpp can apply them to that GGUF;
    # vLLM serves the weights they were trained on (train_model, or the GGUF's transformers checkpoint)
    by_server = not cfg.agent_llm().base_url and (cfg.serve == "vllm" or cfg.serve == "llama.cpp" and not cfg.train_model)
    return Components(
        benchmark=OnFirstUse(lambda: load_benchmark(cfg.benchmark, options=cfg.benchmark_options, offer=opts())),
        agent=agent,
        analyst=OnFirstUse(lambda: LLM(serve(cfg.analyst))), builder=OnFirstUse(lambda: LLM(serve(cfg.builder))),
        reviewer=OnFirstUse(lambda: LLM(serve(cfg.reviewer or cfg.builder))), calibration=agent if cfg.calibrate else None,
        labeller=OnFirstUse(lambda: LLM(serve(cfg.labeller))) if cfg.labeller else None,
        load_base=lambda: load_model(cfg.train_model or cfg.base_model),
        lora_agent=(lambda adapter: LLM(serve(cfg.agent_llm().model_copy(update={
            "lora": str(adapter) if adapter else None, "temperature": 0.0})))) if by_server else None)


# ---------------------------------------------------------------- the nodes: each calls one stage function
class Pipeline:
    def __init__(self, run_dir: str | Path, cfg: RunConfig, log: Callable[[str], None] = print):
        self.run, self.cfg, self.log = RunDir(run_dir), cfg, log

    @cached_property
    def comps(self) -> Components:
        if not self.cfg.components:
            return default_components(self.cfg)
        module, _, fn = self.cfg.components.partition(":")
        return getattr(importlib.import_module(module), fn or "components")(self.cfg)

    def here(self, path: str) -> str:
        return self.run.here(path)

    def cap(self, s: State) -> CapabilityRecord:
        """The capability being built."""
        return next(c for c in s["capabilities"] if c.name == s["current"])

    @staticmethod
    def untrained(s: State) -> str | None:
        """The first approved environment (in build order) without an adapter: the next to train."""
        done = s.get("adapters") or {}
        return next((n for n, e in (s.get("envs") or {}).items() if e.approved and n not in done), None)

    def _task_ids(self, split: str, n: int) -> list[str]:
        return [t.id for t in self.comps.benchmark.tasks(split)][:n or None]  # n = 0: all

    # -- 1. rollouts of the base agent (or, in later loop iterations, of the composed model)
    def rollout(self, s: State) -> dict:
        from trace_rl.evals.report import write_report
        from trace_rl.evals.rollout import rollout

        bench, cfg, policy = self.comps.benchmark, self.cfg, self.comps.agent
        if s.get("iteration", 0) > 0 and s.get("composition"):
            policy = self._composition().policy("moe")
        out = self.run.rollouts(s.get("iteration", 0))
        trajs = rollout(bench, policy, self._task_ids(cfg.rollout_split, cfg.rollout_tasks), TrajectoryStore(out),
                        trials=cfg.trials, concurrency=cfg.agent.concurrency, split=cfg.rollout_split,
                        passed_threshold=cfg.passed_threshold, step_timeout_s=cfg.agent.step_timeout,
                        max_steps=cfg.agent.max_steps, settings=self._settings(policy), strict=False,
                        **cfg.executor_kw())
        figs = next(iter(write_report(trajs, out, title=f"{policy.name} on {bench.name} [{cfg.rollout_split}]")
                         ["groups"].values()))
        return {"rollout_figures": [{"iteration": s.get("iteration", 0), "model": policy.name, "passed": figs["passed"],
                                     "episodes": figs["episodes"], "pass@1": figs["pass@1"], "tokens": figs["tokens"]}]}

    def _settings(self, policy) -> dict:
        """What each rollout records and must match to be reused (evals/rollout.py episode_settings): a
        crashed stage resumed with other weights, benchmark code or prompt plays those episodes again."""
        from trace_rl.evals.rollout import episode_settings

        cfg = self.cfg
        agent = cfg.agent_llm().model_copy(update={"flash_attn": cfg.flash_attn})
        return episode_settings(self.comps.benchmark, cfg.benchmark, agent if policy is self.comps.agent else policy.name,
                                max_steps=cfg.agent.max_steps, options=cfg.benchmark_options, user=cfg.user_model,
                                passed_threshold=cfg.passed_threshold)

    # -- 2. contrastive analysis, then selection (+ human approval)
    def analyse(self, s: State) -> dict:
        from trace_rl.agents.analyst import analyze

        i = s.get("iteration", 0)
        trajs = [t for store in self.run.rollout_stores(i) for t in TrajectoryStore(store).all()]
        caps = analyze(trajs, self.comps.analyst, self.run.analysis(i), self.cfg.analysis, progress=True,
                       tools=self._tools(), labeller=self.comps.labeller)
        out = self.run.analysis(i).read_capabilities()
        figures = ("trajectories", "passed", "failed", "hollow", "no_contrast", "contrast", "labelling_runs")
        return {"capabilities": caps, "analysis": {k: out.get(k) for k in figures}}

    def _tools(self) -> list[dict] | None:
        """The target's tool schemas, for the facts the analyst cites (argument checks need them)."""
        from trace_rl.evals.benchmark import BenchmarkError

        try:
            return self.comps.benchmark.spec()["tools"]
        except BenchmarkError:  # `trace-rl analyze` of rollouts from a benchmark not installed here
            self.log(f"{self.cfg.benchmark} is not a known benchmark: facts without schema checks")
            return None

    def select(self, s: State) -> dict:
        from langgraph.types import interrupt

        from trace_rl.agents.analyst import select_capabilities

        done = set(s.get("adapters") or {}) | {k for k, v in (s.get("envs") or {}).items()
                                                if v.status in ("rejected", "needs_human")}
        chosen = select_capabilities(s["capabilities"], done, self.cfg.max_capabilities, self.cfg.train_unkept)
        decision = {"approve": [c.name for c in chosen], "reject": {}}
        if chosen and "capabilities" in self.cfg.approvals:
            decision = interrupt({"id": f"capabilities@{s.get('iteration', 0)}", "kind": "capabilities",
                                  "title": "Approve the capabilities to train",
                                  "items": [c.model_dump(include={"name", "description", "cov_mean", "delta_mean",
                                                                  "runs_passed", "n_runs", "example_failed_task_ids",
                                                                  "below_threshold"}) for c in chosen]})
        by_name = {c.name: c for c in chosen}
        approve = [n for n in decision.get("approve", []) if n in by_name]
        rejected = decision.get("reject", {})
        caps = []
        for c in s["capabilities"]:
            c = by_name.get(c.name, c)
            if c.name in approve:
                c = c.model_copy(update={"status": "APPROVED"})
            elif c.name in rejected:
                c = c.model_copy(update={"status": "REJECTED", "reason": rejected[c.name]})
            caps.append(c)
        path = self.run.analysis(s.get("iteration", 0)).capabilities
        if path.is_file():  # the decisions in the analysis file too
            data = self.run.analysis(s.get("iteration", 0)).read_capabilities()
            status = {c.name: c.status for c in caps}
            for c in data["capabilities"]:
                c["status"] = status.get(c["name"], c["status"])
            atomic_write_json(path, data)
        return {"capabilities": caps, "queue": approve, "selected": len(approve)}

    def next_capability(self, s: State) -> dict:
        queue = list(s.get("queue") or [])
        return {"current": queue.pop(0) if queue else None, "queue": queue, "rounds": 0}

    # -- 3. synthesis: one builder/verifier round per visit, then approval
    def synthesise(self, s: State) -> dict:
        from trace_rl.agents.analyst import compact
        from trace_rl.agents.builders import Target
        from trace_rl.agents.env_builder import builder_mode, synthesize_round

        cap, rnd, c = self.cap(s), s.get("rounds", 0) + 1, self.comps
        trajs = {t.key: t for p in self.run.rollout_stores(s.get("iteration", 0)) for t in TrajectoryStore(p).all()}
        examples = [compact(trajs[k], 3000) for k in cap.example_failed_task_ids if k in trajs]
        record = synthesize_round(cap, Target.of(c.benchmark),
                                  c.builder, self.run.env(cap.name), rnd, examples=examples,
                                  reviewer=c.reviewer, base_policy=c.calibration, cfg=self.cfg.verify,
                                  max_rounds=self.cfg.build_rounds, library_fallback=self.cfg.library_fallback,
                                  mode=builder_mode(self.cfg.builder_mode, c.builder), log=self.log)
        return {"rounds": rnd, **({"envs": {cap.name: record}} if record else {})}

    def approve_env(self, s: State) -> dict:
        from langgraph.types import interrupt

        name, env = s["current"], s["envs"][s["current"]]
        verified = env.status == "verified"
        decided = lambda **update: {"envs": {name: env.model_copy(update=update)}}  # the env's record, updated
        if verified and "environments" not in self.cfg.approvals:
            return decided(approved=True)
        if not verified and (self.cfg.auto_approve or not env.env):
            # unattended, or the builder never wrote a module: nothing a human could approve here
            return decided(approved=False)
        decision = interrupt({"id": f"env:{name}@{s.get('iteration', 0)}", "kind": "environment",
                              "title": f"Environment for {name}", "capability": self.cap(s).model_dump(),
                              "env": env.model_dump(), "verified": verified})
        if decision.get("action") == "approve":
            return decided(approved=True, status="verified" if verified else "human_approved")
        return decided(approved=False, status="rejected", reason=decision.get("reason", ""))

    # -- 4. training, once every environment is built: held-out before, GRPO, held-out after
    def train(self, s: State) -> dict:
        name = self.untrained(s)
        env = s["envs"][name]
        cap = next((c for c in s.get("capabilities") or [] if c.name == name), None)
        trained_on = env.trained_on or Capability(name=name, description=cap.description if cap else name)
        return {"adapters": {name: self.train_env(name, self.here(env.env), trained_on, env.substitute)}}

    def train_env(self, name: str, env: str, trained_on: Capability, substitute: str | None = None):
        """One capability's training on its environment module (also `trace-rl train ENV`); None on a
        data-parallel rank other than 0."""
        from trace_rl.training.train import train_capability

        cfg = self.cfg
        return train_capability(name, env, self.run.train(name), self.comps.load_base, cfg.grpo, trained_on=trained_on,
                                train_seeds=cfg.train_seeds, heldout_seeds=cfg.heldout_seeds, substitute=substitute,
                                log=self.log, decode=cfg.decode, sandbox=cfg.sandbox,
                                rollout_url=self._rollout_server())

    # -- 5. composition and evaluation
    def compose(self, s: State) -> dict:
        from trace_rl.training.compose import compose_trained, gate_summary

        adapters = {k: a.model_copy(update={"adapter": self.here(a.adapter)}) if a.adapter else a
                    for k, a in (s.get("adapters") or {}).items()}
        path, untrained = compose_trained(adapters, self.run.train, self.run.composition,
                                          self.comps.load_base, log=self.log, **self.cfg.compose.model_dump())
        return {"composition": path, "gates_untrained": untrained, "gates": gate_summary(path) if path else None}

    def train_target(self, s: State) -> dict:
        """The baseline (config `target_baseline`): GRPO on the target's own rollout-split tasks with
        as many GRPO steps (same group sizes: the same rollouts) as all capabilities' GRPO together."""
        from trace_rl.training.train import train_on_target

        if not self.cfg.target_baseline:
            return {}
        trace_steps = sum(a.steps or 0 for a in (s.get("adapters") or {}).values())
        grpo = self.cfg.grpo.model_copy(update={"steps": trace_steps or self.cfg.grpo.steps})
        record = train_on_target(self.comps.benchmark, self._task_ids(self.cfg.rollout_split, self.cfg.rollout_tasks),
                                 self.run.train_target, self.comps.load_base, grpo, log=self.log, decode=self.cfg.decode,
                                 rollout_url=self._rollout_server())
        return {"target_adapter": record}

    def _rollout_server(self) -> str | None:
        """serve=vllm: the base model's vLLM server (LoRA on, the weights GRPO trains on), where GRPO generates
        its groups with the adapter pushed after each step; None: the engine in-process (any other serve, and
        data-parallel training, where each process would start a server of its own)."""
        cfg = self.cfg
        if cfg.serve != "vllm" or cfg.agent_llm().base_url or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return None
        from trace_rl.models.llm import served

        return served(cfg.agent_llm(), "vllm", cfg.serve_rows, lora_capable=True, weights=cfg.train_model,
                      gpu_memory=cfg.vllm_gpu_memory).base_url

    def _composition(self):
        from trace_rl.training.compose import load

        model, tok = self.comps.load_base()
        return load(model, tok, self.run.composition, max_new_tokens=self.cfg.agent.max_tokens,
                    rows=self._rows(model), decode=self.cfg.decode)

    def _rows(self, model) -> int | None:
        """On a GPU, the in-process rows decode every episode the evaluation runs at once (the
        engine's default, 16, would take a 40-task row in three waves); on a CPU the default."""
        return self.cfg.agent.concurrency if next(model.parameters()).device.type == "cuda" else None

    def _llama_cpp_rows(self, s: State) -> dict:
        """The composition's rows that llama.cpp or vLLM can serve (the base, and each adapter alone: a GGUF LoRA,
        a vLLM LoRA request): on a CPU and τ²'s long prompts much faster than in-process fp32. The router and the
        moe stay in-process, on the engine."""
        if not self.comps.lora_agent:
            return {}
        from trace_rl.training.compose import adapter_names

        trained = adapter_names(s.get("adapters") or {})
        return {"base": self.comps.lora_agent(None), **{name: self.comps.lora_agent(self.here(s["adapters"][key].adapter))
                                                         for key, name in trained.items()}}

    def evaluate(self, s: State) -> dict:
        from trace_rl.evals.evaluate import evaluate

        cfg, notes = self.cfg, row_notes(s)
        if s.get("composition"):
            from trace_rl.training.compose import saved_modes

            modes = saved_modes(self.run.composition)
            if unknown := set(cfg.eval_modes or []) - set(modes):
                raise ValueError(f"eval_modes: {sorted(unknown)} are not modes of this composition ({modes})")
            wanted = [m for m in modes if not cfg.eval_modes or m in cfg.eval_modes]
            skipped = {"moe": notes["moe"]} if s.get("gates_untrained") and "moe" in wanted else {}
            wanted = [m for m in wanted if m not in skipped]  # moe = base: not measured twice
            served = self._llama_cpp_rows(s)
            # the in-process model is loaded only for rows llama.cpp cannot serve (router, moe)
            comp = self._composition() if any(m not in served for m in wanted) else None
            policies = {m: served.get(m) or comp.policy(m) for m in wanted}
        else:  # nothing was trained: the base alone, and the rows that could not exist say why
            comp, policies, skipped = None, {"base": self.comps.agent}, {m: notes[m] for m in ("router", "moe")}
        target = s.get("target_adapter")
        if target is not None and not target.untrained:
            from trace_rl.training.train import target_policy

            target = target.model_copy(update={"adapter": self.here(target.adapter)})
            policies["grpo_target"] = self.comps.lora_agent(target.adapter) if self.comps.lora_agent \
                else target_policy(target, self.comps.load_base, cfg.agent.max_tokens, self._rows, cfg.decode)
        elif target is not None:
            skipped["grpo_target"] = "grpo_target = base: no GRPO step on the target had a reward signal"
        try:
            results = evaluate(self.comps.benchmark, policies, self._task_ids(cfg.eval_split, cfg.eval_tasks),
                               self.run.eval(s.get("iteration", 0)), split=cfg.eval_split, trials=cfg.eval_trials or cfg.trials,
                               skipped=skipped, mode_tasks=cfg.eval_mode_tasks, passed_threshold=cfg.passed_threshold,
                               concurrency=cfg.agent.concurrency, step_timeout_s=cfg.agent.step_timeout,
                               max_steps=cfg.agent.max_steps, capabilities=[c for c in s.get("capabilities") or [] if c.status == "APPROVED"],
                               **cfg.executor_kw())
        finally:
            from trace_rl.models.llm import stop_lora_endpoints

            stop_lora_endpoints()  # the adapter rows' llama.cpp servers: done with
        if comp is not None and "skipped" not in results.get("router", {"skipped": True}):
            episodes = TrajectoryStore(self.run.eval(s.get("iteration", 0)).mode("router")).all()  # resumed ones too
            results["router"]["routes"] = comp.route_counts([t.messages for t in episodes])
        return {"results": results}

    def report(self, s: State) -> None:
        options = ", ".join(f"{k}={v}" for k, v in sorted(self.cfg.benchmark_options.items())
                            if isinstance(v, (str, int, float, bool)))  # not a user_llm's settings
        write_run_report(s, self.run.root, self.cfg.benchmark + (f" ({options})" if options else ""))  # a moved ticket shows

    # -- the autonomous loop
    def loop_decision(self, s: State) -> str:
        loop = self.cfg.loop
        if not loop.enabled or not s.get("selected"):
            return "end"  # off, or the last analysis found nothing new to train
        figs, hours = s.get("rollout_figures") or [], sum((s.get("timings") or {}).values()) / 3600
        spent = (s.get("iteration", 0) + 1 >= loop.max_iterations or hours >= loop.max_hours
                 or sum(f["episodes"] for f in figs) >= loop.max_rollouts
                 or sum(f.get("tokens", 0) for f in figs) >= loop.max_tokens)
        return "end" if spent else "again"

    def next_iteration(self, s: State) -> dict:
        return {"iteration": s.get("iteration", 0) + 1, "queue": [], "current": None}

    # -- graph wiring: all nodes and edges in one place
    def graph(self):
        from langgraph.graph import END, START, StateGraph

        g = StateGraph(State)
        for n in NODES:
            g.add_node(n, self._timed(n, getattr(self, n)))
        for a, b in [(START, "rollout"), ("rollout", "analyse"), ("analyse", "select"), ("select", "next_capability"),
                     ("approve_env", "next_capability"), ("compose", "train_target"), ("train_target", "evaluate"),
                     ("evaluate", "report"), ("next_iteration", "rollout")]:
            g.add_edge(a, b)
        # all environments are built (and approved) before any training: Docker machine first, GPU machine after.
        # compose runs (and skips, saying so) even when nothing was trained: the base row is always measured
        to_train = lambda s: "train" if self.untrained(s) else "compose"  # noqa: E731
        g.add_conditional_edges("next_capability", lambda s: "synthesise" if s.get("current") else to_train(s),
                                ["synthesise", "train", "compose"])
        g.add_conditional_edges("synthesise", lambda s: "approve_env" if s["current"] in (s.get("envs") or {})
                                else "synthesise", ["synthesise", "approve_env"])
        g.add_conditional_edges("train", to_train, ["train", "compose"])
        g.add_conditional_edges("report", self.loop_decision, {"again": "next_iteration", "end": END})
        return g

    def _timed(self, name: str, fn):
        def node(s: State) -> dict:
            t0 = time.perf_counter()
            self.log(f"[{name}] start")
            out = fn(s) or {}
            if self.comps.after_node:
                self.comps.after_node(name)
            return {**out, "timings": {name: time.perf_counter() - t0}}
        return node


NODES = ["rollout", "analyse", "select", "next_capability", "synthesise", "approve_env", "train", "compose",
         "train_target", "evaluate", "report", "next_iteration"]


# ---------------------------------------------------------------- running, resuming
DECISION_STAGE = {"capabilities@": "analyse", "env:": "synthesise"}  # an approval belongs to what it judged


def saved_fingerprints(run_dir: Path) -> dict:
    """Fingerprints of the config a run directory was made with ({} when unknown: all stale)."""
    try:
        return stage_fingerprints(load_saved_config(RunDir(run_dir)))
    except FileNotFoundError:
        return {}


def retire_stale_stages(run_dir: Path, cfg: RunConfig, log=print) -> list[str]:
    """A run directory re-entered with a changed config: the first stage whose fingerprint
    changed and every stage after it are re-run. Their outputs (and the graph checkpoint,
    whose state holds their results) move to RUN_DIR/stale/<time>/, never deleted; unchanged
    stages replay from their on-disk caches without redoing work. Returns the stale stages."""
    run = RunDir(run_dir)
    path, new = run.stages, stage_fingerprints(cfg)
    if path.is_file():  # even without a checkpoint: outputs on disk must match the config that made them
        old = read_control(path, dict[str, str], "remove it only if every stage's output may be reused")
    elif run.checkpoint.exists():
        old = saved_fingerprints(run_dir)
    else:
        atomic_write_json(path, new)
        return []
    stages = list(STAGE_FIELDS)
    changed = [st for st in stages if old.get(st) != new[st]]
    if not changed:
        return []
    stale = stages[stages.index(changed[0]):]
    saved = json.loads(run.config.read_text()) if run.config.is_file() else {}
    now = cfg.model_dump(mode="json")
    fields = [f for f in STAGE_FIELDS[changed[0]] if saved.get(f) != now.get(f)]
    archive = run.archive()
    archive.mkdir(parents=True, exist_ok=True)
    later = [i for i in run.iterations() if i > 0]  # loop iterations build on all stages
    moved = [run.root / p for st in stale for p in run.stage_outputs(st)] + (
        [run.eval(i).root for i in later] if stale == ["evaluate"] else [run.iteration(i) for i in later]) + [
        *(run.root / f for f in CHECKPOINT), run.report_json, run.report_md, run.pending]
    for src in moved:
        if src.exists():
            dest = archive / src.relative_to(run.root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            src.rename(dest)
    decisions = read_decisions(run_dir)
    if decisions:
        atomic_write_json(RunDir(archive).approvals, decisions)
        keep = {k: v for k, v in decisions.items()
                if not any(k.startswith(p) and st in stale for p, st in DECISION_STAGE.items())}
        atomic_write_json(run.approvals, keep)
    atomic_write_json(path, new)
    log(f"config changed ({', '.join(fields) or changed[0] + ' inputs'}): re-running {', '.join(stale)}; "
        f"their earlier outputs moved to {archive}")
    return stale


def check_until(until: str | None) -> None:
    """`until` must name a node: a misspelt one would never stop the run."""
    if until is not None and until not in NODES:
        raise ConfigError(f"--until {until!r} is not a node of the pipeline; nodes: {', '.join(NODES)}")


def compiled(run_dir: Path, cfg: RunConfig, log=print, until: str | None = None):
    """The Pipeline's graph compiled with the run directory's checkpoint database (with `until`, a
    breakpoint before that node)."""
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
    from langgraph.checkpoint.sqlite import SqliteSaver

    records = [(t.__module__, t.__name__) for t in RECORD_TYPES] + [("trace_rl.core.records", "TrainedOn")]  # and
    # the name earlier runs' checkpoints gave the capability an adapter trained on
    saver = SqliteSaver(sqlite3.connect(str(RunDir(run_dir).checkpoint), check_same_thread=False),
                        serde=JsonPlusSerializer(allowed_msgpack_modules=records))
    app = Pipeline(run_dir, cfg, log).graph().compile(checkpointer=saver, interrupt_before=[until] if until else None)
    try:
        app.get_state(THREAD)  # the saved state decodes, or one line saying how to recover
    except Exception as err:  # whatever a damaged blob makes the deserializer raise
        db = RunDir(run_dir).checkpoint
        raise RunDirError(f"{db}: the checkpoint cannot be read ({type(err).__name__}: {str(err)[:100]}); move "
                          f"{db.name}* away and `trace-rl resume {run_dir}` to start this run over (stages replay "
                          "from their outputs on disk)") from None
    return app


def drive(run_dir: str | Path, cfg: RunConfig, *, resume: bool, wait: bool = True, web_port: int | None = None,
          log=print, until: str | None = None) -> dict:
    """Run (or resume) the graph until it ends or needs a decision nobody has given.

    Decisions come from approvals.json (`trace-rl approve`, the web page) or, with
    `auto_approve`, are made here. With `wait`, an undecided approval blocks (polling
    approvals.json, serving the web page if `web_port` is set) instead of returning.
    With `until`, the run stops before that node ({"status": "stopped"}): e.g. every
    environment built on the Docker machine, training left to a `resume` on a GPU machine."""
    check_until(until)
    run_dir, run = Path(run_dir), RunDir(run_dir)
    run.check()
    read_decisions(run_dir), pending_item(run_dir)  # control files of the wrong shape: refused before any change
    run_dir.mkdir(parents=True, exist_ok=True)
    with run.writer():
        return _drive_locked(run_dir, cfg, wait, web_port, log, until)


def _drive_locked(run_dir: Path, cfg: RunConfig, wait: bool, web_port: int | None, log, until: str | None) -> dict:
    run = RunDir(run_dir)
    stale = retire_stale_stages(run_dir, cfg, log)
    from langgraph.types import Command

    app = compiled(run_dir, cfg, log, until)
    started = app.get_state(THREAD).values
    stopped = lambda st: {"status": "stopped", "before": until, "state": st.values}  # noqa: E731
    if started and until in app.get_state(THREAD).next and not pending(app):
        return stopped(app.get_state(THREAD))  # already stopped there: running on would pass the breakpoint
    inp: Any = None if started else {"iteration": 0, "envs": {}, "adapters": {}, "timings": {}}
    if not started or stale:
        save_config(run, cfg)  # `resume`, `approve` and `status` need only the run directory
    server = None
    try:
        while True:
            app.invoke(inp, THREAD)
            items = pending(app)
            if not items:
                run.pending.unlink(missing_ok=True)
                st = app.get_state(THREAD)
                return stopped(st) if until in st.next else {"status": "done", "state": st.values}
            item = items[0]
            atomic_write_json(run.pending, item)  # for the web page and `trace-rl approve`
            decided = read_decisions(run_dir).get(item["id"])
            if decided is None and cfg.auto_approve:
                decided = auto_decision(item)
                record_decision(run_dir, item["id"], decided)
            if decided is None and not wait:
                return {"status": "waiting", "pending": item}
            if decided is None:
                if web_port is not None and server is None:
                    from trace_rl.graph.web import serve

                    server = serve(run_dir, web_port)
                    log(f"approval page: http://127.0.0.1:{server.server_port}/")
                log(f"waiting for a decision on {item['id']}: `trace-rl approve {run_dir}` or the web page")
                while (decided := read_decisions(run_dir).get(item["id"])) is None:
                    time.sleep(0.5)
            log(f"decision on {item['id']}: {decided}")
            inp = Command(resume=check_decision(run_dir, item, decided))
    finally:
        if server is not None:
            server.shutdown()
