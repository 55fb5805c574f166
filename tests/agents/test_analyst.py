import json
import re

import pytest

from doubles import ScriptedLLM, labels_answer
from trace_rl.agents.analyst import (AnalysisConfig, Candidate, Label, aggregate, analyze, compact,
                                     run_figures)
from trace_rl.core.trajectory import Trajectory

L, P, N = Label.LACKING, Label.PRESENT, Label.NA
CFG = AnalysisConfig(n_runs=1, k=1, min_passed=1)


def table(rows):
    """rows: (passed, label) -> (labels, outcome) keyed t0, t1, ..."""
    labels = {f"t{i}": lab for i, (_, lab) in enumerate(rows)}
    outcome = {f"t{i}": ok for i, (ok, _) in enumerate(rows)}
    return labels, outcome


def test_formulas_on_a_hand_built_table():
    # failed: 2 LACKING, 1 PRESENT, 1 NA; passed: 1 LACKING, 3 PRESENT
    labels, outcome = table([(False, L), (False, L), (False, P), (False, N), (True, L), (True, P), (True, P), (True, P)])
    f = run_figures(labels, outcome, CFG)
    assert (f.LF, f.PF, f.LP, f.PP, f.n_failed) == (2, 1, 1, 3, 4)
    assert f.cov == pytest.approx(2 / 4) and f.er_minus == pytest.approx(2 / 3) and f.er_plus == pytest.approx(1 / 4)
    assert f.delta == pytest.approx(2 / 3 - 1 / 4) and f.passed


def test_threshold_boundaries_are_inclusive():
    # Cov exactly 0.10 (1 of 10 failures LACKING), Δ exactly 0.20: ER- = 1/1... build it precisely
    rows = [(False, L)] + [(False, N)] * 9 + [(True, L)] * 4 + [(True, P)] * 1  # ER-=1, ER+=0.8, Δ=0.2
    f = run_figures(*table(rows), CFG)
    assert f.cov == pytest.approx(0.10) and f.delta == pytest.approx(0.20) and f.passed
    rows_below = [(False, L)] + [(False, N)] * 10 + [(True, L)] * 4 + [(True, P)]  # Cov = 1/11 < 0.10
    assert not run_figures(*table(rows_below), CFG).passed
    rows_gap = [(False, L)] + [(False, N)] * 9 + [(True, L)] * 9 + [(True, P)] * 1  # Δ = 0.1
    assert not run_figures(*table(rows_gap), CFG).passed


def test_edge_cases_give_defined_values():
    no_fail = run_figures(*table([(True, L), (True, P)]), CFG)
    assert no_fail.cov == 0.0 and no_fail.er_minus == 0.0 and not no_fail.passed
    no_pass = run_figures(*table([(False, L), (False, P)]), CFG)  # a gap, but nothing passed to contrast it with
    assert no_pass.er_plus == 0.0 and no_pass.delta == pytest.approx(0.5) and not no_pass.contrast
    assert not no_pass.passed
    all_na = run_figures(*table([(False, N), (True, N)]), CFG)
    assert (all_na.cov, all_na.delta, all_na.passed) == (0.0, 0.0, False)
    empty = run_figures({}, {}, CFG)
    assert empty.cov == 0.0 and not empty.passed


def test_k_of_n():
    cfg = AnalysisConfig(n_runs=10, k=8, min_passed=1)
    cap = Candidate(name="precondition_verification", description="Checks state first. It matters.",
                     example_task_ids=["t0"])
    good = {"t0": {cap.name: L}, "t1": {cap.name: P}}
    bad = {"t0": {cap.name: P}, "t1": {cap.name: P}}
    outcome = {"t0": False, "t1": True}
    for n_good, kept in [(8, True), (7, False), (10, True)]:
        runs = [good] * n_good + [bad] * (10 - n_good)
        (res,) = aggregate([cap], runs, outcome, cfg)
        assert res.runs_passed == n_good and res.kept is kept
        assert res.status == ("PENDING" if kept else "REJECTED")
    with pytest.raises(ValueError, match="k=11 exceeds n_runs=10"):
        AnalysisConfig(n_runs=10, k=11)


