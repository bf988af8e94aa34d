"""The policy update of one native step: PPO epochs over mini-batches of the clipped
surrogate (+ k3 KL), micro-batches accumulating gradients (`ppo_update`), the way their
metrics combine (`UpdateMetrics`), the DAPO options' batch (`dapo_batch`) and the
shuffled-advantage null control's batch (`shuffled_advantages`)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from omgrpo.core.dapo import dapo_on, dapo_step, truncated_rows
from omgrpo.core.losses import COUNT_SUFFIX, SUM_SUFFIX, token_logprobs_and_entropy, token_means
from omgrpo.core.step import StepBatch, step_loss
from omgrpo.generation.rollout import Sequences, response_logits


def single_update(algo, batch: int) -> bool:
    """One optimizer step per training step (one PPO epoch, one mini-batch): the old policy's
    log-probs are then the update's own, detached."""
    return algo.ppo_epochs == 1 and (algo.mini_batch_size or batch) >= batch


def ppo_update(
    policy,
    optimizer,
    seqs: Sequences,
    old_logprobs,
    ref_logprobs,
    batch: StepBatch,
    algo,
    grad_clip: float,
) -> dict[str, Any]:
    """PPO epochs over mini-batches; micro-batches accumulate gradients with the mini-batch's
    token count as the denominator. A non-finite loss or gradient skips the whole step."""
    B = len(seqs)
    roles = batch.responses.role_masks()
    mini = algo.mini_batch_size or B
    micro = algo.micro_batch_size or mini
    device = next(policy.parameters()).device
    combined = UpdateMetrics()
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(B) if (algo.ppo_epochs > 1 or mini < B) else torch.arange(B)
        for m0 in range(0, B, mini):
            mb = order[m0 : m0 + mini]
            num_tokens = _loss_tokens(seqs, batch, mb).clamp(min=1).to(device)
            optimizer.zero_grad(set_to_none=True)
            for u0 in range(0, len(mb), micro):
                idx = mb[u0 : u0 + micro]
                # token-mean micro-batch losses are already partial sums of the mini-batch's
                scale = 1.0 if algo.agg == "token-mean" else _seq_share(batch, idx, mb)
                metrics = _micro_batch_backward(
                    policy,
                    seqs.select(idx).to(device),
                    idx,
                    old_logprobs,
                    ref_logprobs,
                    batch,
                    roles,
                    algo,
                    num_tokens,
                    scale,
                )
                if metrics is None:  # a non-finite loss
                    optimizer.zero_grad(set_to_none=True)
                    return {"skipped": True}
                combined.add_micro_batch(metrics, scale)
            norm = torch.nn.utils.clip_grad_norm_(
                policy.parameters(), grad_clip if grad_clip > 0 else float("inf")
            )
            if not torch.isfinite(norm):
                optimizer.zero_grad(set_to_none=True)
                return {"skipped": True}
            combined.end_mini_batch(float(norm))
            optimizer.step()
    return {**combined.result(), "skipped": False}


def _loss_tokens(seqs: Sequences, batch: StepBatch, rows: torch.Tensor) -> torch.Tensor:
    """The response tokens of `rows` the loss aggregates over (the rollouts the DAPO options
    keep, `batch.sample_mask`; all without it): token-mean's denominator."""
    mask = seqs.response_mask[rows]
    if batch.sample_mask is None:
        return mask.sum()
    return (mask * batch.sample_mask[rows].unsqueeze(-1).to(mask.dtype)).sum()


def _seq_share(batch: StepBatch, idx: torch.Tensor, mb: torch.Tensor) -> float:
    """A seq-mean micro-batch loss's share of its mini-batch's: its rollouts over the
    mini-batch's (only the kept ones with the DAPO options' `sample_mask`)."""
    if batch.sample_mask is None:
        return len(idx) / len(mb)
    kept = batch.sample_mask
    return float(kept[idx].sum()) / max(float(kept[mb].sum()), 1.0)


