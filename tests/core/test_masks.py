"""Study v4's generic token masks (`omgrpo.core.masks`): hand-computed cases, the quantile and
the random draw against plain references, the draw's determinism and its independence from the
sampling RNG, the metrics, and `grpo_loss` with a token mask (weight 0 in the PG and KL terms)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omgrpo.core.losses import grpo_loss
from omgrpo.core.masks import (
    mask_metrics,
    mask_spans,
    masked_tokens,
    masks_on,
    quantile,
    random_token_mask,
    rollout_seed,
    token_mask,
    top_entropy_mask,
)


def algo(**kw):
    base = {"answer_span": "boxed", "top_entropy_quantile": None, "random_mask": None}
    return SimpleNamespace(**{**base, "answer_weight": 1.0, "format_only": False, **kw})


# ----------------------------------------------------------------------------------------------
# Which masks are on, and the spans they read
# ----------------------------------------------------------------------------------------------


def test_masks_on_and_the_spans_they_read():
    assert not masks_on(algo()) and mask_spans(algo()) == ()
    assert not masks_on(algo(answer_span="closing"))
    assert masks_on(algo(answer_span="closing_only"))
    assert mask_spans(algo(answer_span="closing_only")) == ("boxed",)
    assert mask_spans(algo(top_entropy_quantile=0.2)) == ("boxed",)
    assert mask_spans(algo(random_mask="boxed")) == ("boxed",)
    assert mask_spans(algo(random_mask="closing")) == ("boxed", "closing")
    # a config object without the keys (written before they existed): off
    assert not masks_on(SimpleNamespace(answer_span="boxed"))


# ----------------------------------------------------------------------------------------------
# The step's entropy quantile (TRL's top_entropy_quantile)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 37, 1000])
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 0.999, 1.0])
def test_quantile_is_numpys_and_torchs_linear_quantile(n, q):
    values = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    ours = float(quantile(values, q))
    assert ours == float(torch.quantile(values, q))
    assert ours == pytest.approx(float(np.quantile(values.numpy(), q)), rel=1e-15, abs=0)
    assert math.isnan(float(quantile(torch.zeros(0), 0.5)))


def test_top_entropy_mask_hand_computed():
    # response entropies 0.1, 0.5, 0.9 | 0.3, 0.7 (5 tokens); padding 100 never counts
    entropy = torch.tensor([[0.1, 0.5, 0.9, 100.0], [0.3, 0.7, 100.0, 100.0]])
    resp = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # q = 0.4: the 0.6 quantile of (0.1, 0.3, 0.5, 0.7, 0.9) is at rank 2.4: 0.5 + 0.4 * 0.2
    # = 0.58, so 0.7 and 0.9 are trained, the other three masked
    masked = top_entropy_mask(entropy, resp, 0.4)
    assert masked.tolist() == [[True, True, False, False], [True, False, False, False]]
    # q = 0.2: rank 3.2, 0.74: only the top token (20% of 5) is trained
    masked = top_entropy_mask(entropy, resp, 0.2)
    assert masked.tolist() == [[True, True, False, False], [True, True, False, False]]
    # q = 1: the minimum: nothing masked; ties at the threshold are trained ("at or above")
    assert not top_entropy_mask(entropy, resp, 1.0).any()
    assert not top_entropy_mask(torch.ones(2, 4), resp, 0.2).any()
    # q = 0.5 on 0.1..0.9: rank 2, exactly 0.5: 0.5, 0.7, 0.9 trained
    masked = top_entropy_mask(entropy, resp, 0.5)
    assert masked.tolist() == [[True, False, False, False], [True, False, False, False]]
    assert not top_entropy_mask(entropy, torch.zeros_like(resp), 0.2).any()  # no response


@pytest.mark.parametrize("q", [0.05, 0.2, 0.5, 0.9])
def test_top_entropy_mask_is_trls_rule_over_the_whole_step(q):
    """TRL's `get_high_entropy_mask`, written plainly: the (1 - q) quantile of the entropies
    of every response token of the batch, tokens at or above it kept (float64 here)."""
    g = torch.Generator().manual_seed(3)
    entropy = torch.rand(16, 40, generator=g, dtype=torch.float64) * 4
    lengths = torch.randint(0, 41, (16,), generator=g)
    resp = torch.arange(40)[None, :] < lengths[:, None]
    threshold = torch.quantile(entropy[resp], 1 - q)
    trl_kept = (entropy * resp >= threshold) & resp
    masked = top_entropy_mask(entropy, resp, q)
    assert torch.equal(masked, resp & ~trl_kept)
    kept = int((resp & ~masked).sum())
    assert abs(kept - q * int(resp.sum())) <= 1  # the top q of the step's tokens
    # one step-wide threshold, not one per row: rows are kept unevenly
    per_row = (resp & ~masked).sum(-1).float() / resp.sum(-1).clamp(min=1)
    assert per_row.max() - per_row.min() > 0.1


# ----------------------------------------------------------------------------------------------
# The random mask: uniform, seeded by (seed, step, rollout), never the sampling RNG
# ----------------------------------------------------------------------------------------------


def test_random_token_mask_draws_counts_of_response_tokens():
    resp = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    masked = random_token_mask(resp, torch.tensor([2, 5, 0]), seed=0, step=1)
    assert masked.sum(-1).tolist() == [2, 2, 0]  # at most the row's response tokens
    assert not (masked & ~resp.bool()).any()


def test_random_token_mask_is_a_seeded_permutation_of_the_response_positions():
    """Plain reference: each row's own generator, seeded from (seed, step, rollout index),
    permutes the row's response positions; the first `count` are masked."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 30, (12,), generator=g)
    resp = torch.arange(30)[None, :] < lengths[:, None]
    counts = torch.randint(0, 6, (12,), generator=g)
    rollouts = list(range(100, 112))
    masked = random_token_mask(resp, counts, seed=7, step=3, rollouts=rollouts)
    for i in range(12):
        gen = torch.Generator().manual_seed(rollout_seed(7, 3, rollouts[i]))
        positions = resp[i].nonzero().squeeze(1)
        chosen = positions[torch.randperm(len(positions), generator=gen)[: int(counts[i])]]
        expected = torch.zeros(30, dtype=torch.bool)
        expected[chosen] = True
        assert torch.equal(masked[i], expected), i


