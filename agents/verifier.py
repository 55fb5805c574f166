"""Verifier: is a synthesized environment sound before any GPU time is spent on it?

1. automatic checks, all inside the sandbox: loads and meets the contract; tool schemas
   are a subset of the target's with identical shapes; deterministic per seed; the
   reference solver scores >= SUCCESS_THRESHOLD (0.99) on >= 95% of seeds; trivial policies (do nothing,
   refuse, random tool calls) score <= 0.2 on average; echoing the prompt back scores
   low too (else the answer is leaked); instances vary across seeds;
2. a verifier LLM reviews the code and sample episodes for reward hacks and leaks;
3. calibration with the base model: mean reward and success rate in a band, and the
   group statistics from the method (TRACE §3); it stops as soon as the rejection is certain.
"""
from __future__ import annotations

import json
import math
import re
import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trace_rl import prompts
from trace_rl.core.records import Capability
from trace_rl.core.reward import SUCCESS_THRESHOLD
from trace_rl.models.chat import StructuredOutputError
from trace_rl.sandbox import contract
from trace_rl.sandbox.session import Sandbox, SandboxError, SessionLimits, SessionPool, open_session


class VerifyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not silently ignored
    seeds: int = Field(40, ge=4, le=10_000, description="seeds for solver / trivial-policy checks")
    determinism_seeds: int = Field(5, ge=1, le=1000)
    solver_min_reward: float = Field(SUCCESS_THRESHOLD, ge=0, le=1)
    solver_min_fraction: float = Field(0.95, ge=0, le=1)
    trivial_max_mean: float = Field(0.2, ge=0, le=1)
    min_distinct_fraction: float = Field(0.5, ge=0, le=1, description="share of seeds giving a distinct first message")
    max_tools: int = Field(8, ge=1, le=64)
    # calibration (TRACE §3)
    calib_seeds: int = Field(100, ge=1, le=10_000)
    calib_samples: int = Field(16, ge=2, le=256, description="episodes per seed (a group needs at least 2)")
    calib_temperature: float = Field(0.7, ge=0, le=2)
    band: tuple[float, float] = Field((0.2, 0.6), description="accepted mean reward / success rate: [low, high]")
    min_reward_std: float = Field(0.05, ge=0, le=1)
    max_all_success_groups: float = Field(0.2, ge=0, le=1)
    max_all_zero_groups: float = Field(0.2, ge=0, le=1)
    max_constant_groups: float = Field(0.5, ge=0, le=1)
    min_informative_groups: float = Field(0.5, ge=0, le=1)
    calibration_gate: bool = Field(True, description="calibration outside the bounds fails verification (the method); "
                                                     "False records the figures as advisory only")

    @field_validator("band")
    @classmethod
    def _band(cls, band):
        lo, hi = band
        if not 0 <= lo < hi <= 1:
            raise ValueError(f"band must be [low, high] with 0 <= low < high <= 1, got {list(band)}")
        return band


@dataclass
class Finding:
    check: str
    passed: bool
    detail: str
    figures: dict = field(default_factory=dict)


@dataclass
class VerifierReport:
    findings: list[Finding]
    review: dict | None = None
    calibration: dict | None = None
    samples: dict = field(default_factory=dict)  # a few episodes, for the human reviewing the env

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.findings)

    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.passed]

    def to_dict(self) -> dict:
        return {"passed": self.passed, **asdict(self)}

    def feedback(self) -> str:
        """What goes back to the env-builder."""
        lines = [f"- {f.check}: {f.detail}" for f in self.failures()]
        if self.review and self.review.get("findings"):
            lines += [f"- review: {x}" for x in self.review["findings"]]
        return "\n".join(lines) or "no findings"


# ---------------------------------------------------------------- scripted policies
def run_actions(session: Sandbox, seed: int, policy) -> tuple[dict, list]:
    """One episode with `policy(obs, turn, rng) -> action`; returns (reward dict, transcript).
    Every result is checked against the contract on the host (sandbox/contract.py)."""
    session.new_episode()
    obs = contract.reset(session, seed)
    rng = random.Random(seed * 7919 + 1)
    transcript = [{"role": "system", "content": obs["system_prompt"]}, *obs["messages"]]
    for turn in range(50):
        action = policy(obs, turn, rng)
        out = contract.step(session, action)
        transcript += [{"role": "assistant", **action}, *out["messages"]]
        if out["done"]:
            break
    return contract.reward(session), transcript


