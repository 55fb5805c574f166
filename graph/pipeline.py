"""The TRACE pipeline as a LangGraph state machine, resumable after any crash.

    rollout → analyse → select ─┬→ next_capability → build → verify ─┬→ approve_env → train → next_capability …
                                │                      ↑______________│ (findings back, ≤ build_rounds)
                                └→ compose → evaluate → report → (autonomous loop: rollout again) → END

Every node does its work through on-disk caches (the trajectory store, the analyst's label
cache, one folder per builder round, GRPO checkpoints, the composition artefact), so a node
killed half-way and re-entered on resume redoes nothing. The graph state holds small figures
and paths; artefacts live in the run directory. Approvals are LangGraph interrupts; decisions
are recorded in RUN_DIR/approvals.json (by `trace-rl approve`, the web page, or auto-approve).
"""
from __future__ import annotations

import importlib
import json
import operator
import os
import signal
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, TypedDict

from trace_rl.core.io import atomic_write_json
from trace_rl.graph.config import RunConfig


def adapter_changed(path) -> bool:
    from trace_rl.training.grpo import adapter_changed as changed

    return changed(path)


def gates_untrained(composition_dir) -> bool:
    """A composition whose gates saw no example routes every token to the base (slot 0)."""
    manifest = json.loads((Path(composition_dir) / "manifest.json").read_text())
    return not (manifest.get("gate_training") or {}).get("examples")


# ---------------------------------------------------------------- state
def _merge(a: dict, b: dict) -> dict:
    return {**(a or {}), **(b or {})}


def _add_times(a: dict, b: dict) -> dict:
    out = dict(a or {})
    for k, v in (b or {}).items():
        out[k] = round(out.get(k, 0.0) + v, 2)
    return out


class State(TypedDict, total=False):
    iteration: int
    capabilities: list[dict]  # this iteration's analysis: figures, status
    analysis: dict  # this iteration's labelling figures: trajectories, passed, unlabelled pairs per run
    queue: list[str]  # approved capabilities still to build and train
    current: str | None
    rounds: int  # builder rounds spent on `current`
    feedback: str | None  # the last verifier findings, for the next build round
    envs: Annotated[dict, _merge]  # capability -> {status, env, rounds, source}
    adapters: Annotated[dict, _merge]  # capability -> {adapter, before, after, steps}
    composition: str | None
    gates_untrained: bool | None  # the composition's gates saw no example: moe = base
    results: dict  # final evaluation per mode
    rollout_figures: Annotated[list, operator.add]  # one per iteration
    timings: Annotated[dict, _add_times]  # seconds per node, summed over iterations and retries
    selected: int  # capabilities approved by the last selection (0 ends the autonomous loop)


class TrainIn(TypedDict):
    current: str
    envs: Annotated[dict, _merge]
    adapters: Annotated[dict, _merge]


class TrainOut(TypedDict, total=False):
    adapters: Annotated[dict, _merge]
    timings: Annotated[dict, _add_times]


class TrainState(TrainIn, TrainOut):
    """The training subgraph's own state: it starts without the parent's timings and returns
    only `adapters` and its own timings, so the parent's reducers count nothing twice."""


# ---------------------------------------------------------------- components
@dataclass
class Components:
    """What the stages run on. `default_components` builds the real ones from the config;
    `RunConfig.components` may name another factory (tests use scripted LLMs and tiny models)."""
    benchmark: Any  # the target Benchmark
    agent: Any  # base-agent policy for rollouts (an LLM endpoint)
    analyst: Any
    builder: Any
    reviewer: Any | None
    calibration: Any | None  # base-model policy for environment calibration
    load_base: Callable[[], tuple]  # fresh (transformers model, tokenizer) of the base
    extra: dict = field(default_factory=dict)


def default_components(cfg: RunConfig) -> Components:
    from trace_rl.core.llm import LLM, LLMConfig
    from trace_rl.evals.benchmark import load_benchmark
    from trace_rl.training.compose import load_base

    def llm(spec) -> LLM:
        return LLM(LLMConfig(model=spec.model, base_url=spec.base_url, max_tokens=spec.max_tokens,
                             temperature=spec.temperature))

    opts: dict = {"max_steps": cfg.agent.max_steps}
    if cfg.user_model:
        opts["user_llm"] = LLMConfig(model=cfg.user_model.model, base_url=cfg.user_model.base_url)
    agent = LLM(LLMConfig(model=cfg.base_model, base_url=cfg.base_url, max_tokens=cfg.agent.max_tokens,
                          temperature=cfg.agent.temperature))
    return Components(
        benchmark=load_benchmark(cfg.benchmark, options=cfg.benchmark_options, offer=opts), agent=agent,
        analyst=llm(cfg.analyst),
        builder=llm(cfg.builder), reviewer=llm(cfg.reviewer or cfg.builder),
        calibration=agent if cfg.calibrate else None,
        load_base=lambda: load_base(cfg.train_model or cfg.base_model))


def make_components(cfg: RunConfig) -> Components:
    if not cfg.components:
        return default_components(cfg)
    module, _, fn = cfg.components.partition(":")
    return getattr(importlib.import_module(module), fn or "components")(cfg)