def test_random_token_mask_is_deterministic_and_leaves_the_sampling_rng_alone():
    resp = torch.ones(8, 20, dtype=torch.bool)
    counts = torch.full((8,), 3)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = random_token_mask(resp, counts, seed=13, step=5)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG neither read nor moved
    torch.manual_seed(123)  # whatever the sampling RNG's state
    torch.rand(1000)
    assert torch.equal(random_token_mask(resp, counts, seed=13, step=5), first)
    # another step, seed or rollout draws anew; rows differ from each other
    assert not torch.equal(random_token_mask(resp, counts, seed=13, step=6), first)
    assert not torch.equal(random_token_mask(resp, counts, seed=14, step=5), first)
    shifted = random_token_mask(resp, counts, seed=13, step=5, rollouts=range(1, 9))
    assert torch.equal(shifted[:-1], first[1:])  # a row's draw is its rollout index's
    assert len({tuple(r.nonzero().flatten().tolist()) for r in first}) > 1
    assert rollout_seed(13, 5, 0) == rollout_seed(13, 5, 0) != rollout_seed(13, 5, 1)
    assert 0 <= rollout_seed(13, 5, 0) < 2**63


def test_random_token_mask_is_uniform_over_positions():
    """Over many steps each of a rollout's 10 response tokens is drawn as often (3 of 10)."""
    resp = torch.ones(1, 10, dtype=torch.bool)
    hits = sum(random_token_mask(resp, [3], seed=0, step=s)[0].double() for s in range(4000))
    # binomial(4000, 0.3): sd 29; every position within 5 sd of 1200
    assert (hits - 1200).abs().max() < 145


# ----------------------------------------------------------------------------------------------
# Combined, and the metrics
# ----------------------------------------------------------------------------------------------


def test_token_mask_combines_the_options():
    resp = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    entropy = torch.tensor([[0.1, 0.2, 3.0, 0.3], [2.0, 0.4, 0.5, 9.0]])
    boxed = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    spans = {"boxed": boxed}
    assert token_mask(algo(), resp, seed=0, step=1) is None
    top = token_mask(algo(top_entropy_quantile=0.3), resp, seed=0, step=1, entropy=entropy)
    assert torch.equal(top, top_entropy_mask(entropy, resp, 0.3))
    rnd = token_mask(algo(random_mask="boxed"), resp, seed=0, step=1, spans=spans)
    assert rnd.sum(-1).tolist() == [1, 2]  # as many as each rollout's boxed span holds
    both = token_mask(
        algo(top_entropy_quantile=0.3, random_mask="boxed"),
        resp,
        seed=0,
        step=1,
        entropy=entropy,
        spans=spans,
    )
    assert torch.equal(both, top | rnd)
    with pytest.raises(ValueError, match="needs the step's per-token entropy"):
        token_mask(algo(top_entropy_quantile=0.3), resp, seed=0, step=1)
    with pytest.raises(ValueError, match="needs the 'closing' span"):
        token_mask(algo(random_mask="closing"), resp, seed=0, step=1, spans=spans)