def do_nothing(obs, turn, rng):
    return {"content": "Hello! How can I help you?"}


def refuse(obs, turn, rng):
    return {"content": "I'm sorry, I cannot help with that request and I am unable to do it."}


def parrot(obs, turn, rng):
    """Echo the prompt (and the training hint) back: scores high only if the answer is written there."""
    return {"content": "\n".join([obs["system_prompt"], str(obs.get("hint") or ""),
                                  *(str(m.get("content")) for m in obs["messages"])])}


def random_tools(obs, turn, rng):
    if turn >= 6:
        return {"content": "Done."}
    tool = rng.choice(obs["tools"])["function"]
    props = (tool.get("parameters") or {}).get("properties", {})
    args = {k: rng.choice(["x", "1", "ABC123", "yes", "none"]) for k in props} if isinstance(props, dict) else {}
    return {"tool_calls": [{"id": f"r{turn}", "name": tool["name"], "arguments": args}]}


def solver(session: Sandbox):
    """The env's reference solution, fetched after reset (it depends on the instance)."""
    actions: list = []

    def policy(obs, turn, rng):
        if turn == 0:
            actions[:] = contract.solve(session)
        return actions[turn] if turn < len(actions) else {"content": "Done."}
    return policy


TRIVIAL = {"do_nothing": do_nothing, "refuse": refuse, "random_tools": random_tools}


# ---------------------------------------------------------------- automatic checks
def _schema_findings(tools: list[dict], target_tools: list[dict], cfg: VerifyConfig) -> Finding:
    target = {t["function"]["name"]: t["function"] for t in target_tools}
    problems = []
    for t in tools:
        fn = t.get("function", {})
        name = fn.get("name")
        if name not in target:
            problems.append(f"tool {name!r} is not one of the target's tools")
        elif fn.get("parameters") != target[name].get("parameters"):
            problems.append(f"tool {name!r} parameters differ from the target's: "
                            f"{json.dumps(fn.get('parameters'))[:300]} vs {json.dumps(target[name].get('parameters'))[:300]}")
    if not 1 <= len(tools) <= cfg.max_tools:
        problems.append(f"{len(tools)} tools; implement 1-{cfg.max_tools} (3-5 is typical)")
    return Finding("tool_schemas", not problems, "; ".join(problems) or f"{len(tools)} tools match the target's schemas",
                   {"tools": [t.get("function", {}).get("name") for t in tools]})


class GaveUp(Exception):
    """Too many sessions died: the remaining checks are not run (a finding says so)."""


class Probe:
    """Runs the checks' episodes on a session, turning every misbehaviour of the module (an
    exception, a hang, an exit, wrong types, a dead container) into a recorded failure with the
    seed and the call; a dead session is replaced so the next seed still runs."""

    def __init__(self, code: str, limits: SessionLimits, max_dead: int = 3):
        self.code, self.limits, self.max_dead = code, limits, max_dead
        self.failures: list[str] = []
        self.dead = 0
        self.session = self._new()

    def _new(self) -> Sandbox:
        s = open_session(self.limits)
        s.load(self.code)
        return s

    def episode(self, seed: int, policy_name: str, policy_of) -> tuple[float, list]:
        """(reward, transcript); a failed episode scores 0 and is recorded."""
        try:
            r, tr = run_actions(self.session, seed, policy_of(self.session))
            return r["reward"], tr
        except SandboxError as err:
            self.failures.append(f"seed {seed} ({policy_name}): {str(err).splitlines()[0][:300]}")
            while not self.session.alive:
                self.dead += 1
                self.session.close()
                if self.dead >= self.max_dead:
                    raise GaveUp(f"{self.dead} sessions died; the remaining checks were not run") from None
                try:
                    self.session = self._new()
                except SandboxError as again:  # the module failed to load this time: counts as one more death
                    self.failures.append(f"reload after seed {seed}: {str(again).splitlines()[0][:300]}")
            return 0.0, []

    def close(self) -> None:
        self.session.close()