# ---------------------------------------------------------------- the pipeline
NODES = ["rollout", "analyse", "select", "next_capability", "build", "verify", "approve_env", "train",
         "compose", "evaluate", "report"]


class Pipeline:
    def __init__(self, run_dir: str | Path, cfg: RunConfig, log: Callable[[str], None] = print):
        self.dir, self.cfg, self.log = Path(run_dir), cfg, log
        self._comps: Components | None = None

    @property
    def comps(self) -> Components:
        if self._comps is None:
            self._comps = make_components(self.cfg)
        return self._comps

    def it(self, s: State) -> Path:
        return self.dir / f"iter_{s.get('iteration', 0)}"

    def cap(self, s: State, name: str | None = None) -> dict:
        name = name or s["current"]
        return next(c for c in s["capabilities"] if c["name"] == name)

    # -- 1. rollouts of the base agent (or, in later loop iterations, of the composed model)
    def rollout(self, s: State) -> dict:
        from trace_rl.evals.report import write_report
        from trace_rl.core.trajectory import TrajectoryStore
        from trace_rl.evals.rollout import rollout

        bench, cfg = self.comps.benchmark, self.cfg
        ids = [t.id for t in bench.tasks(cfg.rollout_split)]
        ids = ids[:cfg.rollout_tasks] if cfg.rollout_tasks else ids
        policy = self.comps.agent
        if s.get("iteration", 0) > 0 and s.get("composition"):
            policy = self._composition().policy("moe")
        out = self.it(s) / "rollouts"
        trajs = rollout(bench, policy, ids, TrajectoryStore(out), trials=cfg.trials,
                        concurrency=cfg.agent.concurrency, split=cfg.rollout_split, passed_threshold=cfg.passed_threshold)
        report = write_report(trajs, out, title=f"{policy.name} on {bench.name} [{cfg.rollout_split}]")
        figs = next(iter(report["groups"].values()))
        return {"rollout_figures": [{"iteration": s.get("iteration", 0), "model": policy.name,
                                     "passed": figs["passed"], "episodes": figs["episodes"],
                                     "pass@1": figs["pass@1"], "tokens": figs["tokens"]}]}

    # -- 2. contrastive analysis
    def analyse(self, s: State) -> dict:
        from dataclasses import asdict

        from trace_rl.agents.analyst import analyze
        from trace_rl.core.trajectory import TrajectoryStore

        trajs = TrajectoryStore(self.it(s) / "rollouts").all()
        results = analyze(trajs, self.comps.analyst, self.it(s) / "analysis", self.cfg.analysis, progress=True)
        out = json.loads((self.it(s) / "analysis" / "capabilities.json").read_text())
        return {"capabilities": [{k: v for k, v in asdict(r).items() if k != "runs"} for r in results],
                "analysis": {k: out[k] for k in ("trajectories", "passed", "failed", "labelling_runs")}}

    # -- 3. selection (+ human approval)
    def select(self, s: State) -> dict:
        from langgraph.types import interrupt

        trained = set(s.get("adapters") or {}) | {k for k, v in (s.get("envs") or {}).items()
                                                   if v.get("status") in ("rejected", "needs_human")}
        fresh = [c for c in s["capabilities"] if c["name"] not in trained]
        kept = [c for c in fresh if c["kept"]][:self.cfg.max_capabilities]
        if len(kept) < self.cfg.train_unkept:  # explicit opt-in for weak analysts; reported as such
            extra = [{**c, "below_threshold": True} for c in fresh if not c["kept"]]
            kept += extra[:min(self.cfg.train_unkept, self.cfg.max_capabilities) - len(kept)]
        decision = {"approve": [c["name"] for c in kept], "reject": {}}
        if kept and "capabilities" in self.cfg.approvals:
            decision = interrupt({"id": f"capabilities@{s.get('iteration', 0)}", "kind": "capabilities",
                                  "title": "Approve the capabilities to train",
                                  "items": [{k: c.get(k) for k in ("name", "description", "cov_mean", "delta_mean",
                                                                   "runs_passed", "n_runs", "example_failed_task_ids",
                                                                   "below_threshold")} for c in kept]})
        approve = [n for n in decision.get("approve", []) if n in {c["name"] for c in kept}]
        rejected = decision.get("reject", {})
        below = {c["name"] for c in kept if c.get("below_threshold")}
        caps = []
        for c in s["capabilities"]:
            status = "APPROVED" if c["name"] in approve else "REJECTED" if c["name"] in rejected else c["status"]
            caps.append({**c, "status": status, **({"reason": rejected[c["name"]]} if c["name"] in rejected else {}),
                         **({"below_threshold": True} if c["name"] in below else {})})
        self._write_statuses(s, caps)
        return {"capabilities": caps, "queue": approve, "selected": len(approve)}

    def _write_statuses(self, s: State, caps: list[dict]) -> None:
        path = self.it(s) / "analysis" / "capabilities.json"
        if path.is_file():
            data = json.loads(path.read_text())
            by_name = {c["name"]: c for c in caps}
            for c in data["capabilities"]:
                c["status"] = by_name.get(c["name"], c)["status"]
            atomic_write_json(path, data)

    def next_capability(self, s: State) -> dict:
        queue = list(s.get("queue") or [])
        return {"current": queue.pop(0) if queue else None, "queue": queue, "rounds": 0, "feedback": None}

    # -- 4. synthesis: build, verify (loop), approve
    def _target(self):
        from trace_rl.agents.env_builder import Target

        spec = self.comps.benchmark.spec()
        return Target(self.comps.benchmark.name, spec["tools"], spec["policy"], spec["system_prompt"])

    def env_dir(self, name: str) -> Path:
        return self.dir / "envs" / name

    def build(self, s: State) -> dict:
        from trace_rl.agents.analyst import compact
        from trace_rl.agents.env_builder import attempt_dir, build_attempt
        from trace_rl.core.trajectory import TrajectoryStore

        cap, rnd = self.cap(s), s.get("rounds", 0) + 1
        store = TrajectoryStore(self.it(s) / "rollouts")
        examples = [compact(store.get(k), 3000) for k in cap["example_failed_task_ids"] if k in store]
        prev = attempt_dir(self.env_dir(cap["name"]), rnd - 1) / "env.py"
        build_attempt(self.comps.builder, cap, self._target(), examples, self.env_dir(cap["name"]), rnd,
                      s.get("feedback"), prev.read_text() if prev.is_file() else None)
        return {"rounds": rnd}

    def _verify(self, cap: dict, attempt: dict) -> dict:
        from trace_rl.agents.env_builder import verify_attempt

        return verify_attempt(attempt, cap, self._target(), self.cfg.verify, self.comps.reviewer,
                              self.comps.calibration)

    def verify(self, s: State) -> dict:
        from trace_rl.agents.env_builder import attempt_dir, library_match

        cap, rnd = self.cap(s), s["rounds"]
        adir = attempt_dir(self.env_dir(cap["name"]), rnd)
        attempt = {"round": rnd, "env": str(adir / "env.py")} if (adir / "env.py").is_file() else \
            {"round": rnd, "error": json.loads((adir / "builder_error.json").read_text())["error"]}
        report = self._verify(cap, attempt)
        if report["passed"]:
            return {"envs": {cap["name"]: {"status": "verified", "env": attempt["env"], "rounds": rnd, "source": "builder"}}}
        if rnd < self.cfg.build_rounds:
            return {"feedback": report["feedback"]}
        lib = library_match(cap, self.comps.benchmark.name) if self.cfg.library_fallback else None
        if lib is not None:  # verified like any other environment, in its own attempt folder
            ldir = self.env_dir(cap["name"]) / "library"
            ldir.mkdir(parents=True, exist_ok=True)
            if not (ldir / "env.py").is_file():
                (ldir / "env.py").write_text(lib["path"].read_text())
            lreport = self._verify(cap, {"round": "library", "env": str(ldir / "env.py")})
            if lreport["passed"]:
                self.log(f"{cap['name']}: builder failed {rnd} round(s); SUBSTITUTE: library environment "
                         f"{lib['name']} ({lib['why']})")
                return {"envs": {cap["name"]: {
                    "status": "verified", "env": str(ldir / "env.py"), "rounds": rnd, "source": f"library:{lib['name']}",
                    "substitute": f"library environment {lib['name']} ({lib['why']}): the builder's "
                                  f"{rnd} round(s) failed", "trained_on": {"name": lib["name"],
                                                                          "description": lib["description"]},
                    "builder_findings": report["feedback"]}}}
        why = ("library_fallback is off" if not self.cfg.library_fallback else "no library environment matches"
               if lib is None else f"the matching library environment {lib['name']} failed verification too")
        return {"envs": {cap["name"]: {"status": "needs_human", "env": attempt.get("env"), "rounds": rnd,
                                       "source": "builder", "findings": report["feedback"],
                                       "reason": f"{rnd} builder round(s) failed verification; {why}"}}}

    def approve_env(self, s: State) -> dict:
        from langgraph.types import interrupt

        name = s["current"]
        env = (s.get("envs") or {}).get(name, {})
        verified = env.get("status") == "verified"
        if verified and "environments" not in self.cfg.approvals:
            return {"envs": {name: {**env, "approved": True}}}
        if not verified and (self.cfg.auto_approve or not env.get("env")):
            # unattended, or the builder never wrote a module: nothing a human could approve here
            return {"envs": {name: {**env, "approved": False}}}
        decision = interrupt({"id": f"env:{name}@{s.get('iteration', 0)}", "kind": "environment",
                              "title": f"Environment for {name}", "capability": self.cap(s),
                              "env": env, "verified": verified})
        if decision.get("action") == "approve":
            return {"envs": {name: {**env, "approved": True, "status": "verified" if verified else "human_approved"}}}
        return {"envs": {name: {**env, "approved": False, "status": "rejected", "reason": decision.get("reason", "")}}}

    # -- 5. training (a subgraph: held-out before, GRPO, held-out after)
    def train_dir(self, name: str) -> Path:
        return self.dir / "train" / name

    def _env_bench(self, name: str, seeds: range, code: str):
        from trace_rl.evals.synthetic import SyntheticBenchmark

        return SyntheticBenchmark(code, name=f"env:{name}", seeds=seeds, pool_size=1)

    def heldout_seeds(self) -> range:
        return range(10**6, 10**6 + self.cfg.heldout_seeds)  # disjoint from the training seeds

    def _heldout(self, name: str, env_code: str, policy, tag: str) -> dict:
        from trace_rl.evals.report import summarize
        from trace_rl.core.trajectory import TrajectoryStore
        from trace_rl.evals.rollout import rollout

        seeds = self.heldout_seeds()
        with self._env_bench(name, seeds, env_code) as bench:
            trajs = rollout(bench, policy, [str(x) for x in seeds], TrajectoryStore(self.train_dir(name) / f"heldout_{tag}"),
                            split="heldout", max_steps=self.cfg.grpo.max_turns)
        figs = next(iter(summarize(trajs).values()))
        return {"success": figs["pass@1"], "mean_reward": figs["mean_reward"], "episodes": figs["episodes"]}

    def _policy(self, model, tok, name: str):
        from trace_rl.training.hf_policy import HFPolicy

        return HFPolicy(model, tok, name, max_new_tokens=self.cfg.grpo.max_turn_tokens)

    def heldout_before(self, s: State) -> dict:
        name = s["current"]
        code = Path(s["envs"][name]["env"]).read_text()
        model, tok = self.comps.load_base()
        before = self._heldout(name, code, self._policy(model, tok, "base"), "before")
        env = s["envs"][name]
        trained_on = env.get("trained_on") or {"name": name, "description": self.cap(s, name)["description"]
                                               if any(c["name"] == name for c in s.get("capabilities") or []) else name}
        return {"adapters": {name: {"before": before, "trained_on": trained_on,
                                    **({"substitute": env["substitute"]} if env.get("substitute") else {})}}}

    def grpo(self, s: State) -> dict:
        from trace_rl.training.grpo import CapabilityGRPO

        name = s["current"]
        out = self.train_dir(name) / "grpo"
        code = Path(s["envs"][name]["env"]).read_text()
        tools_path = self.train_dir(name) / "tools.json"
        if not tools_path.is_file():  # before training: a kill after the adapter is saved must find it too
            atomic_write_json(tools_path, self._env_tools(name, code))
        if (out / "adapter" / "adapter_config.json").is_file() and (out / "train_log.json").is_file():
            log = json.loads((out / "train_log.json").read_text())
            return {"adapters": {name: {**s["adapters"][name], "adapter": str(out / "adapter"), "steps": len(log),
                                        "untrained": not adapter_changed(out / "adapter")}}}
        model, tok = self.comps.load_base()
        with self._env_bench(name, range(self.cfg.train_seeds), code) as bench:
            res = CapabilityGRPO(model, tok, bench, [str(x) for x in range(self.cfg.train_seeds)], out,
                                 self.cfg.grpo, name=name).train()
        untrained = not adapter_changed(res.adapter)
        if untrained:
            self.log(f"{name}: UNTRAINED: after {res.steps} GRPO steps every LoRA B matrix is still zero "
                     "(no step had a reward signal); the adapter is left out of the composition")
        return {"adapters": {name: {**s["adapters"][name], "adapter": res.adapter, "steps": res.steps,
                                    "curve": res.curve, "untrained": untrained}}}

    def _env_tools(self, name: str, code: str) -> list[dict]:
        with self._env_bench(name, range(1), code) as bench:
            ep = bench.episode("0")
            try:
                ep.reset()
                return ep.tools
            finally:
                ep.close()

    def heldout_after(self, s: State) -> dict:
        from peft import PeftModel

        name = s["current"]
        code = Path(s["envs"][name]["env"]).read_text()
        model, tok = self.comps.load_base()
        tuned = PeftModel.from_pretrained(model, s["adapters"][name]["adapter"]).eval()
        after = self._heldout(name, code, self._policy(tuned, tok, name), "after")
        entry = {**s["adapters"][name], "after": after}
        atomic_write_json(self.train_dir(name) / "report.json", {"capability": name, **entry})
        self.log(f"{name}: held-out success {entry['before']['success']:.0%} -> {after['success']:.0%}")
        return {"adapters": {name: entry}}

    # -- 6. composition and evaluation
    def compose(self, s: State) -> dict:
        from trace_rl.core.trajectory import TrajectoryStore
        from trace_rl.training.compose import compose

        out = self.dir / "composition"
        trained = {k: v for k, v in (s.get("adapters") or {}).items() if v.get("adapter") and not v.get("untrained")}
        if not trained:
            self.log("compose: SKIPPED: no adapter changed during training; the final table has the base model only")
            return {"composition": None, "gates_untrained": None}
        # each adapter is named and described after the environment it really trained on
        names: dict[str, str] = {}
        for k, v in trained.items():  # two capabilities substituted by one library env keep apart
            want = (v.get("trained_on") or {}).get("name", k)
            names[k] = want if want not in names.values() else f"{want}@{k}"
        manifest = out / "manifest.json"
        if manifest.is_file() and json.loads(manifest.read_text())["adapters"] == list(names.values()):
            return {"composition": str(out), "gates_untrained": gates_untrained(out)}
        convs = []
        for name in trained:
            tools = json.loads((self.train_dir(name) / "tools.json").read_text())
            for sub in ("grpo/rollouts", "heldout_after"):
                convs += [(t.messages, tools) for t in TrajectoryStore(self.train_dir(name) / sub).all() if t.passed]
        model, tok = self.comps.load_base()
        caps = [{"name": names[n], "description": (v.get("trained_on") or {}).get("description", n)}
                for n, v in trained.items()]
        c = self.cfg.compose
        compose(model, tok, {names[n]: v["adapter"] for n, v in trained.items()}, caps, convs, out, epochs=c.epochs,
                lr=c.lr, weight_decay=c.weight_decay, lb_weight=c.lb_weight)
        if gates_untrained(out):
            self.log("compose: GATES UNTRAINED: no successful rollout to train the gates on; "
                     "the moe row routes every token to the base")
        return {"composition": str(out), "gates_untrained": gates_untrained(out)}

    def _composition(self):
        from trace_rl.training.compose import load

        model, tok = self.comps.load_base()
        return load(model, tok, self.dir / "composition", max_new_tokens=self.cfg.agent.max_tokens)

    def evaluate(self, s: State) -> dict:
        from trace_rl.evals.report import plot_pass_rates, summarize
        from trace_rl.core.trajectory import TrajectoryStore
        from trace_rl.evals.rollout import rollout

        bench, cfg = self.comps.benchmark, self.cfg
        ids = [t.id for t in bench.tasks(cfg.eval_split)]
        ids = ids[:cfg.eval_tasks] if cfg.eval_tasks else ids
        trials = cfg.eval_trials or cfg.trials
        results: dict = {}
        series = {}
        notes = row_notes(s)
        if s.get("composition"):
            comp = self._composition()
            unknown = set(cfg.eval_modes or []) - set(comp.modes)
            if unknown:
                raise ValueError(f"eval_modes: {sorted(unknown)} are not modes of this composition ({comp.modes})")
            policies = {m: comp.policy(m) for m in comp.modes if not cfg.eval_modes or m in cfg.eval_modes}
            skipped = {"moe": notes["moe"]} if s.get("gates_untrained") and "moe" in policies else {}
            policies = {m: p for m, p in policies.items() if m not in skipped}  # moe = base: not measured twice
        else:  # nothing was trained: the base alone, and the rows that could not exist say why
            policies = {"base": self.comps.agent}
            skipped = {m: notes[m] for m in ("router", "moe")}
        for mode, policy in policies.items():
            n = cfg.eval_mode_tasks.get(mode)
            trajs = rollout(bench, policy, ids[:n] if n else ids, TrajectoryStore(self.it(s) / "eval" / mode), trials=trials,
                            split=cfg.eval_split, passed_threshold=cfg.passed_threshold)
            series[mode] = summarize(trajs)
            results[mode] = {**next(iter(series[mode].values())), "trials": trials, "model": policy.name}
        results.update({m: {"skipped": why} for m, why in skipped.items()})
        plot_pass_rates(series, self.it(s) / "eval" / "report.png", f"{bench.name} [{cfg.eval_split}]: base vs composed")
        atomic_write_json(self.it(s) / "eval" / "report.json", {"benchmark": bench.name, "split": cfg.eval_split,
                                                                "tasks": ids, "trials": trials, "modes": results})
        return {"results": results}

    def report(self, s: State) -> dict:
        report = {"run_dir": str(self.dir), "benchmark": self.cfg.benchmark, "iteration": s.get("iteration", 0),
                  "rollouts": s.get("rollout_figures"),
                  "capabilities": [{k: c.get(k) for k in ("name", "description", "cov_mean", "delta_mean", "runs_passed",
                                                          "n_runs", "kept", "below_threshold", "status", "reason")}
                                   for c in s.get("capabilities") or []],
                  "analysis": s.get("analysis"), "environments": s.get("envs"), "adapters": s.get("adapters"),
                  "composition": s.get("composition"), "gates_untrained": s.get("gates_untrained"),
                  "evaluation": s.get("results"), "stages": stage_summary(s), "timings": s.get("timings")}
        atomic_write_json(self.dir / "report.json", report)
        (self.dir / "report.md").write_text(render_markdown(report))
        return {}

    # -- the autonomous loop
    def loop_decision(self, s: State) -> str:
        loop = self.cfg.loop
        if not loop.enabled or not s.get("selected"):
            return "end"  # off, or the last analysis found nothing new to train
        figs = s.get("rollout_figures") or []
        hours = sum((s.get("timings") or {}).values()) / 3600
        if s.get("iteration", 0) + 1 >= loop.max_iterations or sum(f["episodes"] for f in figs) >= loop.max_rollouts \
                or hours >= loop.max_hours or sum(f.get("tokens", 0) for f in figs) >= loop.max_tokens:
            return "end"
        return "again"

    def next_iteration(self, s: State) -> dict:
        return {"iteration": s.get("iteration", 0) + 1, "queue": [], "current": None}

    # -- graph wiring
    def graph(self):
        from langgraph.graph import END, START, StateGraph

        timed = self._timed
        train = StateGraph(TrainState, input_schema=TrainIn, output_schema=TrainOut)
        for n in ("heldout_before", "grpo", "heldout_after"):
            train.add_node(n, timed(n, getattr(self, n)))
        train.add_edge(START, "heldout_before")
        train.add_edge("heldout_before", "grpo")
        train.add_edge("grpo", "heldout_after")
        train.add_edge("heldout_after", END)

        g = StateGraph(State)
        for n in NODES:
            g.add_node(n, train.compile() if n == "train" else timed(n, getattr(self, n)))
        g.add_node("next_iteration", timed("next_iteration", self.next_iteration))
        g.add_edge(START, "rollout")
        g.add_edge("rollout", "analyse")
        g.add_edge("analyse", "select")
        g.add_edge("select", "next_capability")
        g.add_conditional_edges("next_capability", self._after_next, ["build", "compose"])
        g.add_edge("build", "verify")
        g.add_conditional_edges("verify", self._after_verify, ["build", "approve_env", "next_capability"])
        g.add_conditional_edges("approve_env", lambda s: "train" if s["envs"][s["current"]].get("approved")
                                else "next_capability", ["train", "next_capability"])
        g.add_edge("train", "next_capability")
        g.add_edge("compose", "evaluate")
        g.add_edge("evaluate", "report")
        g.add_conditional_edges("report", self.loop_decision, {"again": "next_iteration", "end": END})
        g.add_edge("next_iteration", "rollout")
        return g

    def _after_next(self, s: State) -> str:
        """Build the next capability, or go on to compose (which skips, saying so, when nothing
        was trained) and evaluate: the base row is measured even when no adapter exists."""
        return "build" if s.get("current") else "compose"

    def _after_verify(self, s: State) -> str:
        env = (s.get("envs") or {}).get(s["current"])
        if env and env["status"] == "verified":
            return "approve_env"
        if env and env["status"] == "needs_human":
            return "approve_env"  # a human may still take it
        return "build"

    def _timed(self, name: str, fn):
        def node(s: State) -> dict:
            t0 = time.perf_counter()
            self.log(f"[{name}] start")
            out = fn(s) or {}
            kill = os.environ.get("TRACE_RL_KILL_AT")  # fault injection for the resume tests
            if kill == name:
                os.kill(os.getpid(), signal.SIGKILL)
            return {**out, "timings": {name: time.perf_counter() - t0}}
        return node


