"""Proxy-reward quality: is the label-free reward still telling the truth?

TTRL (URLVR) logs, per step on training data whose labels are known, how often a rollout's
proxy reward agrees with its correctness, how often the vote is right, the majority ratio and
the reward/correctness correlation; TRL logs the share of groups whose rewards have zero spread.
`reward_quality_metrics` defines them once (docs/metrics.md, `reward_quality/*`); both backends
call it through `omgrpo.core.step.step_metrics`. Labels only diagnose here: nothing below
reaches a reward or an advantage. Token-free: rewards, correctness and answer classes only.

The vote's accuracy (TTRL's "label accuracy") is `answers/top_vote_acc`
(`omgrpo.core.diagnostics.answer_diagnostics`): the same quantity, logged once under that name.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from omgrpo.core.losses import zero_spread_rows
from omgrpo.core.means import mean_or_nan, share_or_nan

__all__ = ["pearson_or_nan", "reward_quality_metrics", "zero_spread"]


def zero_spread(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards have zero spread: one or no rollout, or range or std at most
    `ZERO_SPREAD_TOL` (`omgrpo.core.losses.zero_spread_rows`: the groups GRPO gives A = 0)."""
    if len(rewards) < 2:
        return True
    r = torch.as_tensor(np.asarray(rewards, dtype=np.float64))
    return bool(zero_spread_rows(r, torch.zeros(len(r), dtype=torch.long))[0])


def pearson_or_nan(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of `x` and `y`; nan with fewer than 2 pairs or when either is
    constant (`zero_spread`: the correlation is undefined, and rounding noise
    would otherwise give +-1)."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(a) < 2 or zero_spread(a) or zero_spread(b):
        return math.nan
    a, b = a - a.mean(), b - b.mean()
    denom = math.sqrt(float(a @ a) * float(b @ b))
    return float(a @ b) / denom if denom > 0 else math.nan


def reward_quality_metrics(
    rewards: Sequence[Sequence[float]],
    correct: Sequence[Sequence[bool | None]],
    classes: Sequence[Sequence[int | None]],
) -> dict[str, float]:
    """The step's proxy-reward quality, from per-group rewards, correctness (None: no label)
    and answer classes (None: no answer), aligned group by group and rollout by rollout.

    - `reward_quality/reward_acc`: over the labelled rollouts of groups with reward spread, the
      share whose reward is above their group's mean exactly when they are correct (the sign
      of the GRPO advantage agrees with correctness; a reward at the mean counts as "not
      above"). Zero-spread groups give no advantage, so they are left out (their share is
      `zero_spread_groups`). nan without such rollouts.
    - `reward_quality/majority_ratio`: each group's modal answer class (`majority_class`'s tie
      rule: first seen) holds this share of the group's rollouts (0 for a group without
      answers), mean over groups. Label-free.
    - `reward_quality/reward_correct_corr`: Pearson correlation of reward and correctness (1/0)
      over the step's labelled rollouts; nan when either is constant (`pearson_or_nan`).
    - `reward_quality/zero_spread_groups`: share of groups whose rewards have zero spread
      (`zero_spread`). Label-free.
    """
    agree, counted, ratios, flat_r, flat_c, flat_groups = 0, 0, [], [], [], 0
    for r, ok, cls in zip(rewards, correct, classes, strict=True):
        r = [float(x) for x in r]
        counts = Counter(c for c in cls if c is not None)
        ratios.append(counts.most_common(1)[0][1] / len(cls) if counts and cls else 0.0)
        flat_groups += zero_spread(r)
        labelled = [(x, bool(c)) for x, c in zip(r, ok, strict=True) if c is not None]
        flat_r += [x for x, _ in labelled]
        flat_c += [float(c) for _, c in labelled]
        if zero_spread(r) or not labelled:
            continue
        mean = float(np.mean(r))
        agree += sum((x > mean) == c for x, c in labelled)
        counted += len(labelled)
    return {
        "reward_quality/reward_acc": share_or_nan(agree, counted),
        "reward_quality/majority_ratio": mean_or_nan(ratios),
        "reward_quality/reward_correct_corr": pearson_or_nan(flat_r, flat_c),
        "reward_quality/zero_spread_groups": share_or_nan(flat_groups, len(ratios)),
    }