def automatic_checks(code: str, target_tools: list[dict], cfg: VerifyConfig = VerifyConfig(),
                     limits: SessionLimits = SessionLimits()) -> tuple[list[Finding], dict]:
    """Run every automatic check in a sandbox; returns (findings, sample transcripts).
    Whatever the module does, the result is findings: nothing it does raises here."""
    findings, samples = [], {}
    try:
        probe = Probe(code, limits)
    except SandboxError as err:
        return [Finding("contract", False, f"load: {str(err)[:1500]}")], samples
    try:
        try:
            probe.session.new_episode()
            first = contract.reset(probe.session, 0)
            contract.solve(probe.session)
        except SandboxError as err:
            return [Finding("contract", False, str(err)[:1500])], samples
        findings += [Finding("contract", True, "loads; reset/step/reward/solve answer"),
                     _schema_findings(first["tools"], target_tools, cfg)]
        try:
            _episode_checks(probe, cfg, findings, samples)
        except GaveUp as err:
            findings.append(Finding("robustness", False, f"{err}: " + "; ".join(probe.failures[:6])))
            return findings, samples
        more = f" (+{len(probe.failures) - 6} more)" if len(probe.failures) > 6 else ""
        findings.append(Finding("robustness", not probe.failures, "; ".join(probe.failures[:6]) + more
                                if probe.failures else "no call failed", {"failures": len(probe.failures)}))
    finally:
        probe.close()
    return findings, samples


def _episode_checks(probe: Probe, cfg: VerifyConfig, findings: list[Finding], samples: dict) -> None:
    # determinism: same seed -> same instance, same solver reward and transcript
    twice = [[json.dumps(probe.episode(seed, "solver", solver), sort_keys=True, default=str) for _ in range(2)]
             for seed in range(cfg.determinism_seeds)]
    nondet = [seed for seed, (a, b) in enumerate(twice) if a != b]
    findings.append(Finding("determinism", not nondet, f"seeds {nondet} differ between two runs" if nondet
                            else f"{cfg.determinism_seeds} seeds reproduce exactly"))
    seeds = list(range(cfg.seeds))

    def play(name: str, policy_of) -> list[tuple[float, list]]:
        runs = [probe.episode(seed, name, policy_of) for seed in seeds]
        samples[name] = runs[0][1]
        return runs

    runs = play("solver", solver)
    solved = [r for r, _ in runs]
    firsts = [json.dumps(tr[:2], sort_keys=True) for _, tr in runs]  # the task may sit in the system prompt (solo)
    frac = sum(x >= cfg.solver_min_reward for x in solved) / len(seeds)
    findings.append(Finding("reference_solver", frac >= cfg.solver_min_fraction,
                            f"reference solver reaches {cfg.solver_min_reward} on {frac:.0%} of seeds "
                            f"(need {cfg.solver_min_fraction:.0%})", {"mean": statistics.fmean(solved)}))
    distinct = len(set(firsts)) / len(seeds)
    findings.append(Finding("instance_variety", distinct >= cfg.min_distinct_fraction,
                            f"{distinct:.0%} of seeds give a distinct task (need {cfg.min_distinct_fraction:.0%})"))
    for name, pol in {**TRIVIAL, "parrot": parrot}.items():
        mean = statistics.fmean(r for r, _ in play(name, lambda session, pol=pol: pol))
        check = "answer_leak" if name == "parrot" else f"trivial_{name}"
        detail = (f"echoing the prompt and hint back scores {mean:.2f} on average"
                  + (": the answer is in the prompt" if mean > cfg.trivial_max_mean else "")
                  if name == "parrot" else f"policy '{name}' scores {mean:.2f} on average")
        findings.append(Finding(check, mean <= cfg.trivial_max_mean, detail + f" (max {cfg.trivial_max_mean})",
                                {"mean": mean}))
    rewards_all = solved + [f.figures.get("mean", 0) for f in findings if f.check.startswith("trivial_")]
    varies = statistics.pstdev(rewards_all) > 0.01
    findings.append(Finding("reward_varies", varies, "rewards differ between policies and seeds" if varies
                            else "reward is the same whatever the agent does"))