def row_notes(s: dict) -> dict[str, str]:
    """Why an evaluation row is not a result of its own: {mode: note}."""
    adapters = s.get("adapters") or {}
    untrained = [k for k, v in adapters.items() if v.get("untrained")]
    notes = {}
    if not s.get("composition"):
        why = (f"no trained adapter ({', '.join(untrained)}: weights never changed)" if untrained
               else "no adapter was trained")
        notes.update({"moe": f"moe = base: {why}", "router": f"router = base: {why}"})
    elif s.get("gates_untrained"):
        notes["moe"] = "moe = base: gates untrained (0 successful rollouts to train them on)"
    for k, v in adapters.items():
        if v.get("substitute"):
            name = (v.get("trained_on") or {}).get("name", k)
            notes[name] = f"trained on a substitute: {v['substitute']}"
    return notes


STAGE_NODES = {"synthesise": ["build", "verify", "approve_env"], "train": ["heldout_before", "grpo", "heldout_after"],
               "analyse": ["analyse", "select"]}  # graph nodes whose wall time a stage row sums


def stage_summary(s: dict) -> list[dict]:
    """What each stage produced, substituted or skipped, in words: the report's first table."""
    rows = []
    figs = (s.get("rollout_figures") or [{}])[-1]
    if figs:
        rows.append({"stage": "rollout", "outcome": "produced",
                     "detail": f"{figs['episodes']} episodes of {figs['model']}, {figs['passed']} passed"})
    caps = s.get("capabilities") or []
    an = s.get("analysis") or {}
    runs = an.get("labelling_runs") or []
    unl = ", ".join(f"{r['unlabelled']}/{r['pairs']}" + ("" if r["reliable"] else " unreliable") for r in runs)
    kept = [c["name"] for c in caps if c.get("kept")]
    forced = [c["name"] for c in caps if c.get("below_threshold")]
    if caps:
        rows.append({"stage": "analyse", "outcome": "produced" if kept else "substituted" if forced else "nothing kept",
                     "detail": f"{len(caps)} candidates, kept: {', '.join(kept) or 'none'}"
                               + (f"; trained below threshold (train_unkept): {', '.join(forced)}" if forced else "")
                               + (f"; unlabelled pairs per run: {unl}" if unl else "")})
    for name, e in (s.get("envs") or {}).items():
        outcome = "substituted" if e.get("substitute") else "produced" if e["status"] == "verified" else e["status"]
        rows.append({"stage": "synthesise", "outcome": outcome, "detail": f"{name}: " + (
            e.get("substitute") or e.get("reason") or f"{e['status']} after {e.get('rounds')} builder round(s)")})
    for name, a in (s.get("adapters") or {}).items():
        if "steps" not in a:
            continue
        held = (f", held-out success {a['before']['success']:.0%} → {a['after']['success']:.0%}" if "after" in a else "")
        rows.append({"stage": "train", "outcome": "untrained" if a.get("untrained") else "produced",
                     "detail": f"{(a.get('trained_on') or {}).get('name', name)}: {a['steps']} GRPO steps"
                               + (" (weights never changed)" if a.get("untrained") else "") + held})
    if s.get("results") is not None:
        rows.append({"stage": "compose", "outcome": "skipped" if not s.get("composition") else
                     "gates untrained" if s.get("gates_untrained") else "produced",
                     "detail": row_notes(s).get("moe", s.get("composition") or "")})
    return rows


