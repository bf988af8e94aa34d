"""Tests for omgrpo.core.losses: hand-computed values, exact OMU gradient masking, invariances."""

from __future__ import annotations

import math

import pytest
import torch

from omgrpo.core.losses import (
    AGG_MODES,
    agg_loss,
    group_advantages,
    grpo_loss,
    kl_k3,
    masked_mean,
    token_logprobs_and_entropy,
    token_means,
    token_roles,
    token_stats,
    token_weights,
)

LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------------
# group_advantages
# --------------------------------------------------------------------------------------------
def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503
    # -> A = +-0.5 / 0.5773503 = +-0.8660254 (eps = 0); group 1: all equal -> 0.
    adv = group_advantages(rewards, ids, eps=0.0)
    a = 0.8660254038
    expected = torch.tensor([a, -a, a, -a, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, atol=1e-9, rtol=0)
    assert adv[4] == 0 and adv[5] == 0
    # default eps = 1e-6: 0.5 / (0.5773503 + 1e-6) = 0.8660239
    adv_eps = group_advantages(rewards, ids)
    assert adv_eps[0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-6), abs=1e-12)


def test_group_advantages_singleton_and_noncontiguous_ids():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 4.0])
    ids = torch.tensor([7, 3, 7, 3, 9, 3])
    # group 7: [1, 3] mean 2, var (1 + 1) / 1 = 2, std 1.4142136 -> -0.7071068, +0.7071068
    # group 3: [2, 6, 4] mean 4, var (4 + 4 + 0) / 2 = 4, std 2 -> -1, +1, 0
    # group 9: singleton -> 0
    adv = group_advantages(rewards, ids, eps=0.0)
    expected = torch.tensor([-0.70710678, -1.0, 0.70710678, 1.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    assert adv[4].item() == 0.0
    assert adv.dtype == torch.float32


def test_group_advantages_dtype_and_degenerate_float32():
    for dtype in (torch.float32, torch.float64):
        adv = group_advantages(torch.tensor([0.0, 1.0], dtype=dtype), torch.tensor([0, 0]))
        assert adv.dtype == dtype
    # equal float32 rewards whose mean is not exactly representable still give exactly 0
    rewards = torch.full((3,), 0.1, dtype=torch.float32)
    adv = group_advantages(rewards, torch.zeros(3, dtype=torch.long))
    assert torch.equal(adv, torch.zeros(3))
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


# --------------------------------------------------------------------------------------------
# kl_k3, agg_loss, helpers
# --------------------------------------------------------------------------------------------
def test_kl_k3_hand_computed():
    logp = torch.zeros(4, dtype=torch.float64)
    ref = torch.tensor([LN2, -1.0, 30.0, -30.0], dtype=torch.float64)
    k3 = kl_k3(logp, ref)
    # ln2: 2 - ln2 - 1 = 0.30685282; -1: e^-1 + 1 - 1 = 0.36787944
    # 30 -> kl clamped to 20 -> huge -> clamp 10; -30 -> kl = -20 -> e^-20 + 19 -> clamp 10
    expected = torch.tensor([0.3068528194, 0.3678794412, 10.0, 10.0], dtype=torch.float64)
    torch.testing.assert_close(k3, expected, atol=1e-9, rtol=0)
    assert torch.equal(kl_k3(logp, logp), torch.zeros(4, dtype=torch.float64))


def test_agg_loss_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)  # (1+2+4)/3
    assert agg_loss(loss, mask, "token-mean", num_tokens=7).item() == pytest.approx(1.0)
    assert agg_loss(loss, mask, "token-mean", torch.tensor(14.0)).item() == pytest.approx(0.5)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)  # (3+4)/2
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)  # (1.5+4)/2
    # empty sequences are excluded from seq means; empty masks give 0
    mask2 = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert agg_loss(loss, mask2, "token-mean").item() == pytest.approx(1.5)
    assert agg_loss(loss, mask2, "seq-mean-token-sum").item() == pytest.approx(3.0)
    assert agg_loss(loss, mask2, "seq-mean-token-mean").item() == pytest.approx(1.5)
    for mode in AGG_MODES:
        assert agg_loss(loss, torch.zeros_like(mask), mode).item() == 0.0
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_loss(loss, mask, "seq-sum")


