"""The DAPO-family options (`omgrpo.core.dapo`, `grpo_loss`'s `clip_low` / `clip_high` /
`sample_mask` / `agg`): hand-computed small cases, each composed with the answer mask (answer
tokens' gradient exactly zero at w = 0), and their config validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from omgrpo.config import AlgorithmConfig, check_values, compose, validate_algorithm
from omgrpo.core.dapo import (
    dapo_on,
    dapo_step,
    overlong_penalty,
    truncated_rows,
    zero_spread_rows,
)
from omgrpo.core.losses import AGG_MODES, grpo_loss

# --------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------


def test_zero_spread_rows_marks_whole_groups_whose_rewards_agree():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 2.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])  # group 2: one rollout, no spread
    assert zero_spread_rows(rewards, groups).tolist() == [False] * 3 + [True] * 4


def test_truncated_rows_are_full_length_without_a_stop_token():
    ids = torch.tensor([[5, 6, 7, 2], [5, 6, 7, 8], [5, 2, 0, 0], [5, 6, 7, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    # stop tokens 2 and 9: row 0 and row 3 ended at the limit, row 2 early; row 1 was cut
    assert truncated_rows(ids, mask, 4, [2, 9]).tolist() == [False, True, False, False]
    assert truncated_rows(ids, mask, 4, 2).tolist() == [False, True, False, True]
    assert truncated_rows(ids, mask, 4, None).tolist() == [True, True, False, True]


def test_overlong_penalty_is_dapos_linear_ramp():
    # max 10 tokens, buffer 4: 0 up to 6 tokens, then -f/4 per token, -f at 10
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), 10, 4, penalty_factor=2.0)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -2.0])
    np.testing.assert_allclose(overlong_penalty([10], 10, 4), [-1.0])  # factor 1 by default
    with pytest.raises(ValueError, match=r"algorithm\.overlong_buffer"):
        overlong_penalty([3], 10, 11)


def _algo(**kw):
    return OmegaConf.structured(AlgorithmConfig(**kw))


def test_dapo_step_counts_dropped_groups_and_filters_truncated_rollouts():
    rewards = np.array([1.0, 0.0, 0.5, 0.5, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    lengths = torch.tensor([3, 10, 4, 4, 10, 2])
    truncated = torch.tensor([False, True, False, False, True, False])
    out = dapo_step(_algo(dynamic_sampling=True), rewards, groups, lengths, truncated, 10)
    assert out.sample_mask.tolist() == [True, True, False, False, False, False]
    assert out.metrics == {"dapo/dropped_groups": 2.0, "dapo/kept_rollouts": pytest.approx(1 / 3)}
    assert out.advantages is None and np.array_equal(out.rewards, rewards)

    out = dapo_step(_algo(overlong_filter=True), rewards, groups, lengths, truncated, 10)
    assert out.sample_mask.tolist() == [True, False, True, True, False, True]
    assert out.metrics["dapo/truncated"] == pytest.approx(1 / 3)


def test_dapo_step_overlong_buffer_shapes_rewards_before_the_advantages():
    rewards = np.array([1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    lengths = torch.tensor([4, 10, 10, 4])  # max 10, buffer 4: the 10-token ones lose 0.5
    algo = _algo(overlong_buffer=4, overlong_penalty_factor=0.5, dynamic_sampling=True)
    out = dapo_step(algo, rewards, groups, lengths, torch.zeros(4, dtype=torch.bool), 10)
    np.testing.assert_allclose(out.rewards, [1.0, 0.5, -0.5, 0.0])
    # each group now has spread: nothing dropped, and the shorter answer is preferred
    assert out.metrics["dapo/dropped_groups"] == 0.0
    assert out.advantages[0] > 0 > out.advantages[1] and out.advantages[3] > 0 > out.advantages[2]
    assert out.metrics["dapo/overlong_penalty"] == pytest.approx(-0.25)


def test_every_option_is_off_by_default():
    algo = _algo()
    assert not dapo_on(algo)
    assert algo.clip_low is None and algo.clip_high is None
    assert dapo_on(_algo(overlong_buffer=2)) and dapo_on(_algo(overlong_filter=True))


# --------------------------------------------------------------------------------------------
# The loss: asymmetric clip, aggregation modes, dropped rollouts
# --------------------------------------------------------------------------------------------


def test_asymmetric_clip_hand_computed():
    """One token per rollout, KL off: ratios 1.5 (A=+1), 0.5 (A=-1), 0.5 (A=+1)."""
    old = torch.zeros(3, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5], [0.5]]))
    adv = torch.tensor([1.0, -1.0, 1.0])
    ones, no_answer = torch.ones(3, 1), torch.zeros(3, 1)

    def loss(**kw):
        return grpo_loss(logp, old, None, adv, ones, no_answer, kl_coef=0.0, **kw)[0].item()

    # clip to [0.9, 1.3]: -min(1.5, 1.3) = -1.3; -min(-0.5, -0.9) = 0.9; -min(0.5, 0.9) = -0.5
    assert loss(clip_low=0.1, clip_high=0.3) == pytest.approx((-1.3 + 0.9 - 0.5) / 3)
    assert loss(clip=0.2) == pytest.approx((-1.2 + 0.8 - 0.5) / 3)
    assert loss(clip=0.2, clip_high=0.3) == pytest.approx((-1.3 + 0.8 - 0.5) / 3)
    assert loss(clip=0.2, clip_low=0.2, clip_high=0.2) == loss(clip=0.2)  # null = clip


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 4.5 / 5),
        ("seq-mean-token-mean", (-0.75 + 2) / 2),
        ("seq-mean-token-sum", 4.5 / 2),
    ],
)
def test_aggregation_modes_hand_computed_with_the_answer_weight(mode, expected):
    """Ratio 1, KL off: pg_t = -m_t A_i. Row 0: 2 tokens, A=1, the second an answer token at
    w=0.5 -> [-1, -0.5]; row 1: 3 tokens, A=-2 -> [2, 2, 2]."""
    logp = torch.zeros(2, 3)
    resp = torch.tensor([[1, 1, 0], [1, 1, 1]])
    answer = torch.tensor([[0, 1, 0], [0, 0, 0]])
    adv = torch.tensor([1.0, -2.0])
    loss, _ = grpo_loss(
        logp, logp, None, adv, resp, answer, answer_weight=0.5, kl_coef=0.0, agg=mode
    )
    assert loss.item() == pytest.approx(expected)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    logp = (-torch.rand(B, T, generator=g) - 0.1).requires_grad_(True)
    old = logp.detach() + (torch.rand(B, T, generator=g) - 0.5) * 0.8  # some ratios clip
    ref = -torch.rand(B, T, generator=g) - 0.1
    resp = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0], [1] * 3 + [0] * 3]).bool()
    answer = torch.zeros(B, T, dtype=torch.bool)
    answer[0, 3:5] = answer[1, 2] = answer[2, 1:3] = answer[3, 2] = True
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5])
    return logp, old, ref, adv, resp, answer


OPTIONS = [
    {"clip_low": 0.1, "clip_high": 0.28},
    *({"agg": mode} for mode in AGG_MODES),
    {"sample_mask": torch.tensor([True, False, True, True])},
    {"sample_mask": torch.tensor([True, False, True, True]), "agg": "seq-mean-token-mean"},
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "+".join(sorted(o)) + str(o.get("agg", ""))
)
def test_answer_tokens_get_exactly_zero_gradient_at_w0_under_every_option(options):
    logp, old, ref, adv, resp, answer = _batch()
    loss, _ = grpo_loss(logp, old, ref, adv, resp, answer, answer_weight=0.0, **options)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.all(grad[answer] == 0)
    kept = (
        torch.ones(4, dtype=torch.bool) if "sample_mask" not in options else options["sample_mask"]
    )
    reasoning = resp & ~answer
    assert torch.all(grad[reasoning & kept[:, None]] != 0)
    assert torch.all(grad[~kept] == 0)  # a dropped rollout: no gradient at all


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("w", [0.0, 1.0])
def test_dropped_rollouts_leave_numerator_and_denominator(agg, w):
    """With `sample_mask` the loss (and gradient) is the loss of the kept rollouts alone, as if
    the dropped ones had not been sampled; the token metrics still cover every rollout."""
    logp, old, ref, adv, resp, answer = _batch(1)
    keep = torch.tensor([True, False, True, False])
    kw = {"answer_weight": w, "agg": agg, "clip_high": 0.28}
    loss, metrics = grpo_loss(logp, old, ref, adv, resp, answer, sample_mask=keep, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    sub = logp.detach()[keep].requires_grad_(True)
    want, want_metrics = grpo_loss(
        sub, old[keep], ref[keep], adv[keep], resp[keep], answer[keep], **kw
    )
    (want_grad,) = torch.autograd.grad(want, sub)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad[keep], want_grad)
    assert metrics["kl/reasoning_count"] == float((resp & ~answer).sum())
    assert want_metrics["kl/reasoning_count"] < metrics["kl/reasoning_count"]


def test_defaults_are_bit_identical_to_the_symmetric_loss():
    logp, old, ref, adv, resp, answer = _batch(2)
    a, _ = grpo_loss(logp, old, ref, adv, resp, answer, clip=0.25)
    b, _ = grpo_loss(
        logp,
        old,
        ref,
        adv,
        resp,
        answer,
        clip=0.25,
        clip_low=None,
        clip_high=None,
        sample_mask=None,
    )
    assert a.item() == b.item()


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.clip_low=0", "algorithm.clip_low"),
        ("algorithm.clip_low=1.5", "algorithm.clip_low"),
        ("algorithm.clip_high=-0.1", "algorithm.clip_high"),
        ("algorithm.overlong_buffer=0", "algorithm.overlong_buffer"),
        ("algorithm.overlong_penalty_factor=-1", "algorithm.overlong_penalty_factor"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        check_values(compose([override]))


def test_switches_must_be_booleans_and_the_factor_needs_a_buffer():
    with pytest.raises(ValueError, match=r"algorithm\.dynamic_sampling"):
        validate_algorithm(OmegaConf.create({**_defaults(), "dynamic_sampling": 3}), "algorithm")
    with pytest.raises(ValueError, match="overlong_buffer is null"):
        validate_algorithm(_algo(overlong_penalty_factor=0.5), "algorithm")
    validate_algorithm(_algo(dynamic_sampling=True, overlong_filter=False), "algorithm")
    old = {k: v for k, v in _defaults().items() if k not in ("dynamic_sampling", "clip_low")}
    validate_algorithm(OmegaConf.create(old), "algorithm")  # a config from before the keys


def test_new_keys_default_to_null():
    algo = compose([]).algorithm
    for key in ("clip_low", "clip_high", "dynamic_sampling", "overlong_filter", "overlong_buffer"):
        assert algo[key] is None, key
    assert algo.overlong_penalty_factor is None


def _defaults() -> dict:
    return OmegaConf.to_container(OmegaConf.structured(AlgorithmConfig()))
