"""Calibration stops early only on a certain rejection: the bounds on plain reward lists (no model, no
sandbox), checked against every way the remaining episodes could score."""
import itertools
import random

import pytest

from trace_rl.agents.verifier import VerifyConfig, calibration_result, certain_rejection, group_stats

# the method's bounds (band 0.2-0.6, caps 0.2 / 0.2 / 0.5, informative >= 0.5, std >= 0.05), the demo's 8 x 4
CFG = VerifyConfig(calib_seeds=8, calib_samples=4)


def test_too_easy_is_decided_once_success_cannot_fall_back_into_the_band():
    """8 groups of 4, each 3 successes of 4 (no group all-success, all-zero or constant): only after 7 groups
    can even 4 failures not pull the success rate (21/32) down to 0.6."""
    for played in range(1, 7):
        assert certain_rejection([[1, 1, 1, 0]] * played, CFG) == {}, played
    why = certain_rejection([[1, 1, 1, 0]] * 7, CFG)
    assert set(why) == {"success_rate", "mean_reward"}
    assert why["success_rate"] == ("success rate cannot fall below 0.6 (at least 0.66 whatever the remaining 4 "
                                   "episodes score)")


def test_it_does_not_stop_while_the_band_is_still_reachable():
    """Over the 4 groups played the success rate is 0.75, out of the band, but 16 failures still to come
    can bring it to 12/32 = 0.375: no stop (and nothing else is decided either)."""
    played = [[1, 1, 1, 0]] * 4
    assert group_stats(played, CFG)["success_rate"] == 0.75 and not group_stats(played, CFG)["accepted"]
    assert certain_rejection(played, CFG) == {}
    assert certain_rejection([[0, 0, 0, 0.5]] * 6, CFG) == {}  # 8 successes to come reach 8/32 = 0.25


def test_too_hard_and_the_group_caps():
    assert certain_rejection([[0, 0, 0, 0.5]] * 7, CFG)["success_rate"].startswith(
        "success rate cannot reach 0.2 (at most 0.12")
    assert certain_rejection([[0, 0, 0, 0]], CFG) == {}  # 1 of 8 is within the cap 0.2
    assert certain_rejection([[0, 0, 0, 0], [0, 0, 0, 0]], CFG) == {
        "all_zero_groups": "all-zero groups are already 2 of 8, over the cap 0.2"}
    # the demo's first env (exact_arguments on add_contact, 88 % success): decided after 3 of 8 groups
    demo = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.6, 1.0], [1.0, 1.0, 1.0, 1.0]]
    assert certain_rejection(demo[:2], CFG) == {}
    assert list(certain_rejection(demo, CFG)) == ["all_success_groups"]
    constant = [[0.5] * 4] * 5  # constant, yet neither all-zero nor all-success
    assert set(certain_rejection(constant, CFG)) == {"constant_groups", "informative_groups"}


def test_reward_std_is_decided_only_when_no_scores_to_come_can_spread_the_rewards():
    cfg = CFG.model_copy(update={"max_constant_groups": 1, "min_informative_groups": 0, "min_reward_std": 0.3})
    flat = [[0.5] * 4]
    assert certain_rejection(flat * 5, cfg) == {}  # 12 episodes to come can reach std 0.31
    assert set(certain_rejection(flat * 6, cfg)) == {"reward_std"}  # 8 can reach only 0.25


FIGURES = ("mean_reward", "success_rate", "reward_std", "all_success_groups", "all_zero_groups", "constant_groups",
           "informative_groups")


@pytest.mark.parametrize("bounds", [{}, {"min_reward_std": 0.45, "band": (0.3, 0.5)}], ids=["method", "tight"])
def test_a_figure_is_decided_exactly_when_no_way_the_remaining_episodes_score_brings_it_into_bounds(bounds):
    """Brute force: every completion of the remaining episodes with rewards 0 or 1 (the corners, where each
    figure taken alone reaches its extremes) through group_stats. A figure is decided iff it fails in all."""
    rng = random.Random(7)
    seen = {f: set() for f in FIGURES}
    for _ in range(300):
        total, samples = rng.choice([(4, 2), (3, 3)])
        cfg = VerifyConfig(calib_seeds=total, calib_samples=samples, **bounds)
        played = [[rng.choice([0, 0.25, 0.5, 1, 1]) for _ in range(samples)] for _ in range(rng.randint(1, total - 1))]
        left = total - len(played)
        impossible = set(FIGURES)
        for corner in itertools.product([0, 1], repeat=left * samples):
            groups = played + [list(corner[i * samples:(i + 1) * samples]) for i in range(left)]
            impossible -= {f for f, ok in group_stats(groups, cfg)["checks"].items() if ok}
        decided = certain_rejection(played, cfg)
        assert set(decided) == impossible, (played, total, decided)
        for f in FIGURES:
            seen[f].add(f in decided)
    assert all(len(outcomes) == 2 for f, outcomes in seen.items() if f != "reward_std" or bounds), seen


def test_a_stopped_calibration_reports_the_groups_played_and_why():
    played = [[1, 1, 1, 0]] * 7
    result = calibration_result(played, certain_rejection(played, CFG), CFG)
    assert result["stopped_early"]["after"] == 7 and result["stopped_early"]["of"] == 8
    assert result["stopped_early"]["why"].startswith("success rate cannot fall below 0.6")
    assert result["groups"] == played and result["success_rate"] == 0.75  # the figures of the 7 groups played
    assert not result["accepted"] and not result["checks"]["success_rate"] and result["verdict"] == "too_easy"
    whole = calibration_result([[1, 0, 0, 0]] * 8, {}, CFG)  # played to the end: nothing stopped
    assert whole["stopped_early"] is None and whole["accepted"] and whole["verdict"] is None


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="groups: 9 played, more than calib_seeds"):
        certain_rejection([[0, 1, 0, 1]] * 9, CFG)
    with pytest.raises(ValueError, match="groups: rewards must lie in"):
        certain_rejection([[0, 1.5, 0, 0]], CFG)