def dapo_batch(
    batch: StepBatch, seqs: Sequences, algo, max_len: int, stop_ids: int | list[int] | None
) -> tuple[StepBatch, dict[str, float]]:
    """The DAPO options of `algo` (`omgrpo.core.dapo`) on a scored step: the batch with the
    overlong penalty in its rewards and advantages and the kept rollouts as `sample_mask`, and
    the `dapo/*` metrics; the batch unchanged and no metrics with every option off."""
    if not dapo_on(algo):
        return batch, {}
    mask = seqs.response_mask.cpu()
    truncated = truncated_rows(seqs.response_ids.cpu(), mask, max_len, stop_ids)
    lengths = mask.long().sum(-1)
    out = dapo_step(algo, batch.rewards, batch.group_ids, lengths, truncated, max_len)
    advantages = batch.advantages if out.advantages is None else out.advantages
    return dataclasses.replace(
        batch, rewards=out.rewards, advantages=advantages, sample_mask=out.sample_mask
    ), out.metrics


def _micro_batch_backward(
    policy,
    part: Sequences,
    idx,
    old_logprobs,
    ref_logprobs,
    batch: StepBatch,
    roles: dict,
    algo,
    num_tokens,
    scale: float,
) -> dict[str, float] | None:
    """One micro-batch's loss (times `scale`) back-propagated; its metrics, or None when the
    loss is not finite (nothing is back-propagated then). A function so that its logits
    (m x T x V) are freed on return: held in `ppo_update`'s loop they stayed alive through the
    next micro-batch's forward and the optimizer step, m*T*V*b bytes more at the step's
    peak."""
    logits = response_logits(policy, part)
    logprobs, entropy = token_logprobs_and_entropy(logits.float(), part.response_ids)
    loss, metrics = step_loss(
        batch,
        idx,
        logprobs,
        part.response_mask,
        algo,
        num_tokens,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy.detach(),
        roles=roles,
    )
    loss = loss * scale
    if not torch.isfinite(loss):
        return None
    loss.backward()
    return metrics


class UpdateMetrics:
    """How an update's micro-batch metrics combine into the step's: the token statistics
    (`token_stats` sums and counts) add up over every micro-batch of every mini-batch and
    epoch and are divided once (`token_means`: token-weighted, as the verl backend, nan for a
    role without tokens); `loss/*` is each mini-batch's loss as back-propagated (the sum of
    its scaled micro-batch losses) and, like `grad/norm`, averaged over mini-batches."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = defaultdict(float)
        self.losses: dict[str, float] = defaultdict(float)  # of the current mini-batch
        self.means: dict[str, list[float]] = defaultdict(list)

    def add_micro_batch(self, metrics: dict[str, float], scale: float) -> None:
        for key, value in metrics.items():
            if key.endswith((SUM_SUFFIX, COUNT_SUFFIX)):
                self.stats[key] += value
            else:
                self.losses[key] += value * scale

    def end_mini_batch(self, grad_norm: float) -> None:
        for key, value in self.losses.items():
            self.means[key].append(value)
        self.losses.clear()
        self.means["grad/norm"].append(grad_norm)

    def result(self) -> dict[str, float]:
        return {**token_means(self.stats), **{k: float(np.mean(v)) for k, v in self.means.items()}}


def shuffled_advantages(batch: StepBatch, generator: torch.Generator) -> StepBatch:
    """`batch` with its advantages (and format advantages) permuted within each group: the
    shuffled-advantage null control (`trainer.shuffle_advantages`)."""
    order = torch.arange(len(batch.group_ids))
    for g in batch.group_ids.unique():
        rows = (batch.group_ids == g).nonzero().squeeze(1)
        order[rows] = rows[torch.randperm(len(rows), generator=generator)]
    fmt = batch.format_advantages
    return dataclasses.replace(
        batch,
        advantages=batch.advantages[order],
        format_advantages=None if fmt is None else fmt[order],
    )