def traj(i, passed, n_msgs=4, body="x"):
    msgs = [{"role": "system", "content": "sys"}] + [
        {"role": "user" if j % 2 else "assistant", "content": f"m{j} " + body} for j in range(n_msgs)]
    return Trajectory(task_id=f"task{i}", benchmark="b", trial=0, model="m", messages=msgs,
                      reward=float(passed), passed=passed, termination="agent_stop")


def test_compaction_is_deterministic_and_marks_what_it_drops():
    t = traj(0, False, n_msgs=200, body="y" * 2000)
    text = compact(t, 5000)
    assert len(text) <= 5000 and text == compact(t, 5000)
    assert "messages elided" in text and "m0 " in text and "m199 " in text and "FAILED" in text
    short = compact(traj(1, True), 5000)
    assert "elided" not in short and "m3 x" in short


def test_planted_capability_kept_and_distractor_dropped(tmp_path):
    """A scripted analyst: `verify_preconditions` is lacking only in failed trajectories (and
    only in 90% of runs, noise), `polite_tone` is present everywhere."""
    trajs = [traj(i, passed=i % 3 == 0) for i in range(12)]
    failed = [t.key for t in trajs if not t.passed]

    def script(messages, tools):
        sys_prompt = messages[0]["content"]
        if "propose at most" in sys_prompt.lower():
            return json.dumps({"capabilities": [
                {"name": "verify_preconditions", "description": "Checks that a state allows an action before acting. "
                 "Its absence shows as actions taken on ineligible records.", "example_task_ids": failed[:2]},
                {"name": "polite_tone", "description": "Speaks politely. Greets the user.",
                 "example_task_ids": failed[2:4]}]})
        shown = re.findall(r"### trajectory (\S+)\noutcome: (\w+)", messages[1]["content"])  # short ids
        seed = len(script.calls)
        script.calls.append(1)
        labels = []
        for k, seen in shown:
            noisy = (sum(map(ord, k)) + seed) % 10 == 0
            labels.append({"trajectory": k, "capability": "verify_preconditions",
                           "label": "LACKING" if seen == "FAILED" and not noisy else "PRESENT", "step": 1,
                           "quote": "m0 x"})  # evidence that checks: message 1 is "m0 x"
            labels.append({"trajectory": k, "capability": "polite_tone", "label": "PRESENT", "step": 2, "quote": "M1 X"})
        return labels_answer(labels)
    script.calls = []
    llm = ScriptedLLM(script)
    cfg = AnalysisConfig(n_runs=10, k=8, context_chars=3000, per_trajectory_chars=1000, concurrency=2)
    results = analyze(trajs, llm, tmp_path, cfg, progress=False)
    by = {r.name: r for r in results}
    assert by["verify_preconditions"].kept and by["verify_preconditions"].runs_passed >= 8
    assert not by["polite_tone"].kept and by["polite_tone"].delta_mean == 0.0
    assert results[0].name == "verify_preconditions"
    out = json.loads((tmp_path / "capabilities.json").read_text())
    assert out["cost"]["calls"] == llm.usage.calls and (tmp_path / "cov_delta.png").exists()
    assert len(list((tmp_path / "labels").glob("run_??.json"))) == 10
    evidence = json.loads((tmp_path / "labels" / "run_00_evidence.json").read_text())
    assert evidence[trajs[1].key]["verify_preconditions"] == {"label": "LACKING", "step": 1, "quote": "m0 x",
                                                              "fact": None, "checked": True}
    # resume: everything cached, no new LLM calls
    calls = llm.usage.calls
    again = analyze(trajs, llm, tmp_path, cfg, progress=False)
    assert llm.usage.calls == calls and [r.name for r in again] == [r.name for r in results]


