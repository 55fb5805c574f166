"""The run configuration: one validated model, presets, YAML/TOML files, errors that name the field."""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trace_rl.agents.analyst import AnalysisConfig
from trace_rl.agents.verifier import VerifyConfig
from trace_rl.core.io import atomic_write_json, fingerprint
from trace_rl.core.rundir import RunDir, RunDirError, read_control
from trace_rl.models.llm import Endpoints, LLMConfig
from trace_rl.training.grpo import PRESETS as GRPO_PRESETS, GRPOSettings


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not silently ignored


class AgentSettings(Strict):
    max_steps: int | None = Field(None, ge=1, description="agent steps per episode; unset: each benchmark's own limit "
                                  "(a benchmark whose rules fix it refuses a value)")
    max_tokens: int = Field(512, ge=16)
    temperature: float = Field(0.7, ge=0, description="> 0 so that repeated trials of a task can differ")
    concurrency: int = Field(1, ge=1)
    request_deadline: float | None = Field(None, gt=0, description="seconds one model request may take in all "
                                           "(a hung or dripping endpoint then ends the episode as llm_error); "
                                           "unset: the client's timeout")
    step_timeout: float = Field(600.0, gt=0, description="seconds one benchmark call (reset, step, score) may take; "
                                "a hung one ends the episode as env_timeout")


class LoopSettings(Strict):
    """The autonomous loop: re-roll-out with the composed model, re-analyse, train what is newly
    lacking, until a budget runs out or no new capability is found."""
    enabled: bool = False
    max_iterations: int = Field(3, ge=1)
    max_rollouts: int = Field(10_000, ge=1, description="episodes over all iterations")
    max_hours: float = Field(24.0, gt=0)
    max_tokens: int = Field(100_000_000, ge=1, description="LLM tokens over all iterations")


class ComposeSettings(Strict):
    epochs: int = Field(3, ge=1)
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    lb_weight: float = Field(1e-3, ge=0)
    max_len: int = Field(16384, ge=256, description="longest successful rollout (tokens) the gates train on; "
                         "a τ² telecom episode is ~11k, most of it the policy")