# ---------------------------------------------------------------- LLM review
class Review(BaseModel):
    verdict: Literal["pass", "fail"] = Field(description="'pass' only with no findings")
    findings: list[str] = Field(default_factory=list, description="concrete problems: reward hacks, answer leaks")

    @field_validator("verdict", mode="before")
    @classmethod
    def _lower(cls, v):
        return v.strip().lower() if isinstance(v, str) else v


_WORD = re.compile(r"[a-z_][a-z0-9_]{3,}")


def grounded(finding: str, rubric: str, material: str) -> bool:
    """A review finding names something of this environment: a word (>= 4 letters) that is in its
    code or sample episodes and not in the review prompt: the prompt's checklist copied out is not
    evidence."""
    words = set(_WORD.findall(finding.lower())) - set(_WORD.findall(rubric.lower()))
    return bool(words & set(_WORD.findall(material.lower())))


def llm_review(llm, code: str, capability: Capability, samples: dict) -> dict:
    """The reviewer's verdict. Like an analyst's label, a finding must be grounded: one that names
    nothing in the code or the episodes is discarded, kept under `discarded` and counted; a 'fail'
    whose findings are all discarded is no evidence of a problem, and says so."""
    episodes = "\n\n".join(f"## episode with policy '{k}'\n" + "\n".join(
        f"[{m['role']}] {str(m.get('content') or m.get('tool_calls'))[:400]}" for m in v[1:12])
        for k, v in samples.items())
    rubric = prompts.load("verifier_review")
    msgs = [{"role": "system", "content": rubric},
            {"role": "user", "content": f"# capability\n{capability.name}: {capability.description}\n\n"
                                        f"# environment code\n```python\n{code}\n```\n\n# sample episodes\n{episodes}"}]
    try:
        review = llm.structured(msgs, Review)
    except StructuredOutputError as err:  # no valid verdict is no verdict: not a pass
        return {"verdict": "invalid", "findings": [f"the reviewer gave no valid verdict: {str(err)[:300]}"],
                "passed": False}
    material = code + "\n" + episodes
    said = [f for f in review.findings if f.strip()]
    kept = [f for f in said if grounded(f, rubric, material)]
    discarded = [f for f in said if f not in kept]
    passed = not kept and (review.verdict == "pass" or bool(discarded))
    return {"verdict": review.verdict, "findings": kept, "discarded": discarded, "passed": passed}


# ---------------------------------------------------------------- calibration
def _all_success(g: list[float]) -> bool:
    return min(g) >= SUCCESS_THRESHOLD


def _all_zero(g: list[float]) -> bool:
    return max(g) <= 1e-9


def _constant(g: list[float]) -> bool:
    return max(g) - min(g) < 1e-9


def group_stats(groups: list[list[float]], cfg: VerifyConfig) -> dict:
    """The method's acceptance figures over groups of rewards (one group per seed)."""
    flat = [r for g in groups for r in g]
    n = len(groups) or 1
    const = sum(map(_constant, groups)) / n
    stats = {
        "mean_reward": statistics.fmean(flat) if flat else 0.0,
        "success_rate": sum(r >= SUCCESS_THRESHOLD for r in flat) / len(flat) if flat else 0.0,
        "reward_std": statistics.pstdev(flat) if len(flat) > 1 else 0.0,
        "all_success_groups": sum(map(_all_success, groups)) / n,
        "all_zero_groups": sum(map(_all_zero, groups)) / n,
        "constant_groups": const,
        "informative_groups": 1 - const,
    }
    accepted = {"mean_reward": cfg.band, "success_rate": cfg.band, "reward_std": (cfg.min_reward_std, 1),
                "all_success_groups": (0, cfg.max_all_success_groups), "all_zero_groups": (0, cfg.max_all_zero_groups),
                "constant_groups": (0, cfg.max_constant_groups), "informative_groups": (cfg.min_informative_groups, 1)}
    checks = {k: lo <= stats[k] <= hi for k, (lo, hi) in accepted.items()}  # every figure lies in [0, 1]
    return {**stats, "checks": checks, "accepted": all(checks.values())}


_MARGIN = 1e-9  # a bound is "certainly" crossed only by more than float noise: when in doubt, play on