def render_markdown(r: dict) -> str:
    lines = [f"# trace-rl run: {r['benchmark']}", "", "## What each stage produced", "",
             "| stage | outcome | detail |", "|---|---|---|"]
    lines += [f"| {x['stage']} | {x['outcome']} | {x['detail']} |" for x in r.get("stages") or []]
    lines += ["", "## Capabilities", "", "| capability | Cov | Δ | runs passed | kept | status | why not |",
              "|---|---|---|---|---|---|---|"]
    for c in r.get("capabilities") or []:
        kept = "yes" if c["kept"] else "no (trained anyway: train_unkept)" if c.get("below_threshold") else "no"
        lines.append(f"| {c['name']} | {c['cov_mean']:.2f} | {c['delta_mean']:+.2f} | {c['runs_passed']}/{c['n_runs']} | "
                     f"{kept} | {c['status']} | {c.get('reason') or ''} |")
    if r.get("evaluation"):
        lines += ["", "## Evaluation", "", "| mode | tasks × trials | pass@1 | passed | mean reward | note |",
                  "|---|---|---|---|---|---|"]
        for mode, g in r["evaluation"].items():
            if "skipped" in g:
                lines.append(f"| {mode} | – | – | – | – | not evaluated: {g['skipped']} |")
                continue
            note = row_notes({k: r.get(k) for k in ("adapters", "composition", "gates_untrained")}).get(mode, "")
            lines.append(f"| {mode} | {g['tasks']} × {g.get('trials', 1)} | {g['pass@1']:.1%} | "
                         f"{g['passed']}/{g['episodes']} | {g['mean_reward']:.2f} | {note} |")
    lines += ["", "## Wall time per stage (s)", ""] + [f"- {k}: {v:.0f}" for k, v in (r.get("timings") or {}).items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- running, resuming, approvals
class RunDirError(ValueError):
    """A run directory that cannot be used as it is; the message names the file and the fix."""


def read_json_file(path: Path, what: str):
    """A run directory's JSON file, or a RunDirError naming it (never a traceback, nothing written)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise RunDirError(f"{path}: not valid JSON ({str(err)[:120]}); {what}") from None


def check_run_dir(run_dir: Path) -> None:
    """Refuse, before anything is written, a run directory that is a file or holds a damaged
    checkpoint or control file."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is a file, not a run directory; pass another --run-dir")
    db = run_dir / "graph.sqlite"
    if db.exists():
        with open(db, "rb") as f:
            header = f.read(16)
        if header != b"SQLite format 3\x00":
            raise RunDirError(f"{db} is not a checkpoint database ({'empty' if not header else 'damaged'}); "
                              "move it away to start this run over, or restore it from a backup")
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                check = con.execute("PRAGMA quick_check").fetchall()
                con.execute("SELECT count(*) FROM sqlite_master").fetchall()
                if check != [("ok",)]:
                    raise sqlite3.DatabaseError(str(check[:3]))
            finally:
                con.close()
        except sqlite3.DatabaseError as err:
            raise RunDirError(f"{db} is damaged ({err}); move it away to start this run over") from None
    for name, fix in (("config.json", "restore it, or start a new run directory"),
                      ("approvals.json", "fix or remove it (decisions are asked again)"),
                      ("pending.json", "remove it (the run writes it again when it waits)")):
        if (run_dir / name).is_file():
            data = read_json_file(run_dir / name, fix)
            if not isinstance(data, dict):
                raise RunDirError(f"{run_dir / name}: must hold a JSON object; {fix}")