class RunConfig(Strict):
    benchmark: str = Field("tau2:telecom", description="target benchmark: tau2:telecom, tau2:airline@tau3, an entry "
                                                     "point name, path/to/bench.py:Class or package.module:Class")
    benchmark_options: dict = Field(default_factory=dict, description="the benchmark's own options (validated by it)")
    passed_threshold: float | None = Field(None, ge=0, le=1, description="an episode passes when its reward is at "
                                           "least this (benchmarks with continuous scores); unset = the benchmark's rule")
    rollout_split: str = Field("train", description="tasks the base agent is rolled out on for analysis")
    eval_split: str = Field("test", description="tasks for the final base-vs-composed evaluation")
    rollout_tasks: int = Field(0, ge=0, description="first N tasks of rollout_split (0 = all)")
    eval_tasks: int = Field(0, ge=0, description="first N tasks of eval_split (0 = all)")
    trials: int = Field(2, ge=1, description="attempts per task in the rollout stage: with temperature > 0 the "
                                             "same task can pass and fail, which gives the analyst a contrast")
    eval_trials: int | None = Field(None, ge=1, description="attempts per task in the final evaluation (unset = trials)")
    eval_mode_tasks: dict[str, int] = Field(default_factory=dict, description="fewer tasks for some modes, e.g. "
                                            "{moe: 2} where in-process decoding is slow; the table states each row's count")
    base_model: str = Field("qwen2.5-coder-0.5b", description="the agent: embedded name, .gguf, or name at base_url")
    base_url: Endpoints = Field(None, description="the agent's endpoint; several serving the same model "
                                 "(a list, or comma-separated) take its requests in turn")
    serve: Literal["llama.cpp", "hf", "vllm"] = Field(
        "llama.cpp", description="how models without a base_url are served: llama.cpp (a CPU), hf (transformers + "
                                 "the batching engine, an OpenAI-compatible server per model: a GPU machine) or vllm "
                                 "(vLLM's server per model, adapters as LoRA requests, GRPO's rollouts through it; the "
                                 "router and the moe stay on the engine); how this machine runs the run, not a result")
    serve_rows: int = Field(64, ge=1, le=4096, description="serve=hf/vllm: conversations each server decodes together")
    vllm_gpu_memory: float = Field(0.4, gt=0, le=0.95, description="serve=vllm: each vLLM server's share of the GPU "
                                   "(the engine's rows and training share it)")
    decode: Literal["auto", "eager", "graph", "inductor"] = Field(
        "auto", description="in-process generation (models/engine.py): graph = the decode step as one CUDA graph "
                            "(auto on a GPU), inductor = fused by torch.compile first (faster, ~35-55 s of compiling "
                            "per engine), eager (auto on a CPU); how this machine runs the run, like serve")
    sandbox: Literal["docker", "subprocess"] = Field(
        "docker", description="where environments run: docker, or subprocess on a machine without Docker (only "
                              "for environments already verified in Docker: training and evaluation)")
    executor: Literal["local", "ray"] = Field(
        "local", description="where rollout episodes play (base rollouts, evaluation): local (threads here) or ray "
                             "(a Ray task each, on the nodes that offer a `sandbox` resource; docs/scale.md); how "
                             "this machine runs the run, like serve")
    ray_address: str | None = Field(None, description="executor=ray: the cluster's address (unset: $RAY_ADDRESS, "
                                    "else a cluster started on this machine with `ray start --head`)")
    ray_retries: int = Field(3, ge=0, description="executor=ray: how often an episode whose node was lost is played "
                             "again elsewhere before it is recorded as infra_error (the next run plays it again)")
    flash_attn: bool = Field(False, description="llama.cpp's flash attention for every model it serves here: long "
                             "prompts read ~1.5x as fast on a CPU, but a greedy reply then depends on how its prompt "
                             "was split between cached and new tokens (so it is part of every stage's fingerprint)")
    train_model: str | None = Field(None, description="transformers checkpoint of the base (default: made from base_model)")
    user_model: LLMConfig | None = Field(None, description="user simulator (airline/retail); default: base_model "
                                                            "at base_url, temperature 0")
    analyst: LLMConfig = LLMConfig(model="qwen2.5-coder-1.5b", max_tokens=2048)
    labeller: LLMConfig | None = Field(None, description="labels the (trajectory, capability) pairs; default: the "
                                                         "analyst. Discovery is one hard call; labelling is nearly all "
                                                         "the others, and its evidence is checked by code, so a smaller, "
                                                         "faster model can do it (on a 2-core CPU, ~3x faster)")
    builder: LLMConfig = LLMConfig(model="qwen2.5-coder-1.5b", max_tokens=4096)
    reviewer: LLMConfig | None = Field(None, description="verifier LLM; default: the builder's model")
    builder_mode: Literal["auto", "spec", "pattern", "code"] = Field(
        "auto", description="spec: the builder writes a JSON spec (grammar-constrained) that a tested runtime turns "
                            "into the env; pattern: it only picks one of a few env shapes and binds it to the "
                            "target's tools, code writes the spec (for the smallest models); code: a Python module; "
                            "auto: pattern for an embedded builder model, code for one at an endpoint")
    agent: AgentSettings = AgentSettings()
    analysis: AnalysisConfig = AnalysisConfig()
    verify: VerifyConfig = VerifyConfig()
    calibrate: bool = Field(True, description="calibrate each environment with the base model (TRACE §3)")
    build_rounds: int = Field(5, ge=1, description="builder/verifier rounds before a human is asked")
    library_fallback: bool = Field(False, description="when all rounds fail, use a shipped verified environment "
                                                      "for the same target, if one matches (recorded as such)")
    max_capabilities: int = Field(4, ge=1, description="kept capabilities trained, best mean Δ first")
    train_unkept: int = Field(0, ge=0, description="when fewer capabilities than this pass K-of-N, also take the "
                                                   "best-ranked candidates that did not (marked below_threshold); "
                                                   "0 = the method's rule only")
    grpo: GRPOSettings = GRPOSettings()
    target_baseline: bool = Field(False, description="also GRPO one adapter on the target's own rollout-split "
                                  "tasks with the capabilities' rollout budget: a grpo_target row in the final table")
    train_seeds: int = Field(1000, ge=1, description="environment seeds used for training")
    heldout_seeds: int = Field(20, ge=1, description="environment seeds (disjoint) for before/after success")
    compose: ComposeSettings = ComposeSettings()
    eval_modes: list[str] | None = Field(None, description="modes evaluated at the end: base, router, moe and/or "
                                                          "capability names (single adapters); unset = all")
    approvals: list[Literal["capabilities", "environments"]] = Field(
        default_factory=lambda: ["capabilities", "environments"], description="where a human is asked")
    auto_approve: bool = Field(False, description="approve every pending item (unattended runs)")
    loop: LoopSettings = LoopSettings()
    components: str | None = Field(None, description="module:function building the stage components "
                                                      "(LLMs, models); unset = the real ones from this config")

    def agent_llm(self) -> LLMConfig:
        """The base agent at its endpoint, with the agent settings."""
        return LLMConfig(model=self.base_model, base_url=self.base_url, max_tokens=self.agent.max_tokens,
                         temperature=self.agent.temperature, deadline=self.agent.request_deadline)

    def executor_kw(self) -> dict:
        """How rollout() plays this run's episodes (evals/executor.py): no result depends on it."""
        return {"executor": self.executor, "ray_address": self.ray_address, "ray_retries": self.ray_retries}

    @model_validator(mode="after")
    def _trials_need_sampling(self):
        if self.trials > 1 and self.agent.temperature <= 0:
            raise ValueError(f"trials={self.trials} with agent.temperature=0 repeats the same episode; "
                             "set agent.temperature > 0 (e.g. 0.7) or trials=1")
        return self