def test_a_separate_labeller_labels_and_the_analyst_only_discovers(tmp_path):
    trajs = [traj(i, passed=i % 3 == 0) for i in range(9)]  # 3 passed: the contrast a run needs
    failed = [t.key for t in trajs if not t.passed]
    analyst = ScriptedLLM([json.dumps({"capabilities": [{"name": "state_tracking", "description": "Tracks state. Well.",
                                                         "example_task_ids": failed[:2]}]})], name="big")
    labeller = ScriptedLLM(_labelling_script(skip=set()), name="small")
    results = analyze(trajs, analyst, tmp_path, AnalysisConfig(n_runs=2, k=2), progress=False, labeller=labeller)
    assert analyst.usage.calls == 1 and labeller.usage.calls >= 2  # one discovery; at least one call per run
    assert results[0].name == "state_tracking" and results[0].kept
    cost = json.loads((tmp_path / "capabilities.json").read_text())["cost"]
    assert cost["calls"] == 1 + labeller.usage.calls and (cost["model"], cost["labeller"]) == ("big", "small")


def test_discovery_rejects_domain_recipes_and_retries(tmp_path):
    trajs = [traj(i, passed=i == 0) for i in range(4)]
    failed = [t.key for t in trajs if not t.passed]
    answers = [
        json.dumps({"capabilities": [{"name": "flight_rebooking", "description": "Rebooks flights. Well.",
                                      "example_task_ids": failed[:2]}]}),
        json.dumps({"capabilities": [{"name": "state_tracking", "description": "Tracks state. Across turns.",
                                      "example_task_ids": failed[:2]}]}),
    ]
    from trace_rl.agents.analyst import discover

    llm = ScriptedLLM(answers)
    caps = discover(llm, trajs, AnalysisConfig(domain_words=["flight", "airline"]))
    assert [c.name for c in caps] == ["state_tracking"]
    assert "names the domain (flight)" in llm.requests[1][-1]["content"]


def test_discovery_asks_for_at_most_n_candidates_in_the_decoding_schema():
    """A check after decoding was not enough: the demo's 0.5B proposed 4 of 3 in all 5 attempts. The
    schema the endpoint decodes to now holds the bound, so a grammar cannot write a fourth."""
    from trace_rl.agents.analyst import discover

    trajs = [traj(i, passed=i == 0) for i in range(4)]
    failed = [t.key for t in trajs if not t.passed]
    llm = ScriptedLLM([json.dumps({"capabilities": [{"name": "state_tracking", "description": "Tracks state. Well.",
                                                     "example_task_ids": failed[:2]}]})])
    formats = []
    complete = llm._complete
    llm._complete = lambda messages, tools, **kw: formats.append(kw.get("response_format")) or complete(messages, tools)
    discover(llm, trajs, AnalysisConfig(n_candidates=3))
    schema = formats[0]["json_schema"]["schema"] if "json_schema" in formats[0] else formats[0]["schema"]
    assert schema["properties"]["capabilities"]["maxItems"] == 3


def test_discovery_reads_the_code_found_summary_of_all_trajectories():
    from trace_rl.agents.analyst import discover
    from trace_rl.evals.facts import trajectory_facts

    trajs = [traj(i, passed=i == 0) for i in range(6)]
    failed = [t.key for t in trajs if not t.passed]
    llm = ScriptedLLM([json.dumps({"capabilities": [{"name": "state_tracking", "description": "Tracks state. Well.",
                                                     "example_task_ids": failed[:2]}]})])
    facts = {t.key: trajectory_facts(t) for t in trajs}
    discover(llm, trajs, AnalysisConfig(discovery_examples=2), facts=facts)
    shown = llm.requests[0][-1]["content"]
    assert shown.startswith("Code-found facts across all 6 trajectories (5 failed, 1 passed)")
    assert "no_tool_calls (the agent ended without calling any tool): failed 5 of 5, passed 1 of 1" in shown  # all six


def test_discovery_rejects_duplicates():
    from trace_rl.agents.analyst import Candidates, _check_candidates

    cap = lambda n: {"name": n, "description": "Does a thing. Well.", "example_task_ids": ["b/task1/0"]}
    cands = Candidates(capabilities=[cap("state_tracking"), cap("state_tracking_across_turns"), cap("tool_precision")])
    with pytest.raises(ValueError, match="state_tracking_across_turns: duplicates"):
        _check_candidates(cands, AnalysisConfig(), {"b/task1/0"})
    ok = _check_candidates(Candidates(capabilities=[cap("state_tracking"), cap("tool_precision")]), AnalysisConfig(),
                           {"b/task1/0"})
    assert [c.name for c in ok] == ["state_tracking", "tool_precision"]
    with pytest.raises(ValueError, match="at least 1"):  # parses as JSON, names nothing: retried, not accepted
        Candidates.model_validate({"capabilities": []})