def test_masked_mean_and_token_weights():
    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    mask = torch.tensor([[True, False], [True, True]])
    assert masked_mean(x, mask).item() == pytest.approx(3.0)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    w = token_weights(torch.tensor([[0, 1, 1], [1, 0, 0]], dtype=torch.bool), 0.25)
    assert torch.equal(w, torch.tensor([[1.0, 0.25, 0.25], [0.25, 1.0, 1.0]]))
    assert token_weights(mask, 0.3, dtype=torch.float64).dtype == torch.float64


def test_token_logprobs_and_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    lp, ent = token_logprobs_and_entropy(logits, tokens)
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(lp, dist.log_prob(tokens))
    torch.testing.assert_close(ent, dist.entropy())
    assert not ent.requires_grad
    lp_bf, ent_bf = token_logprobs_and_entropy(logits.bfloat16(), tokens)
    assert lp_bf.dtype == torch.float32 and ent_bf.dtype == torch.float32
    masked = logits.clone()
    masked[..., 0] = float("-inf")  # zero-probability vocabulary entries
    _, ent_m = token_logprobs_and_entropy(masked, tokens.clamp(min=1))
    assert torch.isfinite(ent_m).all()


# --------------------------------------------------------------------------------------------
# grpo_loss: hand-computed
# --------------------------------------------------------------------------------------------
def _hand_case():
    logp = torch.full((2, 3), math.log(0.5), dtype=torch.float64)
    ref = logp.clone()
    ref[0, 0] += LN2  # reasoning token, k3 = 1 - ln2
    ref[0, 2] += LN2  # answer token, k3 = 1 - ln2
    resp = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    answer = torch.tensor([[0, 0, 1], [0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    return logp, ref, resp, answer, adv


@pytest.mark.parametrize(
    ("w", "pg", "kl_tokens"),
    [
        # ratio = 1 so pg_t = -a_t; 5 response tokens.
        # w=0: (-1 - 1 + 0 + 0.5 + 0) / 5 = -0.3; weighted k3 sum = (1 - ln2) * 1
        (0.0, -0.3, 1.0),
        # w=0.5: (-1 - 1 - 0.5 + 0.5 + 0.25) / 5 = -0.35; k3 sum = (1 - ln2) * 1.5
        (0.5, -0.35, 1.5),
        # w=1: (-1 - 1 - 1 + 0.5 + 0.5) / 5 = -0.4; k3 sum = (1 - ln2) * 2
        (1.0, -0.4, 2.0),
    ],
)
def test_grpo_loss_hand_computed(w, pg, kl_tokens):
    logp, ref, resp, answer, adv = _hand_case()
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    loss, stats = grpo_loss(
        logp, logp, ref, adv, resp, answer, answer_weight=w, kl_coef=0.1, entropy=entropy
    )
    m = token_means(stats)
    kl = kl_tokens * (1 - LN2) / 5
    assert loss.item() == pytest.approx(pg + 0.1 * kl, abs=1e-12)
    assert m["loss/pg"] == pytest.approx(pg, abs=1e-12)
    assert m["loss/kl"] == pytest.approx(kl, abs=1e-12)
    assert m["loss/total"] == pytest.approx(loss.item(), abs=1e-15)
    assert m["clip/frac"] == 0.0
    assert m["ratio/mean"] == pytest.approx(1.0)
    assert m["answer/frac"] == pytest.approx(0.4)
    assert m["kl/answer"] == pytest.approx((1 - LN2) / 2)  # answer k3 = [1 - ln2, 0]
    assert m["kl/reasoning"] == pytest.approx((1 - LN2) / 3)  # reasoning k3 = [1 - ln2, 0, 0]
    assert m["entropy/answer"] == pytest.approx(4.0)  # (3 + 5) / 2
    assert m["entropy/reasoning"] == pytest.approx(7 / 3)  # (1 + 2 + 4) / 3
    assert all(isinstance(v, float) for v in m.values())


def test_grpo_loss_clipping_hand_computed():
    # row 0: A = +1, ratios 1.5 (clipped to 1.2) and 0.9; row 1: A = -1, ratios 0.5 (clipped
    # to 0.8) and 1.1. pg = [-1.2, -0.9, 0.8, 1.1] -> mean -0.05; clip active on 2 of 4.
    logp = torch.log(torch.tensor([[1.5, 0.9], [0.5, 1.1]], dtype=torch.float64))
    old = torch.zeros_like(logp)
    resp = torch.ones(2, 2, dtype=torch.bool)
    loss, stats = grpo_loss(
        logp, old, None, torch.tensor([1.0, -1.0]), resp, torch.zeros_like(resp), kl_coef=0.1
    )
    m = token_means(stats)
    assert loss.item() == pytest.approx(-0.05, abs=1e-12)
    assert m["clip/frac"] == pytest.approx(0.5)
    assert m["ratio/mean"] == pytest.approx(1.0)
    assert m["loss/kl"] == 0.0
    assert "kl/answer" not in m and "entropy/answer" not in m


def test_grpo_loss_no_answer_tokens_reports_nan():
    """A role without tokens has no mean (nan), as in the verl backend; its count is 0, so
    adding it to other micro-batches' stats changes nothing."""
    logp, ref, resp, _, adv = _hand_case()
    _, stats = grpo_loss(logp, logp, ref, adv, resp, torch.zeros_like(resp), entropy=logp)
    assert stats["kl/answer_count"] == 0.0 and stats["kl/answer_sum"] == 0.0
    m = token_means(stats)
    assert math.isnan(m["kl/answer"]) and math.isnan(m["entropy/answer"])
    assert m["answer/frac"] == 0.0 and m["kl/reasoning"] > 0


def test_grpo_loss_shape_errors():
    logp, ref, resp, answer, adv = _hand_case()
    with pytest.raises(ValueError):
        grpo_loss(logp, logp, ref, adv[:1], resp, answer)
    with pytest.raises(ValueError):
        grpo_loss(logp, logp, ref[:, :2], adv, resp, answer)


# --------------------------------------------------------------------------------------------
# grpo_loss: gradients
# --------------------------------------------------------------------------------------------
B, T, V = 4, 6, 7
LENGTHS = (6, 5, 4, 6)


def _batch(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    resp = torch.zeros(B, T, dtype=torch.bool)
    answer = torch.zeros(B, T, dtype=torch.bool)
    for i, length in enumerate(LENGTHS):
        resp[i, :length] = True
        if i != 3:  # row 3 has no answer span (e.g. unparsable output)
            answer[i, length - 3 : length - 1] = True  # "\boxed{" .. ANSWER .. "}"
    with torch.no_grad():
        lp, _ = token_logprobs_and_entropy(logits, tokens)
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)  # clip engages somewhere
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, generator=g, dtype=dtype)
    fmt = torch.randn(B, generator=g, dtype=dtype)
    return dict(
        logits=logits, tokens=tokens, resp=resp, answer=answer, old=old, ref=ref, adv=adv, fmt=fmt
    )


def _run(b: dict, rows=slice(None), adv=None, answer_mask=None, **kw):
    """Loss and d loss / d logits for the given rows (a fresh leaf each call)."""
    logits = b["logits"][rows].clone().requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(logits, b["tokens"][rows])
    adv = b["adv"] if adv is None else adv
    answer = b["answer"] if answer_mask is None else answer_mask
    loss, metrics = grpo_loss(
        lp,
        b["old"][rows],
        b["ref"][rows],
        adv[rows],
        b["resp"][rows],
        answer[rows],
        entropy=ent,
        **kw,
    )
    loss.backward()
    return loss.detach(), logits.grad, token_means(metrics)


def _reference_loss(lp, old, ref, resp, tok_adv, kl_w, clip, kl_coef):
    """Plain GRPO as an explicit loop over tokens: token-mean of clipped PG + beta * k3."""
    pg_sum = lp.new_zeros(())
    kl_sum = lp.new_zeros(())
    n = 0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not resp[i, t]:
                continue
            n += 1
            a = float(tok_adv(i, t))
            ratio = torch.exp(lp[i, t] - old[i, t])
            pg_sum = pg_sum - torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
            d = ref[i, t] - lp[i, t]
            kl_sum = kl_sum + kl_w(i, t) * (torch.exp(d) - d - 1)
    return pg_sum / n + kl_coef * kl_sum / n


def _run_reference(b: dict, tok_adv, kl_w, clip=0.2, kl_coef=0.05):
    logits = b["logits"].clone().requires_grad_(True)
    lp = torch.log_softmax(logits, -1).gather(-1, b["tokens"].unsqueeze(-1)).squeeze(-1)
    loss = _reference_loss(lp, b["old"], b["ref"], b["resp"], tok_adv, kl_w, clip, kl_coef)
    loss.backward()
    return loss.detach(), logits.grad


def _clip_dead(b: dict, adv: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """(B, T) bool: tokens whose PG gradient is zero because the clip is active."""
    with torch.no_grad():
        lp, _ = token_logprobs_and_entropy(b["logits"], b["tokens"])
        ratio = torch.exp(lp - b["old"])
    a = adv[:, None]
    return ((a > 0) & (ratio > 1 + clip)) | ((a < 0) & (ratio < 1 - clip))


def _nonzero_rows(grad: torch.Tensor, mask: torch.Tensor) -> bool:
    return bool((grad[mask].abs().sum(-1) > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("config", ["pg+kl", "pg-only", "kl-only"])
def test_w0_answer_gradient_exactly_zero(dtype, agg, config):
    b = _batch(1, dtype)
    adv = torch.zeros(B, dtype=dtype) if config == "kl-only" else b["adv"]
    kl_coef = 0.0 if config == "pg-only" else 0.05
    _, grad, m = _run(b, adv=adv, answer_weight=0.0, kl_coef=kl_coef, agg=agg)
    answer, resp = b["answer"], b["resp"]
    assert torch.equal(grad[answer], torch.zeros_like(grad[answer]))
    assert torch.equal(grad[~resp], torch.zeros_like(grad[~resp]))
    live = resp & ~answer
    if config == "pg-only":
        dead = _clip_dead(b, adv)
        assert m["clip/frac"] > 0 and dead[live].any()  # the clip engages somewhere
        live = live & ~dead
    assert _nonzero_rows(grad, live)
    # sanity: with w = 1 the same answer tokens do get gradient
    _, grad1, _ = _run(b, adv=adv, answer_weight=1.0, kl_coef=kl_coef, agg=agg)
    assert grad1[answer].abs().sum() > 0


def test_w1_matches_plain_reference_loop():
    b = _batch(2)
    loss, grad, m = _run(b, answer_weight=1.0, kl_coef=0.05)
    ref_loss, ref_grad = _run_reference(
        b, tok_adv=lambda i, t: b["adv"][i], kl_w=lambda i, t: 1.0, kl_coef=0.05
    )
    assert m["clip/frac"] > 0
    torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
    # w = 1 is bitwise the unmasked loss
    loss_nomask, grad_nomask, _ = _run(
        b, answer_mask=torch.zeros_like(b["answer"]), answer_weight=0.0, kl_coef=0.05
    )
    assert torch.equal(loss, loss_nomask) and torch.equal(grad, grad_nomask)


@pytest.mark.parametrize("w", [0.0, 0.5])
def test_weighted_matches_reference_loop(w):
    b = _batch(3)
    ans = b["answer"]
    loss, grad, _ = _run(b, answer_weight=w, kl_coef=0.05)
    ref_loss, ref_grad = _run_reference(
        b,
        tok_adv=lambda i, t: (w if ans[i, t] else 1.0) * b["adv"][i],
        kl_w=lambda i, t: w if ans[i, t] else 1.0,
    )
    torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


def test_reasoning_gradients_invariant_to_w():
    b = _batch(4)
    reasoning = b["resp"] & ~b["answer"]
    grads = {w: _run(b, answer_weight=w, kl_coef=0.05)[1] for w in (0.0, 0.5, 1.0)}
    assert torch.equal(grads[0.0][reasoning], grads[0.5][reasoning])
    assert torch.equal(grads[0.0][reasoning], grads[1.0][reasoning])
    assert not torch.equal(grads[0.5][b["answer"]], grads[1.0][b["answer"]])


@pytest.mark.parametrize("w", [0.0, 0.5, 1.0])
def test_micro_batching_with_num_tokens_matches_full_batch(w):
    b = _batch(5)
    total = int(b["resp"].sum())
    loss_full, grad_full, _ = _run(b, answer_weight=w, kl_coef=0.05)
    parts = [
        _run(b, rows=slice(s, s + 2), answer_weight=w, kl_coef=0.05, num_tokens=total)
        for s in (0, 2)
    ]
    torch.testing.assert_close(parts[0][0] + parts[1][0], loss_full, atol=1e-12, rtol=0)
    grad_micro = torch.cat([parts[0][1], parts[1][1]])
    torch.testing.assert_close(grad_micro, grad_full, atol=1e-12, rtol=0)
    # without the global count each micro-batch renormalises and the sum is off (~2x)
    naive = torch.cat(
        [_run(b, rows=slice(s, s + 2), answer_weight=w, kl_coef=0.05)[1] for s in (0, 2)]
    )
    assert not torch.allclose(naive, grad_full)


@pytest.mark.parametrize("w", [0.0, 0.5])
def test_format_only_matches_reference_loop(w):
    b = _batch(6)
    ans, fmt = b["answer"], b["fmt"]
    loss, grad, _ = _run(b, answer_weight=w, format_advantages=fmt, kl_coef=0.05)
    ref_loss, ref_grad = _run_reference(
        b,
        tok_adv=lambda i, t: fmt[i] if ans[i, t] else b["adv"][i],
        kl_w=lambda i, t: w if ans[i, t] else 1.0,
    )
    torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
    assert grad[ans].abs().sum() > 0  # answer tokens learn from the format advantage
    # reasoning tokens are untouched by the substitution
    _, grad_plain, _ = _run(b, answer_weight=w, kl_coef=0.05)
    reasoning = b["resp"] & ~ans
    assert torch.equal(grad[reasoning], grad_plain[reasoning])
    # with w = 0 and zero format advantages, answer tokens get no gradient at all
    _, grad_zero, _ = _run(b, answer_weight=0.0, format_advantages=torch.zeros_like(fmt))
    assert torch.equal(grad_zero[ans], torch.zeros_like(grad_zero[ans]))


def test_no_reference_or_zero_kl_coef():
    b = _batch(7)
    loss_a, grad_a, m_a = _run(b, answer_weight=0.0, kl_coef=0.0)
    logits = b["logits"].clone().requires_grad_(True)
    lp, _ = token_logprobs_and_entropy(logits, b["tokens"])
    loss_b, m_b = grpo_loss(lp, b["old"], None, b["adv"], b["resp"], b["answer"])
    loss_b.backward()
    assert torch.equal(loss_a, loss_b.detach()) and torch.equal(grad_a, logits.grad)
    assert m_b["loss/kl"] == 0.0 and "kl/answer_sum" not in m_b and "kl/answer" in m_a


@pytest.mark.parametrize(("w", "kl_w"), [(0.0, 1.0), (0.0, 0.5), (1.0, 0.0)])
def test_separate_answer_kl_weight_matches_reference_loop(w, kl_w):
    """`answer_kl_weight` weights only the KL term on answer tokens (PG keeps w)."""
    b = _batch(5)
    ans = b["answer"]
    loss, grad, _ = _run(b, answer_weight=w, answer_kl_weight=kl_w, kl_coef=0.05)
    ref_loss, ref_grad = _run_reference(
        b,
        tok_adv=lambda i, t: (w if ans[i, t] else 1.0) * b["adv"][i],
        kl_w=lambda i, t: kl_w if ans[i, t] else 1.0,
    )
    torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


def test_pg_masked_kl_anchored_answer_gradient_is_the_kl_alone():
    """w = 0 with the KL kept on answers: answer-token gradient comes from the KL term only
    (zero without a reference), so it pulls answers toward the reference and nowhere else."""
    b = _batch(6)
    ans = b["answer"]
    _, grad, _ = _run(b, answer_weight=0.0, answer_kl_weight=1.0, kl_coef=0.05)
    assert grad[ans].abs().sum() > 0
    # answer-token gradient is identical with or without advantages: the PG term contributes 0
    _, grad_kl_only, _ = _run(
        b,
        adv=torch.zeros(B, dtype=b["adv"].dtype),
        answer_weight=0.0,
        answer_kl_weight=1.0,
        kl_coef=0.05,
    )
    torch.testing.assert_close(grad[ans], grad_kl_only[ans], atol=1e-12, rtol=0)
    # None keeps today's objective bit for bit
    loss_a, grad_a, _ = _run(b, answer_weight=0.0, kl_coef=0.05)
    loss_b, grad_b, _ = _run(b, answer_weight=0.0, answer_kl_weight=None, kl_coef=0.05)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)


# --------------------------------------------------------------------------------------------
# token_stats / token_means: one definition of the per-token metrics
# --------------------------------------------------------------------------------------------
def test_token_stats_add_up_over_micro_batches_to_the_token_mean():
    """Two micro-batches of 3 and 1 answer tokens: the step's `kl/answer` is the mean of all
    4 tokens (2.5), not the mean of the two micro-batch means (3.0); padding values (inf)
    outside the masks never leak in."""
    kl = torch.tensor([[1.0, 2.0, 3.0, float("inf")], [4.0, 5.0, 0.0, 0.0]])
    resp = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    answer = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    total: dict[str, float] = {}
    for row in range(2):
        roles = token_roles(resp[row : row + 1], answer[row : row + 1])
        for key, value in token_stats({"kl": kl[row : row + 1]}, roles).items():
            total[key] = total.get(key, 0.0) + value
    m = token_means(total)
    assert m["kl/answer"] == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert m["kl/reasoning"] == pytest.approx((5 + 0) / 2)
    assert m["answer/frac"] == pytest.approx(4 / 6)
    assert not any(k.endswith(("_sum", "_count")) for k in m)


def test_token_means_keeps_other_keys_and_strips_the_prefix():
    metrics = {"actor/kl/answer_sum": 3.0, "actor/kl/answer_count": 0.0, "actor/pg_loss": 1.5}
    m = token_means(metrics, prefix="actor/")
    assert m.keys() == {"kl/answer", "actor/pg_loss"} and math.isnan(m["kl/answer"])


def test_zero_spread_rows_are_the_groups_group_advantages_zeroes():
    """One definition of "zero spread" (range or std <= ZERO_SPREAD_TOL, or one rollout): the
    groups dynamic sampling drops and reward_quality counts are exactly those GRPO gives A = 0,
    in float32 and float64."""
    from omgrpo.core.losses import ZERO_SPREAD_TOL, zero_spread_rows

    rewards = [0.3, 0.3 + 1e-13, 1.0, 1.0, 0.2, 0.7, 5.0, 0.0, 1.0, 0.25]
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4, 4])
    for dtype in (torch.float32, torch.float64):
        r = torch.tensor(rewards, dtype=dtype)
        flat = zero_spread_rows(r, groups)
        assert flat.tolist() == [True] * 4 + [False] * 2 + [True] + [False] * 3
        adv = group_advantages(r, groups)
        assert (adv[flat] == 0).all() and (adv[~flat] != 0).all()
    assert ZERO_SPREAD_TOL == 1e-12