# what each stage's cached output depends on (besides everything the stages before it depend on)
STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "rollout": ("benchmark", "benchmark_options", "passed_threshold", "rollout_split", "rollout_tasks", "trials", "base_model", "base_url", "user_model",
                "agent", "components", "flash_attn"),
    "analyse": ("analyst", "labeller", "analysis"),
    "synthesise": ("builder", "reviewer", "builder_mode", "verify", "calibrate", "build_rounds", "library_fallback", "max_capabilities",
                   "train_unkept"),
    "train": ("train_model", "grpo", "train_seeds", "heldout_seeds", "target_baseline"),
    "compose": ("compose",),
    "evaluate": ("eval_split", "eval_tasks", "eval_trials", "eval_modes", "eval_mode_tasks"),
}


def stage_fingerprints(cfg: RunConfig) -> dict[str, str]:
    """A hash per stage of the config that made its output, chained: a change in one stage's
    fields changes its fingerprint and every later stage's."""
    data, out, chain = cfg.model_dump(mode="json"), {}, ""
    for section in ("agent", "analysis"):  # how many calls run at once changes no result, nor how long one may take
        for key in ("concurrency", "request_deadline", "step_timeout"):
            data[section].pop(key, None)
    if data["analysis"].get("contrast_threshold") is None:  # added later: runs made before keep their fingerprints
        data["analysis"].pop("contrast_threshold", None)
    if data["labeller"] is None:  # a field added later: runs made before keep their fingerprints
        del data["labeller"]
    for section in ("user_model", "analyst", "labeller", "builder", "reviewer"):  # nor do timeouts, retries, prices
        for key in ("timeout", "deadline", "retries", "price_in_per_mtok", "price_out_per_mtok"):
            (data.get(section) or {}).pop(key, None)
        if data.get(section) and data[section].get("lora") is None:  # a field added later: runs made before keep
            data[section].pop("lora", None)                       # their fingerprints
        if data.get(section) and not data[section].get("flash_attn"):  # so is flash_attn
            data[section].pop("flash_attn", None)
    if not data["flash_attn"]:
        del data["flash_attn"]
    if data["agent"]["max_steps"] is None:  # unset (each benchmark's own) is what the default 30 did before it
        data["agent"]["max_steps"] = 30     # could be unset (offered to tau2 alone, whose own is 30): same fingerprint
    if data["grpo"]["max_steps"] is not None:  # named max_turns before: runs made before keep their fingerprints
        data["grpo"]["max_turns"] = data["grpo"].pop("max_steps")
    if data["compose"]["max_len"] == ComposeSettings.model_fields["max_len"].default:  # added later: runs made before keep theirs
        del data["compose"]["max_len"]
    for stage, fields in STAGE_FIELDS.items():
        chain = fingerprint({f: data[f] for f in fields if f in data}, salt=chain)
        out[stage] = chain[:16]
    return out