def _checkpointer(run_dir: Path):
    from langgraph.checkpoint.sqlite import SqliteSaver

    return SqliteSaver(sqlite3.connect(str(run_dir / "graph.sqlite"), check_same_thread=False))


def compiled(run_dir: Path, cfg: RunConfig, log=print):
    pipe = Pipeline(run_dir, cfg, log)
    return pipe, pipe.graph().compile(checkpointer=_checkpointer(run_dir))


THREAD = {"configurable": {"thread_id": "trace-rl"}}


def pending(app) -> list[dict]:
    """Interrupts waiting for a decision (at most one: the graph runs one node at a time)."""
    state = app.get_state(THREAD, subgraphs=True)
    out = []
    for task in state.tasks:
        out += [i.value for i in task.interrupts]
    return out


def decisions_path(run_dir: Path) -> Path:
    return Path(run_dir) / "approvals.json"


def read_decisions(run_dir: Path) -> dict:
    p = decisions_path(run_dir)
    return read_json_file(p, "fix or remove it (decisions are asked again)") if p.is_file() else {}


def record_decision(run_dir: Path, item_id: str, decision: dict) -> None:
    data = read_decisions(run_dir)
    data[item_id] = {**decision, "at": time.time()}
    atomic_write_json(decisions_path(run_dir), data)


