"""The DAPO-family options shared by both backends (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale"): pure functions of a step's rewards, groups and
response lengths.

- Dynamic sampling (`algorithm.dynamic_sampling`): groups whose rewards have zero spread carry
  no GRPO signal (their advantages are already 0), but under token-mean they still fill the
  loss's denominator and so shrink every other token's gradient. Dropping them takes their
  rollouts out of the loss entirely (`grpo_loss`'s `sample_mask`: numerator and denominator).
  omgrpo drops them and does not resample to refill the batch (DAPO and verl's v1 trainer do).
- Overlong filtering (`algorithm.overlong_filter`): truncated responses (they reached the
  length limit without ending) leave the loss the same way.
- Soft overlong punishment (`algorithm.overlong_buffer`, `overlong_penalty_factor`): DAPO's
  length-aware penalty added to the reward before the advantages, linear over the last
  `buffer_len` tokens before the limit: ``min(-(L - (L_max - buffer_len)) / buffer_len *
  penalty_factor, 0)``, from 0 at ``L_max - buffer_len`` to ``-penalty_factor`` at ``L_max``
  (verl's DAPO recipe reward manager, `overlong_buffer.len` / `penalty_factor`).

Every option is off by default (null): a config without these keys trains as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omgrpo.core.losses import group_advantages, zero_spread_rows

__all__ = [
    "DEFAULT_PENALTY_FACTOR",
    "DapoStep",
    "dapo_on",
    "dapo_step",
    "overlong_penalty",
    "truncated_rows",
    "zero_spread_rows",
]

DEFAULT_PENALTY_FACTOR = 1.0
"""DAPO's (and verl's recipe) default `penalty_factor`; `overlong_penalty_factor: null`."""


def truncated_rows(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    max_len: int,
    stop_ids: int | list[int] | None,
) -> torch.Tensor:
    """(B,) bool: responses cut by the length limit: `max_len` tokens long and not ending in a
    stop token of `stop_ids` (None: every response of `max_len` tokens counts as cut)."""
    lengths = response_mask.long().sum(-1)
    full = lengths >= max_len
    if stop_ids is None:
        return full
    stops = torch.as_tensor([stop_ids] if isinstance(stop_ids, int) else list(stop_ids))
    last = response_ids.gather(-1, (lengths - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return full & ~torch.isin(last, stops.to(last.device))


def overlong_penalty(
    lengths: torch.Tensor | np.ndarray,
    max_len: int,
    buffer_len: int,
    penalty_factor: float = DEFAULT_PENALTY_FACTOR,
) -> np.ndarray:
    """(B,) float64 DAPO soft overlong punishment (module docstring): 0 up to `max_len -
    buffer_len` tokens, then falling linearly to `-penalty_factor` at `max_len`."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"algorithm.overlong_buffer must be in [1, max length {max_len}], got {buffer_len}"
        )
    length = np.asarray(lengths, dtype=np.float64)
    exceed = length - (max_len - buffer_len)
    return np.minimum(-exceed / buffer_len * penalty_factor, 0.0)


def dapo_on(algo: Any) -> bool:
    """Whether `algo` (`config.algorithm`) turns on a DAPO option that needs the step's rows:
    dynamic sampling, overlong filtering or the soft overlong punishment."""
    return bool(
        getattr(algo, "dynamic_sampling", None)
        or getattr(algo, "overlong_filter", None)
        or getattr(algo, "overlong_buffer", None) is not None
    )


@dataclass
class DapoStep:
    """A step under the DAPO options: the rewards (with the overlong penalty), the GRPO
    advantages of those rewards (None: unchanged), the rollouts the loss keeps (None: all) and
    the `dapo/*` metrics."""

    rewards: np.ndarray
    advantages: torch.Tensor | None
    sample_mask: torch.Tensor | None
    metrics: dict[str, float]


def dapo_step(
    algo: Any,
    rewards: np.ndarray,
    group_ids: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    max_len: int,
) -> DapoStep:
    """The DAPO options of `algo` on a scored step (module docstring).

    Args:
        algo: `config.algorithm` (reads `dynamic_sampling`, `overlong_filter`,
            `overlong_buffer`, `overlong_penalty_factor`, `adv_eps`).
        rewards: (B,) the step's rewards.
        group_ids: (B,) group of each rollout.
        lengths: (B,) response lengths in tokens.
        truncated: (B,) bool, responses cut by the length limit (`truncated_rows`).
        max_len: the length limit (native `rollout.max_new_tokens`).

    Returns:
        `DapoStep`. Metrics: `dapo/overlong_penalty` (mean penalty over the step's rollouts,
        with the buffer), `dapo/dropped_groups` (the NUMBER of zero-spread groups dropped,
        after the penalty, with dynamic sampling), `dapo/truncated` (share of truncated
        rollouts, with the filter) and `dapo/kept_rollouts` (share of rollouts in the loss).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    advantages, metrics = None, {}
    if getattr(algo, "overlong_buffer", None) is not None:
        factor = getattr(algo, "overlong_penalty_factor", None)
        factor = DEFAULT_PENALTY_FACTOR if factor is None else float(factor)
        penalty = overlong_penalty(lengths, max_len, int(algo.overlong_buffer), factor)
        rewards = rewards + penalty
        metrics["dapo/overlong_penalty"] = float(penalty.mean())
        advantages = group_advantages(
            torch.tensor(rewards, dtype=torch.float32), group_ids, algo.adv_eps
        )
    keep = torch.ones(len(rewards), dtype=torch.bool)
    if getattr(algo, "dynamic_sampling", None):
        flat = zero_spread_rows(torch.as_tensor(rewards), group_ids)
        keep &= ~flat
        metrics["dapo/dropped_groups"] = float(group_ids[flat].unique().numel())
    if getattr(algo, "overlong_filter", None):
        keep &= ~truncated.bool()
        metrics["dapo/truncated"] = float(truncated.float().mean())
    sample_mask = None
    if getattr(algo, "dynamic_sampling", None) or getattr(algo, "overlong_filter", None):
        sample_mask = keep
        metrics["dapo/kept_rollouts"] = float(keep.float().mean())
    return DapoStep(rewards, advantages, sample_mask, metrics)