PRESETS: dict[str, dict] = {
    # one GPU, the embedded 1.5B in every role, served by the engine; GRPO sized so that the capabilities and
    # the target baseline train within about half an hour (docs/examples/gpu)
    "gpu": {
        "benchmark": "tau2:airline", "base_model": "qwen2.5-coder-1.5b", "serve": "hf", "serve_rows": 128,
        "rollout_split": "train", "trials": 4, "eval_split": "test", "eval_trials": 2,
        "agent": {"max_steps": 30, "max_tokens": 512, "temperature": 0.7, "concurrency": 64},
        "user_model": {"model": "qwen2.5-coder-1.5b", "temperature": 0.0, "max_tokens": 256},
        "analyst": {"model": "qwen2.5-coder-1.5b", "max_tokens": 2048},
        "builder": {"model": "qwen2.5-coder-1.5b", "max_tokens": 3000}, "builder_mode": "pattern",
        "analysis": {"n_runs": 10, "k": 8, "concurrency": 32},
        "max_capabilities": 4, "build_rounds": 3, "target_baseline": True,
        # the paper's GRPO (r=16 on q,k,v,o, eps 0.2/0.28, no KL, T=1.0, G=16) with a larger step size for a
        # small model and 10 steps x 2 groups x 16 = 320 rollouts per capability (the paper: ~1,280)
        "grpo": GRPO_PRESETS["paper"].model_dump() | {"groups_per_step": 2, "steps": 10, "learning_rate": 2e-5,
                                                      "max_steps": 12, "max_turn_tokens": 256, "max_seq_len": 14336,
                                                      "save_steps": 5, "kl_every": 5},
        "train_seeds": 1000, "heldout_seeds": 32,
    },
    # the method's settings (TRACE §2-5), for a GPU and a real endpoint
    "paper": {"benchmark": "tau2:airline", "grpo": GRPO_PRESETS["paper"].model_dump()},
    # the whole pipeline on the embedded models on a 2-core CPU within ~30 min (docs/examples/demo; why each
    # setting is what it is: docs/observations.md), on ToolSandbox's single-user-turn scenarios, where the
    # 0.5B scores a partial similarity (few perfect): the contrast splits at similarity 0.5, said so in the report
    "demo": {
        "benchmark": "toolsandbox:base", "benchmark_options": {"user": "end"},
        "rollout_split": "train", "eval_split": "test", "rollout_tasks": 9, "trials": 2,
        "eval_tasks": 10, "eval_trials": 1, "base_model": "qwen2.5-coder-0.5b",
        "analyst": {"model": "qwen2.5-coder-0.5b", "max_tokens": 1024},
        "builder": {"model": "qwen2.5-coder-0.5b", "max_tokens": 2500},
        "agent": {"max_steps": 8, "max_tokens": 128, "temperature": 0.7},
        "analysis": {"n_candidates": 3, "n_runs": 3, "k": 2, "context_chars": 12000, "per_trajectory_chars": 4000,
                     "discovery_examples": 3, "concurrency": 1, "contrast_threshold": 0.5},
        # 40 seeds: fewer make the random-policy check noisy. Calibration gates, as in the method: an env the
        # base cannot score on goes back to the builder with its figures, then to a human. 8 groups of 4: with 4,
        # one all-zero group alone (25 %) failed the method's 20 % bound (docs/examples/demo)
        "verify": {"seeds": 40, "determinism_seeds": 2, "calib_seeds": 8, "calib_samples": 4},
        "build_rounds": 2, "library_fallback": True, "max_capabilities": 1, "train_unkept": 1,
        # KL to the base would add a third to each step: the demo leaves it to `trace-rl train`
        "grpo": GRPO_PRESETS["cpu"].model_dump() | {"steps": 2, "group_size": 4, "groups_per_step": 1, "max_steps": 3,
                                                    "max_turn_tokens": 64, "resample_constant_groups": 1,
                                                    "log_kl": False},
        "train_seeds": 200, "heldout_seeds": 4,
        # the base row and each adapter alone run on llama.cpp (GGUF LoRA); router and moe decode in-process (fp32, slow)
        "eval_modes": ["base", "moe"], "eval_mode_tasks": {"base": 10, "moe": 2},
        "approvals": ["capabilities", "environments"], "auto_approve": True,
    },
}


class ConfigError(ValueError):
    pass


def nearest_field(loc: tuple) -> str | None:
    """The valid field closest to a misspelt one at `loc` (a path into RunConfig)."""
    import difflib
    import typing

    model = RunConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return None
        ann = field.annotation
        ann = next((a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)), ann)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    hits = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.5)
    return hits[0] if hits else None