def auto_decision(item: dict) -> dict:
    if item["kind"] == "capabilities":
        return {"approve": [c["name"] for c in item["items"]], "reject": {}, "by": "auto"}
    return {"action": "approve" if item.get("verified") else "reject", "by": "auto",
            "reason": "" if item.get("verified") else "not verified; unattended run"}


def save_config(run_dir: Path, cfg: RunConfig) -> None:
    atomic_write_json(run_dir / "config.json", cfg.model_dump())


def load_saved_config(run_dir: Path) -> RunConfig:
    from pydantic import ValidationError

    p = Path(run_dir) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{run_dir} is not a trace-rl run directory (no config.json); start one with `trace-rl run`")
    try:
        return RunConfig.model_validate(read_json_file(p, "restore it, or start a new run directory"))
    except ValidationError as err:
        raise RunDirError(f"{p}: not a valid run configuration ({err.error_count()} problem(s), first: "
                          f"{'.'.join(map(str, err.errors()[0]['loc']))}: {err.errors()[0]['msg']}); "
                          "restore it, or start a new run directory") from None


# where each stage keeps its output in the run directory (iteration folders: the first iteration's)
STAGE_OUTPUTS = {"rollout": ["iter_0/rollouts"], "analyse": ["iter_0/analysis"], "synthesise": ["envs"],
                 "train": ["train"], "compose": ["composition"], "evaluate": ["iter_0/eval"]}