def test_example_ids_are_resolved_when_the_model_copies_the_header():
    from trace_rl.agents.analyst import resolve_id

    ids = {"tau2:telecom/[x]a|b/0", "tau2:telecom/[x]a|c/0", "tau2:airline/13/0"}
    assert resolve_id("### trajectory tau2:airline/13/0", ids) == "tau2:airline/13/0"
    assert resolve_id(" tau2:airline/13/0 ", ids) == "tau2:airline/13/0"
    assert resolve_id("airline/13", ids) == "tau2:airline/13/0"  # the one id containing it
    assert resolve_id("tau2:telecom/[x]a", ids) is None  # ambiguous: two ids contain it
    assert resolve_id("tau2:retail/1/0", ids) is None


def _labelling_script(skip: set[str]):
    """Labels `skip` capabilities never; the others LACKING on failed, PRESENT on passed."""
    def script(messages, tools):
        text = messages[1]["content"] if len(messages) > 1 else ""
        if "propose at most" in messages[0]["content"].lower():
            raise AssertionError("discovery is not under test here")
        ids = re.findall(r"### trajectory (\S+)\noutcome: (PASSED|FAILED)", text)
        names = re.findall(r"^- ([a-z_]+):", messages[0]["content"], re.M)
        return labels_answer([{"trajectory": k, "capability": c, "label": "PRESENT" if o == "PASSED" else "LACKING",
                               "step": 1, "quote": "m0 x"} for k, o in ids for c in names if c not in skip])
    return script


def _caps(*names):
    return [Candidate(name=n, description="Does a thing before acting. It matters.", example_task_ids=["x"]) for n in names]


def _write_candidates(path, caps):
    path.mkdir(parents=True, exist_ok=True)
    (path / "candidates.json").write_text(json.dumps({"capabilities": [c.model_dump() for c in caps]}))


def test_unlabelled_pairs_are_na_counted_and_make_a_run_unreliable(tmp_path):
    """A pair the analyst never labels is NA (not PRESENT) and counted; a run with more than
    20 % of its pairs unlabelled does not count toward K."""
    trajs = [traj(i, passed=i % 2 == 0) for i in range(8)]  # 4 passed, 4 failed
    caps = _caps("lookup_before_acting", "ignored_capability_x")
    _write_candidates(tmp_path, caps)
    llm = ScriptedLLM(_labelling_script(skip={"ignored_capability_x"}))
    cfg = AnalysisConfig(n_runs=2, k=1, concurrency=1)
    results = analyze(trajs, llm, tmp_path, cfg, progress=False)
    cached = json.loads((tmp_path / "labels" / "run_00.json").read_text())
    assert {d["ignored_capability_x"] for d in cached.values()} == {"UNLABELLED"}  # never PRESENT
    out = json.loads((tmp_path / "capabilities.json").read_text())
    assert [r["unlabelled"] for r in out["labelling_runs"]] == [8, 8]  # 8 of 16 pairs
    assert not any(r["reliable"] for r in out["labelling_runs"])  # 50 % > 20 %
    by = {r.name: r for r in results}
    # lookup_before_acting has a perfect gap in both runs, but neither run is reliable
    assert by["lookup_before_acting"].runs[0]["delta"] == 1.0 and not by["lookup_before_acting"].kept
    assert by["lookup_before_acting"].reliable_runs == 0 and "reliable" in by["lookup_before_acting"].reason
    assert by["ignored_capability_x"].runs[0]["PP"] == 0  # NA, not PRESENT


