"""GRPO losses with the Outcome-Masked Update (OMU).

Pure tensor functions in the style of verl's ``core_algos``: every loss returns
``(loss, metrics)`` where ``loss`` is a scalar tensor carrying the graph and ``metrics``
is a dict of python floats.

Notation (shapes)
-----------------
- ``B``: number of rollouts in the (micro-)batch, ``T``: padded response length,
  ``V``: vocabulary size.
- ``response_mask`` (B, T): 1 on valid response tokens (everything else is padding).
- ``answer_mask`` (B, T): 1 on the tokens of the final-answer span (the content inside
  ``\\boxed{}``); a subset of the response.

Sources
-------
- GRPO group-normalised advantages and clipped objective: Shao et al. 2024,
  "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models"
  (the clipped surrogate itself is PPO, Schulman et al. 2017).
- k3 KL estimator: J. Schulman, "Approximating KL divergence" (blog, 2020); identical to
  verl's ``kl_penalty(..., "low_var_kl")`` including its clamps.
- Outcome-Masked Update: the paper's masked objective. Every response token ``t`` of rollout
  ``i`` gets a weight ``m_t = w`` if ``t`` is an answer token and ``1`` otherwise; the
  per-token PG advantage is ``m_t * A_i`` and the per-token KL is ``m_t * k3_t``. ``w = 0`` is
  OM-GRPO, ``w = 1`` is vanilla GRPO. OMU is only a weight: aggregation (and in particular its
  denominator) is unchanged, so reasoning-token gradients do not depend on ``w``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from omgrpo.core.choices import AGG_MODES

__all__ = [
    "AGG_MODES",
    "ZERO_SPREAD_TOL",
    "agg_loss",
    "answer_token_advantages",
    "group_advantages",
    "grpo_loss",
    "kl_k3",
    "masked_mean",
    "token_logprobs_and_entropy",
    "token_means",
    "token_roles",
    "token_stats",
    "token_weights",
    "zero_spread_rows",
]


ZERO_SPREAD_TOL = 1e-12
"""A group's rewards have zero spread when their range or std is at most this: GRPO gives the
group no advantage (`group_advantages`), dynamic sampling drops it (`omgrpo.core.dapo`), and
`reward_quality/zero_spread_groups` counts it."""
# verl clamps log-ratios before exponentiating (compute_policy_loss / kl_penalty).
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------
def group_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages, normalised within each group of rollouts.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` where ``g`` is the group of rollout ``i`` and
    ``std_g`` is the unbiased (N-1) standard deviation, as in verl's GRPO estimator
    (Shao et al. 2024, eq. for outcome supervision). Groups of size 1, and groups whose rewards
    are all equal (range or std at most 1e-12), get ``A = 0`` exactly.

    Vectorised with ``unique(return_inverse=True)`` + ``index_add``; no loop over groups.

    Args:
        rewards: (B,) scalar reward per rollout.
        group_ids: (B,) integer group id per rollout (any values; groups need not be
            contiguous).
        eps: added to the std in the denominator.

    Returns:
        (B,) advantages. float32/float64 input keeps its dtype; other floating dtypes are
        computed in float32 and cast back; integer/bool rewards give float32.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be (B,), got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if rewards.dtype in (torch.float32, torch.float64):
        compute_dtype = out_dtype = rewards.dtype
    elif rewards.is_floating_point():
        compute_dtype, out_dtype = torch.float32, rewards.dtype
    else:
        compute_dtype = out_dtype = torch.float32
    r = rewards.detach().to(compute_dtype)

    uniq, inv = torch.unique(group_ids, return_inverse=True)
    dev, std = _group_deviations(r, inv, uniq.numel())
    adv = dev / (std[inv] + eps)
    adv = torch.where(zero_spread_rows(r, group_ids), torch.zeros_like(adv), adv)
    return adv.to(out_dtype)


def _group_deviations(r: Tensor, inv: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """(B,) deviations from the group mean and (G,) unbiased (N-1) group std, in r's dtype."""
    zeros_g = torch.zeros(n_groups, dtype=r.dtype, device=r.device)
    counts = torch.bincount(inv, minlength=n_groups).to(r.dtype)
    mean = zeros_g.index_add(0, inv, r) / counts.clamp(min=1)
    dev = r - mean[inv]
    var = zeros_g.index_add(0, inv, dev * dev) / (counts - 1).clamp(min=1)
    return dev, var.sqrt()


