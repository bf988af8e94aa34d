"""Hand-computed cases for every reward in the registry, and the weighted sum."""

import math

import numpy as np
import pytest

from omgrpo.core.rewards import REWARDS, compute_rewards, get_reward, majority_class, make_group


def test_registry_has_every_paper_reward():
    assert set(REWARDS) == {
        "gt",
        "majority_vote",
        "soft_vote",
        "format",
        "self_certainty",
        "entropy",
        "coreward",
        "process",  # the PRM baselines of the appendix
    }


def test_unknown_reward_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*majority_vote.*soft_vote"):
        get_reward("nope")


def test_gt_uses_equivalence_and_needs_a_label():
    g = make_group(["1/2", "0.5", "\\frac{1}{2}", "2", None], label="\\frac12")
    assert get_reward("gt")(g) == [1.0, 1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="needs labels"):
        get_reward("gt")(make_group(["1"]))


def test_majority_vote_hand_case_and_tie_rule():
    # classes: {3, 3.0} x2, {5} x2, None -> tie between 3 and 5; 3 appears first -> wins
    g = make_group(["5", "3", "3.0", "5", None])
    assert majority_class(g.classes) == g.classes[0]  # "5" appears first
    assert get_reward("majority_vote")(g) == [1.0, 0.0, 0.0, 1.0, 0.0]
    g = make_group(["3", "5", "3.0", "5"])
    assert get_reward("majority_vote")(g) == [1.0, 0.0, 1.0, 0.0]
    # no answers at all: nobody wins, nothing raises
    assert get_reward("majority_vote")(make_group([None, None])) == [0.0, 0.0]


def test_soft_vote_shares_exclude_non_voters():
    # voters: 2, 2.0, 4/2 (one class of 3) and 7 -> shares 3/4 and 1/4
    g = make_group(["2", "2.0", None, "7", "\\frac{4}{2}"])
    assert get_reward("soft_vote")(g) == [0.75, 0.75, 0.0, 0.25, 0.75]


def test_soft_vote_with_an_augmented_pool():
    # rollouts: 1, 2 ; pool (CAR answers): 1, 1, 2, None -> voters 1,2,1,1,2 -> 3/5, 2/5
    g = make_group(["1", "2"], pool=["1", "1.0", "2", None])
    assert get_reward("soft_vote")(g) == pytest.approx([0.6, 0.4])


def test_format_reward():
    assert get_reward("format")(make_group(["x", None, ""])) == [1.0, 0.0, 1.0]


def test_self_certainty_and_entropy_pass_through_values():
    g = make_group(["1", None], self_certainty=[0.3, 1.2])
    assert get_reward("self_certainty")(g) == [0.3, 1.2]
    g = make_group(["1", None], answer_entropy=[0.5, None], max_entropy=math.log(100))
    assert get_reward("entropy")(g) == pytest.approx([-0.5, -math.log(100)])


def test_coreward_rewards_agreement_with_the_paraphrase_majority():
    g = make_group(["4", "5", "4.0", None], partner=["5", "5", "4"])
    assert get_reward("coreward")(g) == [0.0, 1.0, 0.0, 0.0]


def test_compute_rewards_weighted_sum_and_parts():
    groups = [make_group(["1", "1", "2", None]), make_group(["3", "3"])]
    total, parts = compute_rewards(groups, ["soft_vote", "format"], {"format": 0.5})
    np.testing.assert_allclose(parts["soft_vote"], [2 / 3, 2 / 3, 1 / 3, 0, 1, 1])
    np.testing.assert_allclose(parts["format"], [1, 1, 1, 0, 1, 1])
    np.testing.assert_allclose(total, parts["soft_vote"] + 0.5 * parts["format"])


def test_compute_rewards_rejects_bad_config():
    with pytest.raises(ValueError, match="unknown reward"):
        compute_rewards([make_group(["1"])], ["soft_vote", "typo"])
    with pytest.raises(ValueError, match=r"not in reward\.parts"):
        compute_rewards([make_group(["1"])], ["soft_vote"], {"format": 1.0})