def test_a_reliable_run_with_few_unlabelled_pairs_still_counts(tmp_path):
    trajs = [traj(i, passed=i % 2 == 0) for i in range(10)]
    caps = _caps("lookup_before_acting")
    _write_candidates(tmp_path, caps)
    labels_dir = tmp_path / "labels"
    labels_dir.mkdir()
    # one cached run: 2 of 10 pairs unlabelled (20 %, the boundary: still reliable)
    (labels_dir / "run_00.json").write_text(json.dumps(
        {t.key: {"lookup_before_acting": "UNLABELLED" if i < 2 else ("PRESENT" if t.passed else "LACKING")}
         for i, t in enumerate(trajs)}))
    (res,) = analyze(trajs, ScriptedLLM([]), tmp_path, AnalysisConfig(n_runs=1, k=1), progress=False)
    assert res.kept and res.reliable_runs == 1 and res.runs[0]["reliable"]


def test_a_gap_without_passed_trajectories_is_no_contrast_not_kept(tmp_path):
    """Cov and Δ pass, but only 2 passed trajectories are applicable (min_passed = 3)."""
    trajs = [traj(i, passed=i < 2) for i in range(8)]  # 2 passed, 6 failed
    caps = _caps("lookup_before_acting")
    _write_candidates(tmp_path, caps)
    (res,) = analyze(trajs, ScriptedLLM(_labelling_script(set())), tmp_path, AnalysisConfig(n_runs=2, k=2),
                     progress=False)
    assert res.runs[0]["cov"] == 1.0 and res.runs[0]["delta"] == 1.0
    assert not res.kept and res.status == "NO_CONTRAST" and "no_contrast" in res.reason
    more = [traj(i, passed=i < 3) for i in range(8)]  # with 3 passed it is kept
    _write_candidates(tmp_path / "b", caps)
    (res,) = analyze(more, ScriptedLLM(_labelling_script(set())), tmp_path / "b", AnalysisConfig(n_runs=2, k=2),
                     progress=False)
    assert res.kept and res.status == "PENDING"


def test_an_analyst_that_never_answers_validly_is_one_line_with_its_reply_kept(tmp_path):
    """An analyst model that only writes prose: one line (the CLI exits 2 with it), the raw reply on disk."""
    from trace_rl.agents.analyst import AnalystError

    trajs = [traj(i, passed=i % 2 == 0) for i in range(4)]
    with pytest.raises(AnalystError, match="analyst_error.json") as err:
        analyze(trajs, ScriptedLLM(lambda m, t: "I think the agent is fine overall."), tmp_path, AnalysisConfig(
            n_runs=1, k=1), progress=False)
    assert len(str(err.value).splitlines()) == 1
    saved = json.loads((tmp_path / "analyst_error.json").read_text())
    assert "fine overall" in saved["reply"] and saved["error"]


def test_a_batch_the_analyst_cannot_label_is_unlabelled_not_a_crash(tmp_path):
    trajs = [traj(i, passed=i % 2 == 0) for i in range(6)]
    _write_candidates(tmp_path, _caps("lookup_before_acting"))
    (res,) = analyze(trajs, ScriptedLLM(lambda m, t: "no json here"), tmp_path, AnalysisConfig(n_runs=1, k=1),
                     progress=False)
    out = json.loads((tmp_path / "capabilities.json").read_text())
    assert out["labelling_runs"][0]["unlabelled"] == 6 and not res.kept