def certain_rejection(groups: list[list[float]], cfg: VerifyConfig) -> dict[str, str]:
    """{figure: why} for each figure that no rewards of the groups still to play (calib_seeds in all, of
    calib_samples episodes each, every reward anywhere in [0, 1]) can bring within its bound: calibration
    is then rejected whatever happens, and playing on is wasted time. Empty when acceptance is still
    possible for every figure taken alone (exact bounds, not a statistical guess; figures are not
    combined, so this may miss a joint impossibility, never invent one)."""
    if len(groups) > cfg.calib_seeds:
        raise ValueError(f"groups: {len(groups)} played, more than calib_seeds ({cfg.calib_seeds})")
    if bad := [r for g in groups for r in g if not 0 <= r <= 1]:
        raise ValueError(f"groups: rewards must lie in [0, 1], got {bad[:3]}")
    total_groups, samples = cfg.calib_seeds, cfg.calib_samples
    lo, hi = cfg.band
    left_groups = total_groups - len(groups)
    flat = [r for g in groups for r in g]
    left, n = left_groups * samples, len(flat) + left_groups * samples  # episodes still to play, in all
    if not groups or not left_groups:  # nothing played yet, or nothing left to decide early
        return {}
    out = {}
    after = f"whatever the remaining {left} episodes score"
    for name, key, have in (("success rate", "success_rate", sum(r >= SUCCESS_THRESHOLD for r in flat)),
                            ("mean reward", "mean_reward", math.fsum(flat))):
        least, most = have / n, (have + left) / n  # every remaining episode scoring 0, or 1
        if least > hi + _MARGIN:
            out[key] = f"{name} cannot fall below {hi} (at least {least:.2f} {after})"
        elif most < lo - _MARGIN:
            out[key] = f"{name} cannot reach {lo} (at most {most:.2f} {after})"
    for name, key, count, cap in (("all-success", "all_success_groups", _all_success, cfg.max_all_success_groups),
                                  ("all-zero", "all_zero_groups", _all_zero, cfg.max_all_zero_groups),
                                  ("constant", "constant_groups", _constant, cfg.max_constant_groups)):
        k = sum(map(count, groups))  # the remaining groups can all avoid it (a group has >= 2 episodes)
        if k / total_groups > cap + _MARGIN:
            out[key] = f"{name} groups are already {k} of {total_groups}, over the cap {cap}"
    informative = 1 - sum(map(_constant, groups)) / total_groups
    if informative < cfg.min_informative_groups - _MARGIN:
        out["informative_groups"] = (f"informative groups cannot reach {cfg.min_informative_groups} "
                                     f"(at most {informative:.2f})")
    # the variance is convex in the rewards, so its maximum over [0, 1]^left lies at a corner: j ones, the rest
    # 0; over j it is a concave parabola peaking at j = n/2 - sum, so the best j is next to that, within [0, left]
    s1, s2 = math.fsum(flat), math.fsum(r * r for r in flat)
    peak = min(max(n / 2 - s1, 0), left)
    most = max(math.sqrt(max(0.0, (s2 + j) / n - ((s1 + j) / n) ** 2)) for j in {math.floor(peak), math.ceil(peak)})
    if most < cfg.min_reward_std - _MARGIN:
        out["reward_std"] = f"reward std cannot reach {cfg.min_reward_std} (at most {most:.3f} {after})"
    return out


def difficulty_verdict(stats: dict, cfg: VerifyConfig) -> str | None:
    """"too_hard", "too_easy" or "flat" (rewards do not vary) for figures outside the bounds, None for
    accepted ones: what the builder's next round acts on (pattern mode changes the env's difficulty)."""
    if stats["accepted"]:
        return None
    lo, hi = cfg.band
    if stats["mean_reward"] < lo or stats["success_rate"] < lo or stats["all_zero_groups"] > cfg.max_all_zero_groups:
        return "too_hard"
    if stats["mean_reward"] > hi or stats["success_rate"] > hi or \
            stats["all_success_groups"] > cfg.max_all_success_groups:
        return "too_easy"
    return "flat"