def zero_spread_rows(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """(B,) bool: the rollouts of groups with zero spread (one rollout, or range or std at most
    `ZERO_SPREAD_TOL`), the groups `group_advantages` gives A = 0. float32/float64 rewards are
    judged in their dtype (as `group_advantages` computes), others in float64."""
    r = torch.as_tensor(rewards)
    if r.dtype not in (torch.float32, torch.float64):
        r = r.to(torch.float64)
    uniq, inv = torch.unique(torch.as_tensor(group_ids), return_inverse=True)
    n_groups = uniq.numel()
    counts = torch.bincount(inv, minlength=n_groups)
    _, std = _group_deviations(r, inv, n_groups)
    zeros_g = torch.zeros(n_groups, dtype=r.dtype, device=r.device)
    gmax = zeros_g.scatter_reduce(0, inv, r, reduce="amax", include_self=False)
    gmin = zeros_g.scatter_reduce(0, inv, r, reduce="amin", include_self=False)
    degenerate = (counts < 2) | (std <= ZERO_SPREAD_TOL) | ((gmax - gmin) <= ZERO_SPREAD_TOL)
    return degenerate[inv]


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------
def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """``sum(x * mask) / max(sum(mask), 1)`` over all elements.

    Masked-out entries are selected away (``where``), so non-finite values there (e.g. padding)
    do not leak into the result.

    Args:
        x: any shape.
        mask: same shape as ``x`` (or broadcastable); bool or 0/1.

    Returns:
        0-dim tensor (0 when the mask is empty).
    """
    m = mask.to(x.dtype)
    return torch.where(m != 0, x * m, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    mode: str = "token-mean",
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """Aggregate a per-token loss into a scalar (the single owner of all aggregation modes).

    Modes (as verl's ``agg_loss``):

    - ``"token-mean"``: ``sum(loss * mask) / D`` with ``D = num_tokens`` if given (e.g. the
      number of response tokens of the whole mini-batch when micro-batching, so that summing
      micro-batch gradients reproduces the mini-batch gradient) else ``mask.sum()``; ``D`` is
      clamped to at least 1.
    - ``"seq-mean-token-sum"``: per-sequence ``sum_t loss * mask``, averaged over sequences that
      have at least one valid token.
    - ``"seq-mean-token-mean"``: per-sequence ``sum_t loss * mask / max(sum_t mask, 1)``,
      averaged over sequences that have at least one valid token.

    ``num_tokens`` is only used by ``"token-mean"``; the seq modes always average over the
    non-empty sequences of ``loss_mat`` (callers that micro-batch them must rescale).

    Args:
        loss_mat: (B, T) per-token loss.
        loss_mask: (B, T) bool or 0/1 mask of tokens that count.
        mode: one of ``AGG_MODES``.
        num_tokens: optional global token count for ``"token-mean"``.

    Returns:
        0-dim tensor.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {AGG_MODES}")
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} differ"
        )
    mask = loss_mask.to(loss_mat.dtype)
    masked = loss_mat * mask

    if mode == "token-mean":
        if num_tokens is None:
            denom = mask.sum()
        else:
            denom = torch.as_tensor(num_tokens, dtype=loss_mat.dtype, device=loss_mat.device)
        return masked.sum() / denom.clamp(min=1)

    seq_len = mask.sum(dim=-1)  # (B,)
    seq_losses = masked.sum(dim=-1)  # (B,)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / seq_len.clamp(min=1)
    seq_valid = (seq_len > 0).to(loss_mat.dtype)
    return (seq_losses * seq_valid).sum() / seq_valid.sum().clamp(min=1)


# --------------------------------------------------------------------------------------------
# Per-token pieces
# --------------------------------------------------------------------------------------------
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(pi || pi_ref) per token (verl's ``"low_var_kl"``).

    With ``kl = clamp(ref - logp, -20, 20)``: ``k3 = clamp(exp(kl) - kl - 1, -10, 10)``
    (Schulman, "Approximating KL divergence", 2020). Non-negative and unbiased for samples
    drawn from ``pi``.

    Args:
        logprobs: (B, T) log pi(token) under the current policy.
        ref_logprobs: (B, T) log pi_ref(token).

    Returns:
        (B, T) elementwise k3.
    """
    kl = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    k3 = torch.exp(kl) - kl - 1
    return k3.clamp(-_K3_CLAMP, _K3_CLAMP)


def token_weights(
    answer_mask: Tensor, answer_weight: float, *, dtype: torch.dtype = torch.float32
) -> Tensor:
    """OMU token weights: ``answer_weight`` on answer-span tokens, 1 elsewhere.

    Args:
        answer_mask: (B, T) bool or 0/1 mask of answer-span tokens.
        answer_weight: the OMU weight ``w`` (0 = OM-GRPO, 1 = vanilla GRPO).
        dtype: floating dtype of the result.

    Returns:
        (B, T) weights of ``dtype``.
    """
    ones = torch.ones(answer_mask.shape, dtype=dtype, device=answer_mask.device)
    return torch.where(answer_mask.bool(), ones * answer_weight, ones)


def answer_token_advantages(
    advantages: Tensor,
    answer_mask: Tensor,
    answer_weight: float,
    format_advantages: Tensor | None = None,
) -> Tensor:
    """Per-token PG advantages of the Outcome-Masked Update.

    ``a_t = m_t * A_i`` (:func:`token_weights`: ``answer_weight`` on answer tokens, 1
    elsewhere); with ``format_advantages`` ("format-only") answer tokens take
    ``format_advantages[i]`` instead and the others keep ``A_i``.

    Args:
        advantages: (B, 1) or (B, T) advantages (A_i broadcast over the tokens of rollout i).
        answer_mask: (B, T) bool or 0/1 answer-span tokens.
        answer_weight: the OMU weight ``w``.
        format_advantages: optional (B,) advantage for answer tokens.

    Returns:
        (B, T) advantages of ``advantages.dtype`` (not masked by the response).
    """
    answer = answer_mask.bool()
    shape = answer.shape
    if format_advantages is None:
        return advantages * token_weights(answer, answer_weight, dtype=advantages.dtype)
    fmt = format_advantages.to(advantages.dtype).unsqueeze(-1).expand(shape)
    return torch.where(answer, fmt, advantages.expand(shape))


def token_logprobs_and_entropy(logits: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probability of the given tokens and the entropy of the full distribution.

    Computed in float32 (float64 logits stay float64) with ``log_softmax``. Memory: the only (B, T, V) tensor kept for
    backward is the float32 log-softmax output (plus the float32 cast of ``logits`` transiently
    when they are low precision). The entropy is computed under ``no_grad`` (it is a
    diagnostic) with one extra transient (B, T, V) buffer, reused in place.

    Args:
        logits: (B, T, V) logits at the positions that predict ``tokens`` (i.e. already shifted).
        tokens: (B, T) integer token ids.

    Returns:
        ``(logprobs, entropy)``: (B, T) ``log p(tokens)`` (differentiable w.r.t.
        ``logits``) and (B, T) entropy ``-sum_v p_v log p_v`` (detached).
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be tokens {tuple(tokens.shape)} + (V,)"
        )
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp_all = torch.log_softmax(logits.to(compute_dtype), dim=-1)  # (B, T, V)
    logprobs = logp_all.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        p = logp_all.exp()
        # p * logp is 0 * -inf = nan where p underflows to exactly 0; those terms are 0.
        entropy = -p.mul_(logp_all).nan_to_num_(nan=0.0).sum(dim=-1)
    return logprobs, entropy


# --------------------------------------------------------------------------------------------
# GRPO / OM-GRPO loss
# --------------------------------------------------------------------------------------------
def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    answer_mask: Tensor,
    *,
    answer_weight: float = 0.0,
    answer_kl_weight: float | None = None,
    format_advantages: Tensor | None = None,
    clip: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    kl_coef: float = 0.005,
    agg: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    entropy: Tensor | None = None,
    roles: dict[str, Tensor] | None = None,
    token_mask: Tensor | None = None,
    sample_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss with the Outcome-Masked Update (the paper's masked objective).

    Per response token ``t`` of rollout ``i`` with OMU weight ``m_t`` (``answer_weight`` on
    answer tokens, 1 elsewhere; see :func:`token_weights`):

    - PG advantage ``a_t = m_t * A_i``; in the "format-only" ablation (``format_advantages``
      given) answer tokens use ``format_advantages[i]`` instead of ``w * A_i``.
    - clipped surrogate (PPO/GRPO, Shao et al. 2024):
      ``rho = exp(logp - old_logp)`` (log-ratio clamped to +-20 as in verl),
      ``pg_t = -min(rho * a_t, clamp(rho, 1 - clip_low, 1 + clip_high) * a_t)`` (DAPO's
      asymmetric "clip-higher" when they differ; each defaults to ``clip``).
      For ``w >= 0`` scaling ``A`` by ``w`` scales the clipped surrogate by exactly ``w``.
    - KL ``kl_t = u_t * k3_t`` (:func:`kl_k3`) with ``u_t = answer_kl_weight`` on answer tokens
      (default: ``m_t``, the paper's masked objective; also in format-only mode). A separate
      ``answer_kl_weight`` (e.g. 1 with ``w = 0``: mask the PG term, keep the KL anchor on the
      answer) lets a study separate the two masked terms.

    - ``token_mask`` (the generic masks, `omgrpo.core.masks.token_mask`): its tokens get weight 0
      in both terms, on top of the above.
    - ``sample_mask`` (DAPO's dynamic sampling and overlong filtering, `omgrpo.core.dapo`): the
      rollouts outside it leave the loss entirely, numerator and denominator (as if they had
      not been sampled); the token metrics still cover them.

    ``loss = agg(pg) + kl_coef * agg(kl)``, both aggregated over ``response_mask`` with the same
    denominator: masking never renormalises, so changing ``w`` leaves reasoning-token gradients
    unchanged. With ``answer_weight == 0`` and no ``format_advantages`` the gradient w.r.t.
    answer-token log-probs is exactly zero; with ``answer_weight == 1`` this is vanilla GRPO.

    Args:
        logprobs: (B, T) log pi_theta(token), carries grad.
        old_logprobs: (B, T) log pi_old(token) from the rollout policy.
        ref_logprobs: (B, T) log pi_ref(token), or None (no KL term).
        advantages: (B,) sequence advantages (e.g. :func:`group_advantages`).
        response_mask: (B, T) bool or 0/1, valid response tokens.
        answer_mask: (B, T) bool or 0/1, answer-span tokens (intersected with the response).
        answer_weight: OMU weight ``w`` on answer tokens (0 = OM-GRPO, 1 = GRPO).
        answer_kl_weight: KL weight on answer tokens; None = ``answer_weight``.
        format_advantages: optional (B,) advantage used on answer tokens ("format-only").
        clip: PPO clip range epsilon.
        clip_low, clip_high: the ratio's lower / upper clip range (verl's ``clip_ratio_low`` /
            ``clip_ratio_high``); None = ``clip``.
        kl_coef: KL coefficient beta; 0 disables the KL term (``ref_logprobs`` may be None).
        agg: aggregation mode, see :func:`agg_loss`.
        num_tokens: optional global token count for ``"token-mean"`` (micro-batching).
        entropy: optional (B, T) per-token entropy, for metrics only.
        roles: optional name -> (B, T) bool masks of token roles (e.g. `result`, `format`,
            `other`; `omgrpo.core.step.Responses.role_masks`), for `kl/<name>` and
            `entropy/<name>` metrics only.
        token_mask: optional (B, T) bool, tokens taken out of training (weight 0 in the PG and
            KL terms; the aggregation's denominator is unchanged).
        sample_mask: optional (B,) bool, the rollouts that count in the loss (None: all).

    Returns:
        ``(loss, metrics)``: 0-dim loss and python-float metrics ``loss/pg``, ``loss/kl``
        (aggregated weighted k3, before ``kl_coef``), ``loss/total``, and the `token_stats`
        sums and counts (``<name>_sum`` / ``<name>_count``; :func:`token_means` turns them,
        summed over micro-batches, into the token means) of ``clip/frac``, ``ratio/mean``,
        ``answer/frac`` (fraction of response tokens in the answer span), ``kl/<role>``
        (unweighted k3) when ``ref_logprobs`` is given and ``entropy/<role>`` when
        ``entropy`` is given, for the roles ``answer``, ``reasoning`` and ``roles``.
    """
    per_token = {
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "response_mask": response_mask,
        "answer_mask": answer_mask,
        "entropy": entropy,
        "token_mask": token_mask,
    }
    per_seq = {"advantages": advantages, "format_advantages": format_advantages}
    _check_shapes(logprobs, per_token, {**per_seq, "sample_mask": sample_mask})

    dtype = logprobs.dtype
    resp = response_mask.bool()
    answer = answer_mask.bool() & resp
    weights = token_weights(answer, answer_weight, dtype=dtype)  # (B, T)
    # the tokens the loss aggregates over (numerator and denominator)
    loss_mask = resp if sample_mask is None else resp & sample_mask.bool().unsqueeze(-1)

    # Per-token PG advantage.
    adv_seq = advantages.detach().to(dtype).unsqueeze(-1)  # (B, 1)
    fmt_seq = None if format_advantages is None else format_advantages.detach()
    adv_tok = answer_token_advantages(adv_seq, answer, answer_weight, fmt_seq)
    keep = None if token_mask is None else ~token_mask.bool()
    if keep is not None:
        adv_tok = torch.where(keep, adv_tok, torch.zeros_like(adv_tok))

    # Clipped surrogate.
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv_tok * ratio
    low = clip if clip_low is None else clip_low
    high = clip if clip_high is None else clip_high
    pg_clipped = -adv_tok * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    pg_mat = torch.maximum(pg_unclipped, pg_clipped)  # = -min(rho * a, clip(rho) * a)
    pg = agg_loss(pg_mat, loss_mask, agg, num_tokens)

    # Weighted k3 KL to the reference.
    use_kl = ref_logprobs is not None and kl_coef != 0
    k3 = None
    if ref_logprobs is not None:
        k3 = kl_k3(logprobs, ref_logprobs.detach())
    if use_kl:
        kl_weight = answer_weight if answer_kl_weight is None else answer_kl_weight
        kl_weights = (
            weights if kl_weight == answer_weight else token_weights(answer, kl_weight, dtype=dtype)
        )
        if keep is not None:
            kl_weights = torch.where(keep, kl_weights, torch.zeros_like(kl_weights))
        kl = agg_loss(k3 * kl_weights, loss_mask, agg, num_tokens)
        loss = pg + kl_coef * kl
    else:
        kl = torch.zeros((), dtype=dtype, device=logprobs.device)
        loss = pg

    metrics = {
        "loss/pg": pg.item(),
        "loss/kl": kl.item(),
        "loss/total": loss.item(),
        **_token_metrics(ratio, pg_clipped > pg_unclipped, k3, entropy, resp, answer, roles),
    }
    return loss, metrics


def _check_shapes(
    logprobs: Tensor,
    per_token: dict[str, Tensor | None],
    per_sequence: dict[str, Tensor | None],
) -> None:
    """Raise ValueError unless logprobs is (B, T), the given `per_token` tensors are (B, T) and
    the given `per_sequence` ones (B,)."""
    shape = logprobs.shape
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be (B, T), got {tuple(shape)}")
    for name, tensor in per_token.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} != logprobs {tuple(shape)}")
    for name, tensor in per_sequence.items():
        if tensor is not None and tensor.shape != shape[:1]:
            raise ValueError(f"{name} must be (B,)={tuple(shape[:1])}, got {tuple(tensor.shape)}")


@torch.no_grad()
def _token_metrics(
    ratio: Tensor,
    clipped: Tensor,
    k3: Tensor | None,
    entropy: Tensor | None,
    resp: Tensor,
    answer: Tensor,
    roles: dict[str, Tensor] | None,
) -> dict[str, float]:
    """`grpo_loss`'s per-token diagnostics as `token_stats` sums and counts (its docstring
    lists them)."""
    return token_stats(
        {"kl": k3, "entropy": entropy},
        token_roles(resp, answer, roles),
        extra={"clip/frac": (clipped, resp), "ratio/mean": (ratio, resp)},
    )


# --------------------------------------------------------------------------------------------
# Token statistics: the one definition of every per-token metric (both backends)
# --------------------------------------------------------------------------------------------
SUM_SUFFIX, COUNT_SUFFIX = "_sum", "_count"


def token_roles(
    response_mask: Tensor, answer_mask: Tensor, roles: Mapping[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """(B, T) bool masks of the token roles metrics are split by: `answer` (answer-span tokens
    of the response), `reasoning` (the other response tokens) and any extra `roles` (the
    native trainer's `result`, `format`, `other`: `omgrpo.core.step.Responses.role_masks`)."""
    resp = response_mask.bool()
    answer = answer_mask.bool() & resp
    return {"answer": answer, "reasoning": resp & ~answer, **(roles or {})}


@torch.no_grad()
def token_stats(
    values: Mapping[str, Tensor | None],
    roles: Mapping[str, Tensor],
    extra: Mapping[str, tuple[Tensor, Tensor]] | None = None,
) -> dict[str, float]:
    """Sums and token counts of per-token values per token role, for `token_means`.

    Every token-level metric of both backends (and of any micro-batched update) comes from
    here, so each name has one definition: a token-weighted mean over the whole update
    (sums and counts add up over micro-batches, mini-batches and ranks; one division at the
    end), nan for a role without tokens.

    Args:
        values: name -> (B, T) per-token values (None: skipped), e.g. `kl` (unweighted k3) and
            `entropy`.
        roles: role -> (B, T) bool mask (`token_roles`).
        extra: name -> ((B, T) values, (B, T) weights) of other ratios of sums, e.g.
            `clip/frac` over the response mask.

    Returns:
        python floats `<value>/<role>_sum` and `<value>/<role>_count` for every value and role,
        `answer/frac_sum` / `_count` (answer tokens / answer + reasoning tokens, when both
        roles are given) and `<extra>_sum` / `_count` (sum of values * weights / sum of
        weights); computed in float64 with one device sync.
    """
    entries = {
        f"{name}/{role}": (v, mask)
        for name, v in values.items()
        if v is not None
        for role, mask in roles.items()
    }
    if "answer" in roles and "reasoning" in roles:
        answer, reasoning = roles["answer"], roles["reasoning"]
        entries["answer/frac"] = (answer, answer | reasoning)
    entries.update(extra or {})
    if not entries:
        return {}
    stats = []
    for v, weight in entries.values():
        w = weight.detach().double()
        # where, not a product: non-finite values outside the mask (padding) stay out
        stats += [torch.where(w != 0, v.detach().double() * w, 0.0).sum(), w.sum()]
    flat = torch.stack(stats).tolist()
    out = {}
    for i, name in enumerate(entries):
        out[name + SUM_SUFFIX], out[name + COUNT_SUFFIX] = flat[2 * i], flat[2 * i + 1]
    return out


def token_means(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`metrics` with every `<prefix><name>_sum` / `<prefix><name>_count` pair (from
    `token_stats`, added up over any number of micro-batches) replaced by `<name>` = sum /
    count, nan when the count is 0; other keys are kept as they are."""
    names = [
        key[len(prefix) : -len(SUM_SUFFIX)]
        for key in metrics
        if key.startswith(prefix) and key.endswith(SUM_SUFFIX)
    ]
    names = [name for name in names if prefix + name + COUNT_SUFFIX in metrics]
    paired = {prefix + name + suffix for name in names for suffix in (SUM_SUFFIX, COUNT_SUFFIX)}
    out = {key: value for key, value in metrics.items() if key not in paired}
    for name in names:
        count = float(metrics[prefix + name + COUNT_SUFFIX])
        out[name] = float(metrics[prefix + name + SUM_SUFFIX]) / count if count else math.nan
    return out