DECISION_STAGE = {"capabilities@": "analyse", "env:": "synthesise"}  # an approval belongs to what it judged


def saved_fingerprints(run_dir: Path) -> dict:
    """Fingerprints of the config a run directory was made with ({} when unknown: all stale)."""
    from trace_rl.graph.config import stage_fingerprints

    try:
        return stage_fingerprints(load_saved_config(run_dir))
    except FileNotFoundError:
        return {}


def retire_stale_stages(run_dir: Path, cfg: RunConfig, log=print) -> list[str]:
    """A run directory re-entered with a changed config: the first stage whose fingerprint
    changed and every stage after it are re-run. Their outputs (and the graph checkpoint,
    whose state holds their results) move to RUN_DIR/stale/<time>/, never deleted; unchanged
    stages replay from their on-disk caches without redoing work. Returns the stale stages."""
    from trace_rl.graph.config import STAGE_FIELDS, stage_fingerprints

    path, new = run_dir / "stages.json", stage_fingerprints(cfg)
    if path.is_file():  # even without a checkpoint: outputs on disk must match the config that made them
        old = read_json_file(path, "remove it only if every stage's output may be reused")
    elif (run_dir / "graph.sqlite").exists():
        old = saved_fingerprints(run_dir)
    else:
        atomic_write_json(path, new)
        return []
    stages = list(STAGE_FIELDS)
    changed = [st for st in stages if old.get(st) != new[st]]
    if not changed:
        return []
    stale = stages[stages.index(changed[0]):]
    saved = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    now = cfg.model_dump(mode="json")
    fields = [f for f in STAGE_FIELDS[changed[0]] if saved.get(f) != now.get(f)]
    archive = run_dir / "stale" / time.strftime("%Y%m%d-%H%M%S")
    archive.mkdir(parents=True, exist_ok=True)
    later = [p.name for p in run_dir.glob("iter_*") if p.name != "iter_0"]  # loop iterations build on all stages
    moved = [p for st in stale for p in STAGE_OUTPUTS[st]] + (
        [f"{p}/eval" for p in later] if stale == ["evaluate"] else later) + [
        "graph.sqlite", "graph.sqlite-wal", "graph.sqlite-shm", "report.json", "report.md", "pending.json"]
    for rel in moved:
        src = run_dir / rel
        if src.exists():
            (archive / rel).parent.mkdir(parents=True, exist_ok=True)
            src.rename(archive / rel)
    decisions = read_decisions(run_dir)
    if decisions:
        atomic_write_json(archive / "approvals.json", decisions)
        keep = {k: v for k, v in decisions.items()
                if not any(k.startswith(p) and st in stale for p, st in DECISION_STAGE.items())}
        atomic_write_json(decisions_path(run_dir), keep)
    atomic_write_json(path, new)
    log(f"config changed ({', '.join(fields) or changed[0] + ' inputs'}): re-running {', '.join(stale)}; "
        f"their earlier outputs moved to {archive}")
    return stale


