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
so reasoning-token gradients do not depend on w. Everything else is verl's `ppo_loss` line for
line (same building blocks, same metrics), which a test checks: with nothing masked the two
losses are equal.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.padding import no_padding_2_padding

from omgrpo.backends.verl import ANSWER_MASK_KEY
from omgrpo.core.losses import token_weights

__all__ = ["loss_metric_means", "omgrpo_ppo_loss"]


def omgrpo_ppo_loss(
    config: Any,
    model_output: dict[str, torch.Tensor],
    data: TensorDict,
    dp_group: Any = None,
    *,
    answer_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's `ppo_loss` with the KL term weighted by `answer_weight` on answer tokens.

    Args:
        config: the actor's `ActorConfig` (verl binds it with `functools.partial`).
        model_output: `log_probs` (and `entropy`) of the micro-batch, no-padding layout.
        data: the micro-batch; reads `response_mask`, `old_log_probs`, `advantages`,
            `ref_log_prob`, optional `rollout_is_weights` and `omgrpo_answer_mask` (jagged,
            response length; absent = no answer tokens, i.e. verl's loss exactly).
        dp_group: unused (verl's signature).
        answer_weight: w, the KL weight of answer tokens (0 = OM-GRPO).

    Returns:
        ``(loss, metrics)`` as verl's `ppo_loss`, plus, when the KL loss is on, the sums and
        token counts of the unweighted KL on answer and reasoning tokens
        (`kl/answer_sum`, `kl/answer_count`, `kl/reasoning_sum`, `kl/reasoning_count`, summed
        over micro-batches); the trainer turns them into the token means `kl/answer` and
        `kl/reasoning` (`loss_metric_means`), so a micro-batch without answer tokens does
        not pull the mean towards 0.
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = model_output.get("entropy")
    if entropy is not None:
        entropy = no_padding_2_padding(entropy, data)

    config.global_batch_info["dp_size"] = data["dp_size"]
    config.global_batch_info["batch_num_tokens"] = data["batch_num_tokens"]
    config.global_batch_info["global_batch_size"] = data["global_batch_size"]
    config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor

    # As verl: normalised over the global batch -> partial sums per micro-batch -> SUM.
    if (
        data["dp_size"] > 1
        or data["batch_num_tokens"] is not None
        or data["global_batch_size"] is not None
        or config.loss_scale_factor is not None
    ):
        metric_aggregation = AggregationType.SUM
    else:
        metric_aggregation = AggregationType.MEAN

    metrics: dict[str, Any] = {}
    fields = ["response_mask", "old_log_probs", "advantages"]
    for optional in ("rollout_is_weights", "ref_log_prob", ANSWER_MASK_KEY):
        if optional in data:
            fields.append(optional)
    data = data.select(*fields).to_padded_tensor()

    response_mask = data["response_mask"].to(bool)
    if ANSWER_MASK_KEY in data:
        answer = data[ANSWER_MASK_KEY].to(bool) & response_mask
    else:
        answer = torch.zeros_like(response_mask)
    reasoning = response_mask & ~answer
    loss_agg_mode = config.loss_agg_mode

    policy_loss_fn = get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    pg_loss, pg_metrics = policy_loss_fn(
        old_log_prob=data["old_log_probs"],
        log_prob=log_prob,
        advantages=data["advantages"],
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=data.get("rollout_is_weights", None),
    )
    metrics.update(Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN))
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=metric_aggregation)
    # |A| per token is the token's weight in the PG term: its answer share shows the masking
    # that reached this loss (0 at w = 0), `answer/frac` that the answer masks did.
    metrics.update(_split_sums("pg_weight", data["advantages"].abs(), answer, reasoning))
    policy_loss = pg_loss

    if entropy is not None:
        entropy_loss = agg_loss(
            loss_mat=entropy,
            loss_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            **config.global_batch_info,
        )
        policy_loss -= config.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=metric_aggregation)

    if config.use_kl_loss:
        kld = kl_penalty(
            logprob=log_prob, ref_logprob=data["ref_log_prob"], kl_penalty=config.kl_loss_type
        )
        # The one change to verl: per-token KL weights, w on answer tokens, 1 elsewhere.
        weights = token_weights(answer, answer_weight, dtype=kld.dtype)
        kl_loss = agg_loss(
            loss_mat=kld * weights,
            loss_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            **config.global_batch_info,
        )
        policy_loss += kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=metric_aggregation)
        metrics["kl_coef"] = config.kl_loss_coef
        metrics.update(_split_sums("kl", kld, answer, reasoning))

    return policy_loss, metrics


_SPLIT_KEYS = ("answer_sum", "answer_count", "reasoning_sum", "reasoning_count")


def _split_sums(name: str, values: torch.Tensor, answer: torch.Tensor, reasoning: torch.Tensor):
    """`<name>/answer_sum`, `_count`, `<name>/reasoning_sum`, `_count` of the micro-batch as
    SUM metrics (one device sync for the four). verl reduces every key the same way (sum over
    micro-batches, mean over data-parallel ranks and over mini-batches), which scales sums and
    counts alike, so their ratio is the token mean over the whole step."""
    with torch.no_grad():
        v = values.detach().float()
        stats = torch.stack(
            [(v * answer).sum(), answer.sum(), (v * reasoning).sum(), reasoning.sum()]
        ).tolist()
    keys = [f"{name}/{k}" for k in _SPLIT_KEYS]
    return {k: Metric(value=x, aggregation=AggregationType.SUM) for k, x in zip(keys, stats)}


def loss_metric_means(metrics: dict[str, Any], prefix: str = "actor/") -> dict[str, Any]:
    """Replace the `<name>/<kind>_sum` / `_count` pairs (as verl reduced them, under `prefix`)
    by step-level metrics; in place, returns `metrics`:

    - `kl/answer`, `kl/reasoning`: token means of the unweighted KL (nan without such tokens);
    - `answer/frac`: share of response tokens in the answer span (the native trainer's name);
    - `pg/answer_weight_share`: share of the summed per-token |advantage| (each token's weight
      in the policy-gradient term) on answer tokens: w-weighted, so exactly 0 at w = 0
      (nan when every advantage is 0).
    """
    for kind in ("answer", "reasoning"):
        total = metrics.pop(f"{prefix}kl/{kind}_sum", None)
        count = metrics.pop(f"{prefix}kl/{kind}_count", None)
        if total is not None and count is not None:
            metrics[f"kl/{kind}"] = float(total) / float(count) if count else math.nan
    pg = {k: metrics.pop(f"{prefix}pg_weight/{k}", None) for k in _SPLIT_KEYS}
    if all(v is not None for v in pg.values()):
        tokens = float(pg["answer_count"]) + float(pg["reasoning_count"])
        weight = float(pg["answer_sum"]) + float(pg["reasoning_sum"])
        metrics["answer/frac"] = float(pg["answer_count"]) / tokens if tokens else math.nan
        metrics["pg/answer_weight_share"] = float(pg["answer_sum"]) / weight if weight else math.nan
    return metrics
