"""Contrastive capability analysis (TRACE §2): discover, label over N runs, aggregate.

1. discovery: the analyst LLM reads passed and failed trajectories and proposes general
   capabilities (validated: snake_case, 2-3 sentences, example failed task ids, no domain
   recipes, no duplicates);
2. labelling: N independent runs, fresh contexts, each labelling every (trajectory,
   capability) pair NA / PRESENT / LACKING; labels are cached per run, so a resumed
   analysis pays only for what is missing;
3. aggregation in plain code: per run LF, PF, LP, PP -> Cov, ER-, ER+, Δ; keep a capability
   passing Cov ≥ ρ and Δ ≥ δ in at least K of N runs; rank by mean Δ.
"""
from __future__ import annotations

import json
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from trace_rl import prompts
from trace_rl.core.io import atomic_write_json
from trace_rl.models.chat import ReplyError, StructuredOutputError
from trace_rl.models.llm import LLM
from trace_rl.core.records import Capability, CapabilityRecord
from trace_rl.core.rundir import AnalysisDir
from trace_rl.core.trajectory import Trajectory
from trace_rl.evals.facts import FACTS, facts_summary, hollow, render_facts, trajectory_facts

EPS = 1e-9  # thresholds are inclusive: Cov = 0.10 exactly passes ρ = 0.10


class Label(str, Enum):
    NA = "NA"
    PRESENT = "PRESENT"
    LACKING = "LACKING"


# ---------------------------------------------------------------- configuration
class AnalysisConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not silently ignored
    n_candidates: int = Field(10, ge=1, le=30)
    n_runs: int = Field(10, ge=1)
    k: int = Field(8, ge=1, description="runs a capability must pass to be kept")
    rho: float = Field(0.10, ge=0, le=1, description="minimum coverage of failures")
    delta: float = Field(0.20, ge=-1, le=1, description="minimum contrast gap ER- minus ER+")
    context_chars: int = Field(24000, ge=2000, description="trajectory text per LLM call (~4 chars a token)")
    per_trajectory_chars: int = Field(6000, ge=500, description="budget of one compacted trajectory")
    labels_per_call: int = Field(24, ge=1, description="(trajectory, capability) pairs one labelling answer may "
                                 "hold: ~50 tokens each must fit the analyst's max_tokens (27 short τ² telecom "
                                 "trajectories x 4 capabilities overflowed 2,048 tokens: every pair unlabelled)")
    discovery_examples: int = Field(12, ge=2, description="trajectories shown in discovery (half failed)")
    min_passed: int = Field(3, ge=1, description="applicable (labelled) passed trajectories a run needs for a "
                                                 "contrast; fewer and the capability is no_contrast, not kept")
    contrast_threshold: float | None = Field(None, ge=0, le=1, description="graded benchmarks (a similarity in "
                                             "[0, 1]): when fewer than min_passed trajectories passed by the "
                                             "benchmark's own rule, one with reward >= this counts as passed for "
                                             "the contrast; capabilities.json and the report say which split ran. "
                                             "None: the paper's rule only")
    max_unlabelled: float = Field(0.2, ge=0, le=1, description="share of pairs a run may leave unlabelled; "
                                                               "above it the run is unreliable and does not count")
    label_temperature: float = Field(0.7, ge=0, le=2)  # runs must be independent draws, not one greedy answer N times
    concurrency: int = Field(2, ge=1, le=64)
    domain_words: list[str] = Field(default_factory=list, description="words that mark a domain recipe")
    require_evidence: bool = Field(True, description="a PRESENT/LACKING label must cite a step and a quote that "
                                                     "occurs there (or, for LACKING, a fact code found); a label "
                                                     "whose evidence does not check counts as NA, and is counted")

    @field_validator("k")
    @classmethod
    def _k_le_n(cls, k, info):
        n = info.data.get("n_runs", 10)
        if k > n:
            raise ValueError(f"k={k} exceeds n_runs={n}: a capability could never be kept; set k <= n_runs")
        return k


# ---------------------------------------------------------------- compaction
def message_text(m: dict) -> str:
    """One message as the analyst reads it (and as its quotes are checked against)."""
    if m.get("tool_calls"):
        return "CALL " + "; ".join(f"{c['function']['name']}({c['function'].get('arguments', '')})"
                                   for c in m["tool_calls"])
    return str(m.get("content") or "")