def difficulty_advice(stats: dict, cfg: VerifyConfig) -> str:
    """What the builder can change when the base model's figures fall outside the band."""
    lo, hi = cfg.band
    verdict = difficulty_verdict({**stats, "accepted": False}, cfg)
    if verdict == "too_hard":
        return (f"too hard for the base model (band {lo}-{hi}): make instances smaller, add partial-credit "
                "reward components for correct intermediate steps, or a hint (guidance, never the answer)")
    if verdict == "too_easy":
        return (f"too easy for the base model (band {lo}-{hi}): make instances larger or add a distractor the "
                "capability must handle; remove partial credit that any answer earns")
    return "rewards do not vary within a seed: make the reward depend on what the agent does, with partial credit"


def calibrate(code: str, policy, cfg: VerifyConfig, pool_size: int = 2) -> dict:
    """Roll out the base model: calib_seeds x calib_samples episodes at calib_temperature, stopping after
    a seed's group once the rejection is certain (`certain_rejection`): the figures are then those of the
    groups played, and `stopped_early` says after how many and why. Acceptance is never decided early."""
    from trace_rl.agents.base_agent import run_episode
    from trace_rl.evals.synthetic import SyntheticEpisode

    def reward(pool: SessionPool, seed: int, k: int) -> float:
        s = pool.acquire()
        try:
            return run_episode(policy, SyntheticEpisode(s, seed), task_id=str(seed), benchmark="synthetic", trial=k,
                               temperature=cfg.calib_temperature).reward
        finally:
            pool.release(s)

    groups, decided = [], {}
    with SessionPool(code, size=pool_size) as pool:
        for seed in range(cfg.calib_seeds):
            groups.append([reward(pool, seed, k) for k in range(cfg.calib_samples)])
            if decided := certain_rejection(groups, cfg):
                break
    return calibration_result(groups, decided, cfg)


def calibration_result(groups: list[list[float]], decided: dict[str, str], cfg: VerifyConfig) -> dict:
    """The figures over the groups played; a decided figure's check fails whatever its value over them."""
    stats = group_stats(groups, cfg)
    stopped = {"after": len(groups), "of": cfg.calib_seeds, "why": "; ".join(decided.values())} if decided else None
    if decided:
        stats = {**stats, "checks": {**stats["checks"], **{k: False for k in decided}}, "accepted": False}
    return {**stats, "verdict": difficulty_verdict(stats, cfg), "stopped_early": stopped, "groups": groups}


def verify(code: str, target_tools: list[dict], capability: Capability, cfg: VerifyConfig = VerifyConfig(),
           reviewer=None, base_policy=None) -> VerifierReport:
    """Automatic checks; then (if they pass) the LLM review; then (if given) calibration."""
    findings, samples = automatic_checks(code, target_tools, cfg)
    report = VerifierReport(findings, samples={k: v[:16] for k, v in samples.items() if k in ("solver", "do_nothing")})
    if report.passed and reviewer is not None:
        r = report.review = llm_review(reviewer, code, capability, samples)
        detail = "; ".join(r["findings"]) or r["verdict"]
        if r["verdict"] == "pass" and r["findings"]:
            detail = f"verdict 'pass' but with findings (counted as a fail): {detail}"
        if r.get("discarded"):
            detail += (f" ({len(r['discarded'])} finding(s) discarded: they name nothing in the code or episodes"
                       + (", so the reviewer's 'fail' stands on no evidence" if r["passed"] and r["verdict"] == "fail"
                          else "") + ")")
        report.findings.append(Finding("llm_review", r["passed"], detail))
    if report.passed and base_policy is not None:
        c = report.calibration = calibrate(code, base_policy, cfg)
        detail = f"base model: mean reward {c['mean_reward']:.2f}, success {c['success_rate']:.2f}"
        if stop := c.get("stopped_early"):
            detail += f" over the groups played; stopped after {stop['after']} of {stop['of']} groups: {stop['why']}"
        if bad := [k for k, ok in c["checks"].items() if not ok]:  # none iff c["accepted"]
            gate = "" if cfg.calibration_gate else " (advisory: not gating)"
            detail += f"; outside bounds: {', '.join(bad)}; {difficulty_advice(c, cfg)}{gate}"
        report.findings.append(Finding("calibration", c["accepted"] or not cfg.calibration_gate, detail,
                                       {k: v for k, v in c.items() if k != "groups"}))
    return report
