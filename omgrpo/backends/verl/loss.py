"""Replacement of verl 0.9.1's actor loss (`verl.workers.utils.losses.ppo_loss`) with the KL
term weighted on answer tokens (the paper's masked objective, appendix eq. "masked objective").

verl computes the KL loss inside `ppo_loss` with the same `response_mask` as the PG term, so
masking it needs a replacement of the function; the `omgrpo` trainer installs
`partial(omgrpo_ppo_loss, config=<actor config>, answer_weight=w)` on the actor workers with
`actor_rollout_wg.set_loss_fn` (as verl itself installs the critic's loss from the driver).

The PG term needs no change: the trainer has already multiplied the per-token advantage by w on
answer tokens (or replaced it by the format advantage), and scaling A by w >= 0 scales the
clipped surrogate by exactly w. The KL term becomes ``agg(k3 * m)`` with ``m = w`` on answer
tokens and 1 elsewhere, aggregated over the full response mask: the denominator is unchanged,
so reasoning-token gradients do not depend on w. With a generic mask (`omgrpo.core.masks`) the
driver's `omgrpo_token_mask` marks tokens that get weight 0 in the KL term too (their advantage
is already 0). With dynamic sampling or the overlong filter (`dapo_rows`) the rows the
driver kept in `loss_mask` are the only ones in both terms, over the kept tokens or rows
(`omgrpo.backends.verl.dapo`). Everything else is verl's `ppo_loss` line for line (same
building blocks, same metrics), which a test checks: with nothing masked the two losses are
equal. The token-level metrics (`kl/<role>`, `entropy/<role>`, `answer/frac`) are
`omgrpo.core.losses.token_stats` sums and counts, as in the native trainer (docs/metrics.md).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.padding import no_padding_2_padding

from omgrpo.backends.verl import ANSWER_MASK_KEY, TOKEN_MASK_KEY
from omgrpo.core.losses import token_means, token_roles, token_stats, token_weights

__all__ = ["loss_metric_means", "omgrpo_ppo_loss"]


def omgrpo_ppo_loss(
    config: Any,
    model_output: dict[str, torch.Tensor],
    data: TensorDict,
    dp_group: Any = None,
    *,
    answer_weight: float = 0.0,
    dapo_rows: bool = False,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's `ppo_loss` with the KL term weighted by `answer_weight` on answer tokens.

    Args:
        config: the actor's `ActorConfig` (verl binds it with `functools.partial`).
        model_output: `log_probs` (and `entropy`) of the micro-batch, no-padding layout.
        data: the micro-batch; reads `response_mask`, `old_log_probs`, `advantages`,
            `ref_log_prob`, optional `rollout_is_weights`, `omgrpo_answer_mask` (jagged,
            response length; absent = no answer tokens, i.e. verl's loss exactly) and
            `omgrpo_token_mask` (the generic masks' tokens: KL weight 0; absent = none).
        dp_group: unused (verl's signature).
        answer_weight: w, the KL weight of answer tokens (0 = OM-GRPO).
        dapo_rows: the DAPO options took rollouts out of the loss (dynamic sampling, overlong
            filter): only the rows with a token in `loss_mask` count, in the numerator and in
            the denominator, which is the engine's sum of `loss_mask` (`batch_num_tokens`:
            the kept tokens under token-mean, the kept rows under the seq-mean modes,
            `omgrpo.backends.verl.dapo.kept_loss_mask`), at least 1. The token metrics still
            cover every row of `response_mask`.

    Returns:
        ``(loss, metrics)`` as verl's `ppo_loss`, plus the `token_stats` sums and counts of
        the micro-batch as SUM metrics (`kl/<role>` when the KL loss is on, `entropy/<role>`
        when the model output has entropy, `answer/frac`, `pg/answer_weight_share`), which
        `loss_metric_means` turns into the step's token means.
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = model_output.get("entropy")
    if entropy is not None:
        entropy = no_padding_2_padding(entropy, data)
    metric_aggregation = _set_global_batch_info(config, data, dapo_rows)
    data, response_mask, answer, masked = _padded_fields(data, dapo_rows)
    loss_mask = response_mask  # the tokens the loss aggregates over
    if dapo_rows:  # the rows the driver kept (`omgrpo.backends.verl.dapo`)
        loss_mask = response_mask & data["loss_mask"].to(bool).any(-1, keepdim=True)
    loss_agg_mode = config.loss_agg_mode
    agg_kwargs = {"loss_mask": loss_mask, "loss_agg_mode": loss_agg_mode}

    policy_loss_fn = get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    pg_loss, pg_metrics = policy_loss_fn(
        old_log_prob=data["old_log_probs"],
        log_prob=log_prob,
        advantages=data["advantages"],
        response_mask=loss_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=data.get("rollout_is_weights", None),
    )
    metrics: dict[str, Any] = Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN)
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=metric_aggregation)
    policy_loss = pg_loss

    if entropy is not None:
        entropy_loss = agg_loss(loss_mat=entropy, **agg_kwargs, **config.global_batch_info)
        policy_loss -= config.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=metric_aggregation)

    kld = None
    if config.use_kl_loss:
        kld = kl_penalty(
            logprob=log_prob, ref_logprob=data["ref_log_prob"], kl_penalty=config.kl_loss_type
        )
        # The one change to verl: per-token KL weights, w on answer tokens, 1 elsewhere.
        weights = token_weights(answer, answer_weight, dtype=kld.dtype)
        if masked is not None:  # the generic masks' tokens: out of the KL term too
            weights = torch.where(masked, torch.zeros_like(weights), weights)
        kl_loss = agg_loss(loss_mat=kld * weights, **agg_kwargs, **config.global_batch_info)
        policy_loss += kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=metric_aggregation)
        metrics["kl_coef"] = config.kl_loss_coef

    metrics.update(
        _token_stat_metrics(kld, entropy, data["advantages"], response_mask, answer, loss_mask)
    )
    return policy_loss, metrics


def _set_global_batch_info(
    config: Any, data: TensorDict, dapo_rows: bool = False
) -> AggregationType:
    """Copy the global batch info into the config (as verl's `ppo_loss`) and return the
    aggregation of the loss metrics: normalised over the global batch -> partial sums per
    micro-batch -> SUM. With `dapo_rows` the denominator is the engine's sum of `loss_mask`
    (at least 1), for the seq-mean modes too (`omgrpo_ppo_loss`)."""
    info = config.global_batch_info
    info["dp_size"] = data["dp_size"]
    info["batch_num_tokens"] = data["batch_num_tokens"]
    info["global_batch_size"] = data["global_batch_size"]
    info["loss_scale_factor"] = config.loss_scale_factor
    if dapo_rows and data["batch_num_tokens"] is not None:
        kept = max(data["batch_num_tokens"], 1)  # kept tokens (token-mean) or rows (seq-mean)
        info["batch_num_tokens"] = kept
        if config.loss_agg_mode != "token-mean":
            info["global_batch_size"] = kept
    if (
        data["dp_size"] > 1
        or data["batch_num_tokens"] is not None
        or data["global_batch_size"] is not None
        or config.loss_scale_factor is not None
    ):
        return AggregationType.SUM
    return AggregationType.MEAN


def _padded_fields(
    data: TensorDict, dapo_rows: bool = False
) -> tuple[TensorDict, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The loss's fields as padded tensors (with `loss_mask` for `dapo_rows`), the bool
    response mask, the answer-token mask (no answer tokens without `omgrpo_answer_mask`) and
    the generic masks' tokens (None without `omgrpo_token_mask`)."""
    fields = ["response_mask", "old_log_probs", "advantages"]
    if dapo_rows:
        fields.append("loss_mask")
    for optional in ("rollout_is_weights", "ref_log_prob", ANSWER_MASK_KEY, TOKEN_MASK_KEY):
        if optional in data:
            fields.append(optional)
    data = data.select(*fields).to_padded_tensor()
    response_mask = data["response_mask"].to(bool)
    if ANSWER_MASK_KEY in data:
        answer = data[ANSWER_MASK_KEY].to(bool) & response_mask
    else:
        answer = torch.zeros_like(response_mask)
    masked = None
    if TOKEN_MASK_KEY in data:
        masked = data[TOKEN_MASK_KEY].to(bool) & response_mask
    return data, response_mask, answer, masked


def _token_stat_metrics(
    kld: torch.Tensor | None,
    entropy: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    answer: torch.Tensor,
    loss_mask: torch.Tensor,
) -> dict[str, Metric]:
    """The micro-batch's `token_stats` as SUM metrics. verl reduces every key the same way
    (sum over micro-batches, mean over data-parallel ranks and over mini-batches), which scales
    sums and counts alike, so their ratio is the token mean over the whole update. |A| per
    token of the loss (`loss_mask`: the response, less the rows the DAPO options dropped) is
    the token's weight in the PG term: its answer share (`pg/answer_weight_share`) shows the
    masking that reached this loss (0 at w = 0), `answer/frac` that the answer masks did; the
    other statistics cover every response token."""
    stats = token_stats(
        {"kl": kld, "entropy": entropy},
        token_roles(response_mask, answer),
        extra={"pg/answer_weight_share": (answer, advantages.abs() * loss_mask)},
    )
    return {k: Metric(value=v, aggregation=AggregationType.SUM) for k, v in stats.items()}


def loss_metric_means(metrics: dict[str, Any], prefix: str = "actor/") -> dict[str, Any]:
    """Replace the `token_stats` sums and counts (as verl reduced them, under `prefix`) by
    their token means (`token_means`: `kl/answer`, `entropy/reasoning`, `answer/frac`,
    `pg/answer_weight_share`, ...; nan without tokens); in place, returns `metrics`."""
    means = token_means(metrics, prefix)
    metrics.clear()
    metrics.update(means)
    return metrics