def test_a_label_whose_evidence_does_not_check_is_na_and_counted(tmp_path):
    """A quote found nowhere in the trajectory, a fact code never found, or no evidence at all: each
    such PRESENT/LACKING label counts as NA and is counted per run. A quote found at another step
    than the one cited checks there (small models miscount steps, not text)."""
    trajs = [traj(i, passed=i % 2 == 0) for i in range(6)]
    bad = [{"step": 1, "quote": "never said"}, {"step": 99, "quote": "m0 x"}, {"fact": "write_without_read"}, {}]

    def script(messages, tools):
        if "propose at most" in messages[0]["content"].lower():
            return json.dumps({"capabilities": [{"name": "verify_preconditions", "description": "Checks first. "
                               "It matters.", "example_task_ids": [t.key for t in trajs if not t.passed][:2]}]})
        ids = re.findall(r"### trajectory (\S+)", messages[1]["content"])
        return labels_answer([{"trajectory": k, "capability": "verify_preconditions", "label": "LACKING",
                               **bad[i % len(bad)]} for i, k in enumerate(ids)])
    cfg = AnalysisConfig(n_runs=2, k=1, context_chars=3000, per_trajectory_chars=1000, concurrency=1)
    (res,) = analyze(trajs, ScriptedLLM(script), tmp_path, cfg, progress=False)
    runs = json.loads((tmp_path / "capabilities.json").read_text())["labelling_runs"]
    # a quote found nowhere, a fact code did not find, no evidence: 4 of 6 (trajectories 0, 2, 3, 4) per run;
    # "m0 x" cited at step 99 is in the trajectory at step 1: checked there, the model's step kept beside it
    assert [r["unverified"] for r in runs] == [4, 4] and not res.kept
    moved = json.loads((tmp_path / "labels" / "run_00_evidence.json").read_text())[trajs[1].key]["verify_preconditions"]
    assert moved == {"label": "LACKING", "step": 1, "quote": "m0 x", "fact": None, "cited_step": 99, "checked": True}
    assert "[1] [assistant] m0 x" in compact(trajs[0], 1000)  # what the analyst sees: the step numbers it cites


def test_the_labelling_grammar_requires_every_pair_and_the_parser_keeps_a_partial_answer():
    from pydantic import ValidationError

    from trace_rl.agents.analyst import answer_items, answer_shapes

    strict, lenient = answer_shapes(["T1", "T2"], ["tool_use", "model_json_schema"])  # a name pydantic would shadow
    schema = strict.model_json_schema()
    assert schema["required"] == ["T1", "T2"]
    pairs = schema["$defs"][schema["properties"]["T1"]["$ref"].split("/")[-1]]
    assert pairs["required"] == ["tool_use", "model_json_schema"] and "required" not in lenient.model_json_schema()
    partial = {"T2": {"model_json_schema": {"label": "LACKING", "step": 3, "quote": "get_order"}}}
    with pytest.raises(ValidationError):
        strict.model_validate(partial)
    (item,) = answer_items(lenient.model_validate(partial), ["T1", "T2"], ["tool_use", "model_json_schema"])
    # with the facts code found per trajectory, a label may cite only those (T2: none, so no fact field at all)
    strict, _ = answer_shapes(["T1", "T2"], ["tool_use"], {"T1": ["tool_errors", "no_tool_calls"], "T2": []})
    defs = strict.model_json_schema()["$defs"]
    t1 = next(d for n, d in defs.items() if n.endswith("0Label"))
    t2 = next(d for n, d in defs.items() if n.endswith("1Label"))
    assert t1["properties"]["fact"]["anyOf"][0]["enum"] == ["tool_errors", "no_tool_calls"] and "fact" not in t2["properties"]
    assert (item.trajectory, item.capability, item.label, item.step) == ("T2", "model_json_schema", Label.LACKING, 3)


def test_a_labelling_call_asks_no_more_pairs_than_its_answer_can_hold():
    from trace_rl.agents.analyst import _batches

    trajs = [traj(i, False) for i in range(27)]  # short ones: all 27 fit the context budget together
    cfg = AnalysisConfig(context_chars=12000, labels_per_call=24)
    assert len(_batches(trajs, cfg, 1)) == 2  # 24 + 3
    batches = _batches(trajs, cfg, 4)
    assert [len(b) for b in batches] == [6, 6, 6, 6, 3] and sum(batches, []) == trajs


def test_hollow_episodes_are_left_out_of_the_contrast_and_listed(tmp_path):
    """An episode the user simulator ended before the agent acted is no evidence either way: with these
    three 'passes' counted the gap below would have its contrast; left out, it has none."""
    def ended_by_user(i, passed):
        return Trajectory(task_id=f"h{i}", benchmark="b", trial=0, model="m", passed=passed, reward=float(passed),
                          termination="user_stop", messages=[{"role": "system", "content": "sys"},
                                                             {"role": "assistant", "content": "m0 x"},
                                                             {"role": "user", "content": "###STOP###"}])
    hollow = [ended_by_user(i, passed=i < 3) for i in range(4)]
    trajs = [traj(i, passed=False) for i in range(6)] + hollow
    _write_candidates(tmp_path, _caps("lookup_before_acting"))
    (res,) = analyze(trajs, ScriptedLLM(_labelling_script(set())), tmp_path, AnalysisConfig(n_runs=2, k=2),
                     progress=False)
    saved = json.loads((tmp_path / "capabilities.json").read_text())
    assert sorted(saved["hollow"]) == sorted(t.key for t in hollow)
    assert saved["trajectories"] == 6 and saved["passed"] == 0
    assert not res.kept and res.status == "NO_CONTRAST"
    with pytest.raises(ValueError, match="hollow"):
        analyze(hollow, ScriptedLLM([]), tmp_path / "b", AnalysisConfig(n_runs=1, k=1), progress=False)


