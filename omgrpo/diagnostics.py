"""Collapse diagnostics computed from one step's rollouts (labels, where known, only diagnose).

Pure functions over the step's answers; the metric names are the contract with trackers and
analysis (see the README's metric table).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from omgrpo.answers import normalize
from omgrpo.rewards import RewardGroup, majority_class


def answer_diagnostics(
    groups: Sequence[RewardGroup], correct: Sequence[Sequence[bool | None]]
) -> dict[str, float]:
    """Answer diversity and vote statistics of a batch of groups.

    `correct[g][i]` is whether rollout i of group g matches the label (None: no label).
    - `answers/unique_per_prompt`: mean number of distinct answer classes per group
    - `answers/unique_per_batch`: distinct (normalised) answers over the whole batch
    - `answers/batch_mode_share`: share of all rollouts giving the batch's most common answer
      (the paper's "predicted-1 share"); `answers/batch_mode` is that answer
    - `answers/vote_entropy`: mean entropy (nats) of each group's answer distribution
    - `answers/extract_rate`: share of rollouts with an extractable boxed answer
    - `answers/top_vote_acc`: share of labelled groups whose majority answer is correct
    - `acc/train`: share of labelled rollouts that are correct
    """
    n_rollouts = sum(g.size for g in groups)
    extracted = [a for g in groups for a in g.answers if a is not None]
    batch_counts = Counter(normalize(a) for a in extracted)
    mode, mode_count = batch_counts.most_common(1)[0] if batch_counts else (None, 0)

    unique, entropies, top_hits, labelled = [], [], 0, 0
    for g, ok in zip(groups, correct):
        counts = Counter(c for c in g.classes if c is not None)
        unique.append(len(counts))
        total = sum(counts.values())
        entropies.append(
            -sum(n / total * math.log(n / total) for n in counts.values()) if total else 0.0
        )
        top = majority_class(g.classes)
        if g.label is not None:
            labelled += 1
            top_hits += top is not None and bool(ok[g.classes.index(top)])
    flat = [c for ok in correct for c in ok if c is not None]
    return {
        "answers/unique_per_prompt": _mean(unique),
        "answers/unique_per_batch": float(len(batch_counts)),
        "answers/batch_mode": mode if mode is not None else "",
        "answers/batch_mode_share": mode_count / n_rollouts if n_rollouts else 0.0,
        "answers/vote_entropy": _mean(entropies),
        "answers/extract_rate": len(extracted) / n_rollouts if n_rollouts else 0.0,
        "answers/top_vote_acc": top_hits / labelled if labelled else float("nan"),
        "acc/train": _mean([float(c) for c in flat]) if flat else float("nan"),
    }


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0