def drive(run_dir: str | Path, cfg: RunConfig, *, resume: bool, wait: bool = True, web_port: int | None = None,
          log=print) -> dict:
    """Run (or resume) the graph until it ends or needs a decision nobody has given.

    Decisions come from approvals.json (`trace-rl approve`, the web page) or, with
    `auto_approve`, are made here. With `wait`, an undecided approval blocks (polling
    approvals.json, serving the web page if `web_port` is set) instead of returning."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stale = retire_stale_stages(run_dir, cfg, log)
    pipe, app = compiled(run_dir, cfg, log)
    started = app.get_state(THREAD).values
    inp: Any = None if started else {"iteration": 0, "envs": {}, "adapters": {}, "timings": {}}
    if not started or stale:
        save_config(run_dir, cfg)  # `resume`, `approve` and `status` need only the run directory
    server = None
    try:
        while True:
            from langgraph.types import Command

            app.invoke(inp, THREAD)
            items = pending(app)
            if not items:
                (run_dir / "pending.json").unlink(missing_ok=True)
                return {"status": "done", "state": app.get_state(THREAD).values}
            item = items[0]
            atomic_write_json(run_dir / "pending.json", item)  # for the web page and `trace-rl approve`
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
            inp = Command(resume=decided)
    finally:
        if server is not None:
            server.shutdown()