def test_a_quote_copied_as_the_analyst_saw_it_checks():
    """The 1.5B on τ² telecom quoted tool calls as shown ("CALL done({})", with no step) in 1,166 of
    1,443 LACKING labels; the check once matched another rendering and made every one of them NA."""
    from trace_rl.agents.analyst import LabelItem, evidence_ok

    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "done", "arguments": "{}"}}]}
    t = Trajectory(task_id="t", benchmark="b", trial=0, model="m", passed=False, reward=0.0, termination="agent_stop",
                   messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "Solve it."}, call])
    shown = compact(t, 2000)
    assert "[2] [assistant] CALL done({})" in shown
    for quote, step in [("CALL done({})", None), ("done({})", 2), ("[2] [assistant] CALL done({})", None)]:
        item = LabelItem(trajectory=t.key, capability="c", label="LACKING", step=step, quote=quote)
        assert evidence_ok(item, t, {}) and item.step == 2, quote
    made_up = LabelItem(trajectory=t.key, capability="c", label="LACKING", step=None, quote="CALL refuel_data({})")
    assert not evidence_ok(made_up, t, {})
    facts = {"no_tool_calls": [], "repeated_calls": [{"step": 2, "detail": "done({})"}]}
    fact_line = LabelItem(trajectory=t.key, capability="c", label="LACKING", quote="fact repeated_calls at step 2: done")
    assert evidence_ok(fact_line, t, facts) and fact_line.fact == "repeated_calls"
    not_found = LabelItem(trajectory=t.key, capability="c", label="LACKING", quote="fact no_tool_calls at step 2: x")
    assert not evidence_ok(not_found, t, facts)


def test_without_enough_passed_trajectories_one_labelling_run_ranks_the_candidates(tmp_path):
    """No run can pass K-of-N without a contrast, so N runs would only repeat one another: one run
    is made, for coverage (what `train_unkept` ranks by), and the record says why."""
    trajs = [traj(i, passed=i < 2) for i in range(8)]  # 2 passed < min_passed 3
    _write_candidates(tmp_path, _caps("lookup_before_acting"))
    (res,) = analyze(trajs, ScriptedLLM(_labelling_script(set())), tmp_path, AnalysisConfig(n_runs=5, k=4),
                     progress=False)
    # ranked by coverage, not by Δ (which is ER⁻ alone here): narrow_gap is LACKING in 1 of 6 failed
    # (Δ 1.0), wide_gap in 4 of 6 and PRESENT in 2 (Δ 0.67)
    seen = {"narrow_gap": 0, "wide_gap": 0}

    def script(messages, tools):
        items = []
        for k, outcome in re.findall(r"### trajectory (\S+)\noutcome: (PASSED|FAILED)", messages[1]["content"]):
            for cap in seen:
                label = "NA"
                if outcome == "FAILED":
                    seen[cap] += 1
                    label = ("LACKING" if seen[cap] <= 4 else "PRESENT") if cap == "wide_gap" else \
                        ("LACKING" if seen[cap] == 1 else "NA")
                items.append({"trajectory": k, "capability": cap, "label": label, "step": 1, "quote": "m0 x"})
        return labels_answer(items)
    _write_candidates(tmp_path / "two", _caps("narrow_gap", "wide_gap"))
    ranked = analyze(trajs, ScriptedLLM(script), tmp_path / "two", AnalysisConfig(n_runs=5, k=4), progress=False)
    assert [(r.name, round(r.cov_mean, 2), round(r.delta_mean, 2)) for r in ranked] == [
        ("wide_gap", 0.67, 0.67), ("narrow_gap", 0.17, 1.0)]
    saved = json.loads((tmp_path / "capabilities.json").read_text())
    assert len(saved["labelling_runs"]) == 1 and res.n_runs == 1 and saved["config"]["n_runs"] == 5
    assert "2 passed trajectories" in saved["no_contrast"] and res.reason == saved["no_contrast"]
    assert res.status == "NO_CONTRAST" and not res.kept and res.cov_mean == 1.0
    assert sorted(p.name for p in (tmp_path / "labels").glob("run_??.json")) == ["run_00.json"]