def test_masked_tokens_and_mask_metrics_hand_computed():
    resp = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    answer = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    boxed = torch.tensor([[0, 0, 1, 0, 0], [0, 1, 0, 0, 1]], dtype=torch.bool)  # pad: ignored
    generic = torch.tensor([[1, 0, 0, 0, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    # w = 1: only the generic mask's response tokens
    masked = masked_tokens(resp, answer, 1.0, False, generic)
    assert masked.tolist() == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0]]
    # w = 0 (closing_only arm): the answer span's tokens too; format-only: not
    assert masked_tokens(resp, answer, 0.0, False, None).tolist() == answer.tolist()
    assert not masked_tokens(resp, answer, 0.0, True, None).any()
    metrics = mask_metrics(masked, resp, boxed)
    assert metrics == {"mask/frac": pytest.approx(2 / 7), "mask/answer_overlap": 0.5}
    # no boxed token in the step: nan overlap
    assert math.isnan(mask_metrics(masked, resp, torch.zeros_like(boxed))["mask/answer_overlap"])


# ----------------------------------------------------------------------------------------------
# The loss: masked tokens get weight 0 in both terms, the denominator unchanged
# ----------------------------------------------------------------------------------------------


def _loss_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 6
    logp = (-torch.rand(B, T, generator=g) - 0.1).requires_grad_(True)
    old = -torch.rand(B, T, generator=g) - 0.1
    ref = -torch.rand(B, T, generator=g) - 0.1
    adv = torch.tensor([1.0, -0.5, 0.75])
    resp = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0]], dtype=torch.bool)
    answer = torch.zeros(B, T, dtype=torch.bool)
    answer[0, 3:5] = True
    answer[2, 2] = True
    return logp, old, ref, adv, resp, answer


@pytest.mark.parametrize("w", [0.0, 1.0])
def test_grpo_loss_gives_masked_tokens_no_gradient_from_either_term(w):
    logp, old, ref, adv, resp, answer = _loss_inputs()
    masked = torch.zeros_like(resp)
    masked[0, 1] = masked[1, 0] = masked[2, 4] = True
    kwargs = {"answer_weight": w, "kl_coef": 0.5}
    loss, _ = grpo_loss(logp, old, ref, adv, resp, answer, **kwargs, token_mask=masked)
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad[masked] == 0).all()
    # every other token's gradient is the unmasked loss's: the denominator is unchanged
    full, _ = grpo_loss(logp, old, ref, adv, resp, answer, **kwargs)
    (full_grad,) = torch.autograd.grad(full, logp)
    keep = resp & ~masked
    assert torch.equal(grad[keep], full_grad[keep])
    assert (full_grad[masked] != 0).all()
    # no mask, or an empty one: the loss as before, bit for bit
    none, _ = grpo_loss(logp, old, ref, adv, resp, answer, **kwargs, token_mask=None)
    empty, _ = grpo_loss(
        logp, old, ref, adv, resp, answer, **kwargs, token_mask=torch.zeros_like(masked)
    )
    assert torch.equal(none, full) and torch.equal(empty, full)


def test_grpo_loss_token_mask_by_hand():
    """Ratio 1 (old = current), token-mean: loss = sum over kept tokens of (-A_i * m_t + beta *
    u_t * k3_t) / all response tokens."""
    logp, _, ref, adv, resp, answer = _loss_inputs(1)
    masked = torch.zeros_like(resp)
    masked[0, 0] = masked[2, 2] = True  # (2, 2) is an answer token as well
    beta = 0.1
    loss, metrics = grpo_loss(
        logp,
        logp.detach(),
        ref,
        adv,
        resp,
        answer,
        answer_weight=0.5,
        kl_coef=beta,
        token_mask=masked,
    )
    k3 = torch.exp(ref - logp.detach()) - (ref - logp.detach()) - 1
    m = torch.where(answer, 0.5, 1.0) * ~masked
    n = resp.sum()
    pg = (-(adv[:, None] * m) * resp).sum() / n
    kl = (k3 * m * resp).sum() / n
    assert metrics["loss/pg"] == pytest.approx(float(pg), rel=1e-6)
    assert metrics["loss/kl"] == pytest.approx(float(kl), rel=1e-6)
    assert loss.item() == pytest.approx(float(pg + beta * kl), rel=1e-6)


# ----------------------------------------------------------------------------------------------
# The options, checked where the config is checked
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_options_default_off_and_bad_values_are_refused_naming_the_key():
    from omgrpo.config import check_values, compose, validate_algorithm
    from omgrpo.errors import InputError

    cfg = compose([])
    assert cfg.algorithm.top_entropy_quantile is None and cfg.algorithm.random_mask is None
    for ok in ("algorithm.top_entropy_quantile=1", "algorithm.top_entropy_quantile=0.2"):
        cfg = compose([ok, "algorithm.random_mask=closing_only"])
        validate_algorithm(cfg.algorithm, "algorithm")
        check_values(cfg)
    for bad in ("0", "-0.1", "1.5"):
        cfg = compose([f"algorithm.top_entropy_quantile={bad}"])
        with pytest.raises(
            ValueError, match=r"algorithm\.top_entropy_quantile must be in \(0, 1\]"
        ):
            validate_algorithm(cfg.algorithm, "algorithm")
        with pytest.raises(InputError, match=r"algorithm\.top_entropy_quantile"):
            check_values(cfg)
    cfg = compose(["algorithm.random_mask=last"])
    with pytest.raises(ValueError, match=r"unknown algorithm\.random_mask 'last'; valid: boxed"):
        validate_algorithm(cfg.algorithm, "algorithm")