def compact(traj: Trajectory, budget: int, facts: dict | None = None, alias: str | None = None) -> str:
    """A deterministic text of one trajectory within `budget` characters: every message numbered
    by its step (its index in `traj.messages`, what evidence cites), the code-found facts first.

    Long messages are cut in the middle; if still too long, middle messages are elided
    with an explicit marker, keeping the start (the task) and the end (the outcome). `alias`: the
    short id the model sees instead of the key (τ² telecom keys are 100 similar characters a small model
    cannot copy; code maps the alias back).
    """
    head = (f"### trajectory {alias or traj.key}\noutcome: {'PASSED' if traj.passed else 'FAILED'} "
            f"(reward {traj.reward:.2f}, ended by {traj.termination}, {traj.steps} steps)\n"
            + (render_facts(facts)[:budget // 3] + "\n" if facts else ""))

    def render(step: int, m: dict, cap: int) -> str:
        body = message_text(m)
        if len(body) > cap:
            body = body[: cap // 2] + f" [...{len(body) - cap} chars cut...] " + body[-cap // 2:]
        return f"[{step}] [{m['role']}] {body}"

    msgs = [(i, m) for i, m in enumerate(traj.messages) if m.get("role") != "system"]
    for cap in (600, 300, 150):
        lines = [render(i, m, cap) for i, m in msgs]
        if len(head) + sum(len(l) + 1 for l in lines) <= budget:
            return head + "\n".join(lines)
    n, kept, used = len(lines), set(), len(head) + 60  # `lines` holds the shortest cut (150)
    for k in [k for pair in zip(range(n), reversed(range(n))) for k in pair][:n]:  # from both ends, alternating
        if used + len(lines[k]) + 1 > budget:
            break
        kept.add(k)
        used += len(lines[k]) + 1
    cut, out = next((k for k in range(n) if k not in kept), n), [lines[k] for k in sorted(kept)]
    return head + "\n".join(out[:cut] + [f"[... {n - len(kept)} messages elided ...]"] + out[cut:])


# ---------------------------------------------------------------- discovery
_SNAKE = r"^[a-z][a-z0-9]*(_[a-z0-9]+)+$"


class _Candidate(Capability):
    """A capability as discovery proposes it, with the failed tasks that show it. Pattern / length / item
    counts are checked by pydantic and are in the JSON schema too, so constrained decoding enforces them;
    only the sentence count needs a validator."""
    model_config = ConfigDict(extra="ignore")
    name: str = Field(description="snake_case, general (e.g. multi_step_state_modification)", pattern=_SNAKE)
    description: str = Field(description="2-3 sentences", max_length=600)
    example_task_ids: list[str] = Field(description="2-4 ids of failed tasks that show the gap", min_length=1,
                                        max_length=4)

    @field_validator("description")
    @classmethod
    def _sentences(cls, v: str) -> str:
        n = len([s for s in re.split(r"(?<=[.!?])\s+", v.strip()) if s])
        if not 1 <= n <= 4:
            raise ValueError("description must be 2-3 sentences (under 600 characters)")
        return v


Candidate = create_model("Capability", __base__=_Candidate)  # named in the schema the model is shown as it always was


class Candidates(BaseModel):
    # at least one: an empty list parses but names nothing to label;
    # at most the method's 10 (a run asks for at most its n_candidates: candidates_schema)
    capabilities: list[Candidate] = Field(min_length=1, max_length=10)


def candidates_schema(n: int) -> type[Candidates]:
    """Candidates of at most `n` capabilities in the schema itself, so that a grammar-constrained decoder
    cannot write an (n+1)-th, where a check after decoding only makes a small model try again."""
    return create_model("Candidates", __base__=Candidates,
                        capabilities=(list[Candidate], Field(min_length=1, max_length=n)))


def resolve_id(given: str, ids: set[str]) -> str | None:
    """The trajectory id a model meant: exact, or with the "### trajectory" header it copied,
    or the one id that contains (or is contained in) what it wrote; None if none or ambiguous."""
    text = given.strip().removeprefix("###").strip().removeprefix("trajectory").strip()
    if text in ids:
        return text
    hits = [k for k in ids if text and (text in k or k in text)]
    return hits[0] if len(hits) == 1 else None


def _check_candidates(cands: Candidates, cfg: AnalysisConfig, failed_ids: set[str]) -> list[Candidate]:
    """Reject domain recipes and duplicates; raise with every problem so the model can fix them."""
    problems, out, seen_keys = [], [], []
    for c in cands.capabilities:
        words = set(c.name.split("_"))
        if hits := words & {w.lower() for w in cfg.domain_words}:
            problems.append(f"{c.name}: names the domain ({', '.join(sorted(hits))}); describe a general capability")
            continue
        resolved = [resolve_id(t, failed_ids) for t in c.example_task_ids]
        if not any(resolved):  # an example is evidence of the gap: a candidate needs one failed trajectory
            problems.append(f"{c.name}: example ids {c.example_task_ids} are not failed trajectories shown; "
                            f"cite failed ones: {', '.join(sorted(i for i in failed_ids if len(i) <= 4)[:8])}")
            continue
        # an extra id that names a passed (or no) trajectory is dropped, as resolve_id repairs a copied header
        c.example_task_ids = list(dict.fromkeys(r for r in resolved if r))
        key = frozenset(words - {"and", "of", "the", "to"})
        if any(key <= k or k <= key for k in seen_keys):  # same words, or one name inside the other
            problems.append(f"{c.name}: duplicates another candidate")
            continue
        seen_keys.append(key)
        out.append(c)
    if problems:
        raise ValueError("; ".join(problems))
    if len(out) > cfg.n_candidates:
        raise ValueError(f"at most {cfg.n_candidates} capabilities, got {len(out)}")
    return out


class AnalystError(ReplyError, ValueError):
    """The analyst model gave no usable answer."""


def discovery_examples(trajs: list[Trajectory], n: int) -> list[Trajectory]:
    """What discovery reads: first a failed and a passed attempt of the same task, side by side (the
    sharpest contrast), then failed and passed ones of other tasks, about half of each."""
    by_task: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_task.setdefault(f"{t.benchmark}/{t.task_id}", []).append(t)
    pairs = [x for ts in by_task.values() if {t.passed for t in ts} == {True, False}
             for x in (next(t for t in ts if not t.passed), next(t for t in ts if t.passed))]
    shown = pairs[: n - n % 2]
    rest = [t for t in trajs if t not in shown]
    failed, passed = [t for t in rest if not t.passed], [t for t in rest if t.passed]
    left = n - len(shown)
    return shown + failed[: max(left // 2, left - len(passed))] + passed[: left // 2]


def aliases(trajs: list[Trajectory]) -> dict[str, Trajectory]:
    """Short ids for one call (T1, T2, ...): what the model reads and writes instead of the keys."""
    return {f"T{i}": t for i, t in enumerate(trajs, 1)}


def by_id(named: dict[str, Trajectory]) -> dict[str, Trajectory]:
    """Every id a model may write for these trajectories: the alias it was shown, or the key itself."""
    return {**named, **{t.key: t for t in named.values()}}


def discover(llm: LLM, trajs: list[Trajectory], cfg: AnalysisConfig, attempts: int = 3,
             facts: dict | None = None) -> list[Candidate]:
    shown = aliases(discovery_examples(trajs, cfg.discovery_examples))
    per = max(500, cfg.context_chars // max(1, len(shown)))
    text = "\n\n".join(compact(t, min(per, cfg.per_trajectory_chars), (facts or {}).get(t.key), alias=a)
                       for a, t in shown.items())
    if facts:  # what recurs across all of them, counted by code: a small model's anchor
        text = facts_summary(facts, {t.key: t.passed for t in trajs}) + "\n\n" + text
    ids = by_id(shown) | {t.key: t for t in trajs}
    failed_ids = {i for i, t in ids.items() if not t.passed}
    msgs = [{"role": "system", "content": prompts.load("analyst_discovery", n_candidates=str(cfg.n_candidates))},
            {"role": "user", "content": text}]
    caps = llm.structured(msgs, candidates_schema(cfg.n_candidates), attempts, check=lambda c: _check_candidates(c, cfg, failed_ids))
    for c in caps:  # back from the aliases to the trajectories' keys
        c.example_task_ids = list(dict.fromkeys(ids[i].key for i in c.example_task_ids))
    return caps


# ---------------------------------------------------------------- labelling
class LabelItem(BaseModel):
    trajectory: str
    capability: str
    label: Label
    step: int | None = Field(None, description="the step (message number) that shows the label")
    quote: str = Field("", description="a short exact quote from that step")
    fact: str | None = Field(None, description="for LACKING: instead of a quote, a fact listed for the trajectory")
    cited_step: int | None = Field(None, description="set by the evidence check: the step the model cited, when "
                                                     "its quote was found at another")


def _normal(text: str) -> str:
    return " ".join(text.lower().replace('\\"', '"').split())


def evidence_ok(item: LabelItem, traj: Trajectory, facts: dict | None) -> bool:
    """Does the cited evidence check? A quote must occur in the trajectory as the analyst was shown it
    (case and spacing aside; a copied "[step] [role]" prefix gives the step, a copied fact line the
    fact): at its step, or else at another step, which then becomes the label's step (`cited_step`
    keeps the model's: small models miscount steps but copy text well; a quote found nowhere is made up).
    A fact must be one code found in this trajectory, and only a LACKING label may cite one."""
    if item.label is Label.NA:
        return True
    quote = item.quote.strip().strip('"\'')
    if (line := re.match(r"fact (\w+) at step", quote)) and not item.fact:  # a fact line copied as the quote
        item.fact = line.group(1)
    if item.fact and item.label is Label.LACKING and (facts or {}).get(item.fact):
        return True
    if line := re.match(r"\[(\d+)\]\s*\[\w+\]\s*(.*)$", quote, re.S):  # the whole line copied, step number and all
        item.step = int(line.group(1)) if item.step is None else item.step
        quote = line.group(2)
    quote = _normal(quote)
    if not 3 <= len(quote) <= 300:
        return False

    def shows(m: dict) -> bool:  # the text the analyst was shown, or the message's own text
        return quote in _normal(message_text(m)) or quote in _normal(str(m.get("content") or ""))
    if item.step is not None and 0 <= item.step < len(traj.messages) and shows(traj.messages[item.step]):
        return True
    found = [k for k, m in enumerate(traj.messages) if shows(m)]
    if not found:
        return False
    nearest = min(found, key=lambda k: abs(k - (item.step if item.step is not None else k)))
    item.cited_step, item.step = item.step, nearest
    return True


def answer_shapes(ids: list[str], caps: list[str], facts: dict[str, list[str]] | None = None
                  ) -> tuple[type[BaseModel], type[BaseModel]]:
    """(strict, lenient) shapes of one labelling answer: {trajectory id: {capability: label and
    evidence}}. The strict one, every pair required, is the grammar (llama.cpp decodes to it): a
    small model cannot skip a pair or invent an id (or copy "..." from an example), it only decides
    each label. The lenient one, every pair optional, is what is parsed,
    so an endpoint without a grammar that answers part of the pairs keeps that part. `facts`: per id,
    the facts code found there, the only ones the grammar lets a label cite."""
    def body(name: str, found: list[str] | None) -> type[BaseModel]:
        fact = (str | None, None) if found is None else (Literal[tuple(found)] | None, None) if found else None
        # bounded, so a looping small model ends its string
        return create_model(name, label=(Label, ...), step=(int | None, Field(None, ge=0, le=9999)),
                            quote=(str, Field("", max_length=160)), **({"fact": fact} if fact else {}))

    def shape(name: str, required: bool) -> type[BaseModel]:
        field = lambda t, alias: (t if required else t | None, Field(... if required else None, alias=alias))  # noqa
        per = {t: create_model(f"{name}{i}", **{f"c{j}": field(
            body(f"{name}{i}Label", (facts or {}).get(t) if required and facts is not None else None), c)
            for j, c in enumerate(caps)}) for i, t in enumerate(ids)}
        return create_model(name, **{f"t{i}": field(per[t], t) for i, t in enumerate(ids)})
    return shape("Labels", True), shape("SomeLabels", False)


def answer_items(answer: BaseModel, ids: list[str], caps: list[str]) -> list[LabelItem]:
    """The (trajectory, capability) pairs an answer labelled, as LabelItems."""
    pairs = ((t, c, getattr(getattr(answer, f"t{i}") or object(), f"c{j}", None))
             for i, t in enumerate(ids) for j, c in enumerate(caps))
    return [LabelItem(trajectory=t, capability=c, **pair.model_dump()) for t, c, pair in pairs if pair is not None]


def _batches(trajs: list[Trajectory], cfg: AnalysisConfig, n_caps: int = 1) -> list[list[Trajectory]]:
    """Trajectories per labelling call: as many as fit `context_chars`, and no more than the
    answer can label within `labels_per_call` pairs."""
    out, cur, used = [], [], 0
    most = max(1, cfg.labels_per_call // max(1, n_caps))
    for t in trajs:
        size = min(len(compact(t, cfg.per_trajectory_chars)), cfg.per_trajectory_chars)
        if cur and (used + size > cfg.context_chars or len(cur) >= most):
            out.append(cur)
            cur, used = [], 0
        cur.append(t)
        used += size
    return out + ([cur] if cur else [])


UNLABELLED = "UNLABELLED"  # cached for a pair the analyst never labelled: counts as NA, and is counted
UNVERIFIED = "UNVERIFIED"  # a label whose cited evidence does not check: counts as NA, and is counted


def label_batch(llm: LLM, batch: list[Trajectory], caps: list[Capability], cfg: AnalysisConfig,
                seed: int, facts: dict | None = None) -> tuple[dict[str, dict[str, str]], dict]:
    """(labels, evidence) of every pair in `batch`: a pair still missing after three asks is
    UNLABELLED; with `require_evidence`, a label whose evidence does not check is UNVERIFIED."""
    facts = facts or {}
    cap_text = "\n".join(f"- {c.name}: {c.description}" for c in caps)
    named = aliases(batch)
    text = "\n\n".join(compact(t, cfg.per_trajectory_chars, facts.get(t.key), alias=a) for a, t in named.items())
    evidence: dict[str, dict[str, dict]] = {t.key: {} for t in batch}
    msgs = [{"role": "system", "content": prompts.load("analyst_labelling", capabilities=cap_text)},
            {"role": "user", "content": text}]
    want = {(t.key, c.name) for t in batch for c in caps}
    alias_of = {t.key: a for a, t in named.items()}
    ids = by_id(named)
    out: dict[str, dict[str, str]] = {t.key: {} for t in batch}
    missing = sorted(want)
    cap_names = [c.name for c in caps]
    found = {a: [f for f in FACTS if (facts.get(t.key) or {}).get(f)] for a, t in named.items()}
    strict, lenient = answer_shapes(list(named), cap_names, found)
    grammar = {"response_format": llm.response_format(strict)} if llm.config.constrained_json else {}
    for _ in range(3):
        try:
            got = llm.structured(msgs, lenient, temperature=cfg.label_temperature, seed=seed, **grammar)
        except StructuredOutputError:  # no parsable answer: what is still missing stays unlabelled
            break
        for item in answer_items(got, list(named), cap_names):
            given = resolve_id(item.trajectory, set(ids))
            item.trajectory = ids[given].key if given else item.trajectory
            if (item.trajectory, item.capability) in want:
                ok = evidence_ok(item, ids[item.trajectory], facts.get(item.trajectory))
                out[item.trajectory][item.capability] = item.label.value if ok or not cfg.require_evidence \
                    else UNVERIFIED
                evidence[item.trajectory][item.capability] = {
                    **item.model_dump(include={"label", "step", "quote", "fact"}),
                    **({"cited_step": item.cited_step} if item.cited_step is not None else {}), "checked": ok}
        missing = [(t, c) for t, c in sorted(want) if c not in out[t]]
        if not missing:
            return out, evidence
        msgs = msgs + [{"role": "assistant", "content": got.model_dump_json(by_alias=True, exclude_none=True)},
                       {"role": "user", "content": "You missed these pairs; label them: "
                                                   + "; ".join(f"{alias_of[t]} x {c}" for t, c in missing[:40])}]
    for t, c in missing:  # never guessed: an unlabelled pair is NA, recorded as such and counted
        out[t][c] = UNLABELLED
    return out, evidence


def merge_json(path: Path, new: dict) -> dict:
    """labels/run_XX[_evidence].json: {trajectory key: {capability: ...}}, `new` merged in per key and
    rewritten atomically (a resumed labelling run starts from what is on disk); nothing new, nothing written."""
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, d in new.items():
        data.setdefault(key, {}).update(d)
    if new:
        atomic_write_json(path, data)
    return data


@dataclass
class LabelRun:
    """One labelling run: trajectory -> capability -> label (absent = NA), and how many pairs
    the analyst left unlabelled (counted as NA)."""
    labels: dict[str, dict[str, Label]]
    unlabelled: int = 0
    unverified: int = 0  # labels whose cited evidence did not check (counted as NA)


def label_runs(llm: LLM, trajs: list[Trajectory], caps: list[Capability], cfg: AnalysisConfig,
               folder: AnalysisDir, progress: bool = True, facts: dict | None = None) -> list[LabelRun]:
    """N independent labelling runs (isolated contexts), resumable from the labels in `folder`."""
    from rich.progress import Progress

    names = [c.name for c in caps]

    def one_run(r: int, bar, task) -> dict:
        path = folder.labels(r)
        labels = merge_json(path, {})
        todo = [t for t in trajs if not all(n in labels.get(t.key, {}) for n in names)]
        for batch in _batches(todo, cfg, len(caps)):
            got, evidence = label_batch(llm, batch, caps, cfg, seed=1000 + r, facts=facts)
            # evidence first: a kill between the two re-labels the batch, never loses its evidence
            merge_json(folder.labels(r, evidence=True), evidence)
            labels = merge_json(path, got)
            bar.update(task, advance=len(batch))
        keys = {t.key for t in trajs}
        mine = [v for k, d in labels.items() if k in keys for n, v in d.items() if n in names]
        return LabelRun({k: {n: Label(v) for n, v in d.items() if n in names and v not in (UNLABELLED, UNVERIFIED)}
                         for k, d in labels.items() if k in keys}, mine.count(UNLABELLED), mine.count(UNVERIFIED))

    with Progress(disable=not progress) as bar:
        task = bar.add_task("labelling", total=len(trajs) * cfg.n_runs)
        with ThreadPoolExecutor(max_workers=cfg.concurrency) as pool:
            return list(pool.map(lambda r: one_run(r, bar, task), range(cfg.n_runs)))


# ---------------------------------------------------------------- aggregation
@dataclass
class RunFigures:
    LF: int
    PF: int
    LP: int
    PP: int
    n_failed: int
    cov: float
    er_minus: float
    er_plus: float
    delta: float
    contrast: bool  # at least min_passed applicable passed trajectories
    reliable: bool  # the run labelled all but at most max_unlabelled of its pairs
    passed: bool


def run_figures(labels: dict[str, Label], outcome: dict[str, bool], cfg: AnalysisConfig,
                reliable: bool = True) -> RunFigures:
    """One run's figures for one capability. `labels`: trajectory -> label (missing = NA).

    Edge cases are defined, never a division error: with no failures Cov = 0; with no
    applicable failed (or passed) trajectories ER- (or ER+) = 0. A run passes only with a
    contrast (ER+ measured on at least `min_passed` passed trajectories) and if reliable.
    """
    seen = [("L" if labels[key] is Label.LACKING else "P") + ("P" if ok else "F")
            for key, ok in outcome.items() if labels.get(key, Label.NA) is not Label.NA]
    c = {cell: seen.count(cell) for cell in ("LF", "PF", "LP", "PP")}
    n_failed = sum(not ok for ok in outcome.values())
    cov = c["LF"] / n_failed if n_failed else 0.0
    er_minus = c["LF"] / (c["LF"] + c["PF"]) if c["LF"] + c["PF"] else 0.0
    er_plus = c["LP"] / (c["LP"] + c["PP"]) if c["LP"] + c["PP"] else 0.0
    delta = er_minus - er_plus
    contrast = c["LP"] + c["PP"] >= cfg.min_passed
    return RunFigures(**c, n_failed=n_failed, cov=cov, er_minus=er_minus, er_plus=er_plus, delta=delta,
                      contrast=contrast, reliable=reliable,
                      passed=cov >= cfg.rho - EPS and delta >= cfg.delta - EPS and contrast and reliable)


def reliable(run: LabelRun, pairs: int, cfg: AnalysisConfig) -> bool:
    return run.unlabelled <= cfg.max_unlabelled * pairs + EPS


def aggregate(caps: list[Capability], runs: list[LabelRun | dict[str, dict[str, Label]]], outcome: dict[str, bool],
              cfg: AnalysisConfig) -> list[CapabilityRecord]:
    """Kept capabilities first, ranked by mean Δ (then the dropped ones, also by mean Δ)."""
    runs = [r if isinstance(r, LabelRun) else LabelRun(r) for r in runs]
    pairs = len(outcome) * len(caps)
    ok = [reliable(r, pairs, cfg) for r in runs]
    results = []
    for cap in caps:
        figs = [run_figures({k: d.get(cap.name, Label.NA) for k, d in run.labels.items()}, outcome, cfg, good)
                for run, good in zip(runs, ok)]
        covs, deltas = [f.cov for f in figs], [f.delta for f in figs]
        n_pass = sum(f.passed for f in figs)
        kept = n_pass >= cfg.k
        gap_runs = sum(f.cov >= cfg.rho - EPS and f.delta >= cfg.delta - EPS and f.reliable for f in figs)
        if kept:
            status, reason = "PENDING", ""
        elif gap_runs >= cfg.k:  # the gap is there, but there is nothing passed to contrast it with
            status, reason = "NO_CONTRAST", (f"no_contrast: fewer than {cfg.min_passed} applicable passed "
                                              f"trajectories in {gap_runs - n_pass} of {len(runs)} runs")
        else:
            status = "REJECTED"
            reason = (f"only {sum(ok)} of {len(runs)} runs reliable (> {cfg.max_unlabelled:.0%} unlabelled)"
                      if sum(ok) < cfg.k else f"passed Cov ≥ {cfg.rho} and Δ ≥ {cfg.delta} in {n_pass} of "
                                              f"{len(runs)} runs (need {cfg.k})")
        lacking_failed = sorted({k for run in runs for k, d in run.labels.items()
                                 if d.get(cap.name) is Label.LACKING and not outcome.get(k, True)})
        results.append(CapabilityRecord(
            name=cap.name, description=cap.description,
            cov_mean=statistics.fmean(covs or [0.0]), cov_std=statistics.pstdev(covs or [0.0]),
            delta_mean=statistics.fmean(deltas or [0.0]), delta_std=statistics.pstdev(deltas or [0.0]),
            runs_passed=n_pass, n_runs=len(runs), kept=kept, status=status,
            example_failed_task_ids=(lacking_failed or cap.example_task_ids)[:4],
            reliable_runs=sum(ok), reason=reason, runs=[asdict(f) for f in figs]))
    return sorted(results, key=lambda r: (not r.kept, -r.delta_mean))


def select_capabilities(caps: list[CapabilityRecord], done: set[str], max_capabilities: int,
                        train_unkept: int = 0) -> list[CapabilityRecord]:
    """The capabilities to train next: kept ones not in `done`, best mean Δ first, at most
    `max_capabilities`; with `train_unkept`, the best unkept candidates fill up to that many,
    marked `below_threshold` (an explicit opt-in for weak analysts, reported as such)."""
    fresh = [c for c in caps if c.name not in done]
    chosen = [c for c in fresh if c.kept][:max_capabilities]
    if len(chosen) < train_unkept:
        extra = [c.model_copy(update={"below_threshold": True}) for c in fresh if not c.kept]
        chosen += extra[:min(train_unkept, max_capabilities) - len(chosen)]
    return chosen


# ---------------------------------------------------------------- the whole analysis
def analyze(trajs: list[Trajectory], llm: LLM, out_dir: str | Path, cfg: AnalysisConfig | None = None,
            progress: bool = True, tools: list[dict] | None = None, labeller: LLM | None = None) -> list[CapabilityRecord]:
    """Run discovery (or reuse candidates.json), labelling (cached) and aggregation. `tools`: the
    target's tool schemas, for the code-found facts the analyst reads and cites (evals/facts.py).
    `labeller`: the model that labels (default: `llm`, which always discovers). Hollow episodes (the
    user simulator ended them before the agent acted) are left out and listed in capabilities.json.

    Writes facts.json, candidates.json, labels/run_XX(_evidence).json, capabilities.json, cov_delta.png."""
    cfg = cfg or AnalysisConfig()
    out = AnalysisDir(out_dir)
    out.root.mkdir(parents=True, exist_ok=True)
    if not trajs:
        raise ValueError("no trajectories to analyse: run the rollout stage first")
    left_out = [t.key for t in trajs if hollow(t)]
    trajs = [t for t in trajs if not hollow(t)]
    if not trajs:
        raise ValueError(f"all {len(left_out)} trajectories are hollow (the user simulator ended them before the "
                         "agent acted): nothing to analyse; check the user simulator")
    t0 = time.perf_counter()
    contrast = contrast_split(trajs, cfg)
    if contrast["rule"] != "passed":  # every step below (discovery, labels, figures) reads the graded split
        trajs = [replace(t, passed=t.reward >= cfg.contrast_threshold - EPS) for t in trajs]
    # with fewer passed trajectories than a contrast needs, no run can pass and the N runs would only
    # repeat one another: one run measures each candidate's coverage (to rank them), and says so
    n_passed = sum(t.passed for t in trajs)
    no_contrast = (f"no_contrast: {n_passed} passed trajectories, fewer than min_passed={cfg.min_passed}; one "
                   f"labelling run of {cfg.n_runs} made, for coverage only") if n_passed < cfg.min_passed else ""
    label_cfg = cfg.model_copy(update={"n_runs": 1, "k": 1}) if no_contrast else cfg
    labeller = labeller or llm
    models = list({id(m): m for m in (llm, labeller)}.values())
    usage0 = [asdict(m.usage) for m in models]
    facts = {t.key: trajectory_facts(t, tools) for t in trajs}
    atomic_write_json(out.facts, facts)
    cand_path = out.candidates
    try:
        if cand_path.exists():
            caps = [Candidate(**c) for c in json.loads(cand_path.read_text())["capabilities"]]
        else:
            caps = discover(llm, trajs, cfg, attempts=5, facts=facts)
            atomic_write_json(cand_path, {"capabilities": [c.model_dump() for c in caps]})
        runs = label_runs(labeller, trajs, caps, label_cfg, out, progress, facts)
    except (AnalystError, StructuredOutputError) as err:  # the model's fault: one line, its reply on disk
        atomic_write_json(out.error, {"error": str(err), "model": llm.name, "reply": getattr(err, "reply", "")})
        raise AnalystError(f"{str(err).splitlines()[0][:300]} (the model's last reply: {out.error})",
                           getattr(err, "reply", "")) from None
    outcome = {t.key: t.passed for t in trajs}
    results = aggregate(caps, runs, outcome, label_cfg)
    if no_contrast:  # Δ = ER⁻ − 0 means nothing without passed ones: the widest failure comes first
        results = sorted((r.model_copy(update={"status": "NO_CONTRAST", "reason": no_contrast}) for r in results),
                         key=lambda r: -r.cov_mean)
    usage = {k: sum(asdict(m.usage)[k] - u[k] for m, u in zip(models, usage0)) for k in usage0[0]}
    pairs = len(trajs) * len(caps)
    atomic_write_json(out.capabilities, {
        "config": cfg.model_dump(), "trajectories": len(trajs), "failed": sum(not t.passed for t in trajs),
        "passed": n_passed, "contrast": contrast, "hollow": left_out, "no_contrast": no_contrast,
        "labelling_runs": [{"run": i, "pairs": pairs, "unlabelled": r.unlabelled, "unverified": r.unverified,
                            "reliable": reliable(r, pairs, cfg)} for i, r in enumerate(runs)],
        "cost": {**usage, "wall_seconds": time.perf_counter() - t0, "model": llm.name, "labeller": labeller.name},
        "capabilities": [r.model_dump() for r in results]})
    plot_cov_delta(results, cfg, out.plot)
    return results


def contrast_split(trajs: list[Trajectory], cfg: AnalysisConfig) -> dict:
    """Which outcome the contrast reads: the benchmark's `passed` (the paper's rule), or, where fewer than
    `min_passed` passed and `contrast_threshold` is set, reward >= that threshold (a graded benchmark whose
    base agent is rarely perfect). Stated in capabilities.json and the report, never silent."""
    n_passed = sum(t.passed for t in trajs)
    if cfg.contrast_threshold is None or n_passed >= cfg.min_passed:
        return {"rule": "passed", "passed_by_benchmark": n_passed}
    graded = sum(t.reward >= cfg.contrast_threshold - EPS for t in trajs)
    return {"rule": f"reward >= {cfg.contrast_threshold:g}", "passed_by_benchmark": n_passed, "passed_by_rule": graded,
            "why": f"{n_passed} of {len(trajs)} trajectories passed by the benchmark's rule, fewer than "
                   f"min_passed={cfg.min_passed}: the contrast splits them at reward {cfg.contrast_threshold:g}"}


def plot_cov_delta(results: list[CapabilityRecord], cfg: AnalysisConfig, path: Path) -> None:
    from trace_rl.core.figures import save_figure, subplots

    fig, ax = subplots(figsize=(6, 4.5))
    for r in results:
        ax.errorbar(r.cov_mean, r.delta_mean, xerr=r.cov_std, yerr=r.delta_std, fmt="o",
                    color="tab:green" if r.kept else "tab:gray", capsize=2)
        ax.annotate(f"{r.name} ({r.runs_passed}/{r.n_runs})", (r.cov_mean, r.delta_mean), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.axvline(cfg.rho, ls="--", color="tab:red", lw=1, label=f"ρ = {cfg.rho}")
    ax.axhline(cfg.delta, ls="--", color="tab:blue", lw=1, label=f"δ = {cfg.delta}")
    ax.set_xlabel("coverage of failures (Cov)")
    ax.set_ylabel("contrast gap Δ = ER⁻ − ER⁺")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-1.02, 1.02)
    ax.set_title(f"capabilities: kept if Cov ≥ ρ and Δ ≥ δ in ≥ {cfg.k} of {cfg.n_runs} runs", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)