def test_a_graded_benchmark_contrasts_at_the_stated_threshold_only_when_too_few_are_perfect(tmp_path):
    """ToolSandbox-like scores: none perfect, so the paper's rule has no contrast; with contrast_threshold
    the analyst reads reward >= 0.5 as passed (the labeller sees PASSED on those), capabilities.json
    states the rule and why. Where enough episodes pass by the benchmark's rule, the threshold is unused."""
    def graded(i, reward):
        t = traj(i, passed=reward >= 1.0)
        t.reward = reward
        return t
    trajs = [graded(i, r) for i, r in enumerate([0.1, 0.2, 0.3, 0.6, 0.7, 0.8, 0.9, 0.2])]
    _write_candidates(tmp_path, _caps("lookup_before_acting"))
    cfg = AnalysisConfig(n_runs=2, k=2, contrast_threshold=0.5)
    (res,) = analyze(trajs, ScriptedLLM(_labelling_script(set())), tmp_path, cfg, progress=False)
    saved = json.loads((tmp_path / "capabilities.json").read_text())
    assert saved["contrast"]["rule"] == "reward >= 0.5" and saved["contrast"]["passed_by_benchmark"] == 0
    assert saved["contrast"]["passed_by_rule"] == 4 and "fewer than min_passed=3" in saved["contrast"]["why"]
    assert saved["passed"] == 4 and not saved["no_contrast"]
    assert res.kept and res.status == "PENDING"  # LACKING on the 4 below 0.5, PRESENT on the 4 above: Δ = 1
    # no threshold: the paper's rule, no contrast
    _write_candidates(tmp_path / "paper", _caps("lookup_before_acting"))
    (plain,) = analyze(trajs, ScriptedLLM(_labelling_script(set())), tmp_path / "paper",
                       AnalysisConfig(n_runs=2, k=2), progress=False)
    assert plain.status == "NO_CONTRAST"
    assert json.loads((tmp_path / "paper" / "capabilities.json").read_text())["contrast"]["rule"] == "passed"
    # enough perfect episodes: the threshold is not used
    perfect = [graded(i, 1.0 if i < 3 else 0.7) for i in range(8)]
    _write_candidates(tmp_path / "enough", _caps("lookup_before_acting"))
    analyze(perfect, ScriptedLLM(_labelling_script(set())), tmp_path / "enough", cfg, progress=False)
    assert json.loads((tmp_path / "enough" / "capabilities.json").read_text())["contrast"] == {
        "rule": "passed", "passed_by_benchmark": 3}


def test_a_candidate_keeps_its_failed_examples_and_drops_an_extra_passed_one():
    """A small model cites a failed trajectory and a passed one (the demo's 0.5B did, five times running):
    the passed one is dropped; a candidate citing no failed trajectory is sent back with the ids it may cite."""
    from trace_rl.agents.analyst import Candidates, _check_candidates

    cap = lambda ids: Candidates(capabilities=[{"name": "state_tracking", "description": "Does a thing. Well.",  # noqa: E731
                                                "example_task_ids": ids}])
    failed = {"T1", "T3"}
    assert _check_candidates(cap(["T1", "T2"]), AnalysisConfig(), failed)[0].example_task_ids == ["T1"]
    with pytest.raises(ValueError, match=r"example ids \['T2'\] are not failed trajectories shown; cite failed ones: T1, T3"):
        _check_candidates(cap(["T2"]), AnalysisConfig(), failed)