def describe(err: ValidationError, source: str, section: tuple = ()) -> str:
    """One line per problem: the field's dotted path, what is wrong, the value given. `section`:
    where the validated model sits in RunConfig (e.g. ("analysis",) for `trace-rl analyze --set`)."""
    lines = [f"{source}: invalid {'settings' if section else 'run configuration'}"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            near = nearest_field(section + tuple(e["loc"]))
            hint = f"did you mean `{'.'.join(map(str, e['loc'][:-1] + (near,)))}`?" if near else \
                "check the spelling"
            lines.append(f"  - {path}: unknown field; {hint} (fields: `trace-rl run --show-config`)")
        else:
            lines.append(f"  - {path}: {e['msg']} (got {json.dumps(e.get('input'), default=str)[:80]})")
    return "\n".join(lines)


def section_settings(model: type[BaseModel], section: str, over: dict, defaults: dict | None = None):
    """One section of the run configuration (e.g. AnalysisConfig for `analysis`) from `--set`
    pairs of a stage command: the same model, the same checks, the same error messages."""
    try:
        return model.model_validate({**(defaults or {}), **over})
    except ValidationError as err:
        raise ConfigError(describe(err, "--set", (section,))) from None


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _yaml(text: str):
    return yaml.safe_load(text) or {}  # an empty file: no fields


def _toml(text: str) -> dict:
    import tomllib  # Python 3.11+: on 3.10 only a .toml config fails, with the file named

    return tomllib.loads(text)


def read_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    parse = {".yaml": _yaml, ".yml": _yaml, ".toml": _toml, ".json": json.loads}.get(path.suffix)
    if parse is None:
        raise ConfigError(f"{path}: use a .yaml, .toml or .json file")
    try:
        data = parse(text)
    except Exception as err:  # a syntax error in the file: say where
        raise ConfigError(f"{path}: cannot parse: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of fields")
    return data


def load_config(path: str | Path | None = None, preset: str | None = None, overrides: dict | None = None) -> RunConfig:
    """preset < file < overrides, validated once; a ConfigError names every bad field."""
    data: dict = {}
    if preset:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        data = PRESETS[preset]
    for layer in (read_file(path) if path else {}, overrides or {}):
        if "benchmark" in layer and "benchmark_options" not in layer and layer["benchmark"] != data.get("benchmark"):
            data = {k: v for k, v in data.items() if k != "benchmark_options"}  # options of the benchmark replaced
        data = deep_merge(data, layer)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe(err, str(path) if path else f"preset {preset}" if preset else "config")) from None
    from trace_rl.evals.benchmark import BenchmarkError, load_benchmark

    if cfg.components:  # its module may register the benchmark it targets
        try:
            importlib.import_module(cfg.components.partition(":")[0])
        except ImportError as err:
            raise ConfigError(f"components: cannot import {cfg.components!r}: {err}") from None

    try:
        bench = load_benchmark(cfg.benchmark, options=cfg.benchmark_options)
        splits = bench.splits()
        getattr(bench, "close", lambda: None)()  # a worker benchmark started a process just to answer
        for split, field in ((cfg.rollout_split, "rollout_split"), (cfg.eval_split, "eval_split")):
            if split not in splits:
                raise ConfigError(f"{field}: {cfg.benchmark} has no split {split!r}; choose one of "
                                  f"{', '.join(splits)}")
    except BenchmarkError as err:
        raise ConfigError(f"benchmark: {err}") from None
    return cfg


def config_for(run: RunDir, overrides: dict) -> RunConfig:
    """The config a stage command runs with: the run directory's own (a pipeline run), else the defaults,
    with the command's options over it; every model then reached as the pipeline reaches it."""
    base = load_saved_config(run).model_dump() if run.config.is_file() else {}
    try:
        return RunConfig.model_validate(deep_merge(base, overrides))
    except ValidationError as err:
        raise ConfigError(describe(err, "options")) from None


def save_config(run: RunDir, cfg: RunConfig) -> None:
    atomic_write_json(run.config, cfg.model_dump())


def load_saved_config(run: RunDir, checked: bool = False) -> RunConfig:
    """The config a run directory was made with; errors name the file, the field and the fix. `checked`: also
    what `trace-rl run` checks beyond the fields (the benchmark is known, its splits exist), before a resume."""
    p, fix = run.config, "restore it, or start a new run directory"
    if not p.is_file():
        raise FileNotFoundError(f"{run.root} is not a trace-rl run directory (no config.json); start one with `trace-rl run`")
    cfg = read_control(p, RunConfig, fix)
    if checked:
        try:
            load_config(overrides=cfg.model_dump())
        except ConfigError as err:
            raise RunDirError(f"{p}: {' '.join(str(err).split())}; {fix}") from None
    return cfg
