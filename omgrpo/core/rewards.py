"""Rewards: a registry of pure functions over one group of rollouts (the G answers of a prompt).

A reward function takes a `RewardGroup` and returns one float per rollout. A reward config is a
weighted sum of named parts (`reward.parts`, `reward.weights`); `compute_rewards` returns the
total and every part so each is logged as `reward/<part>`.

| name            | reward of rollout i                                                      |
|-----------------|--------------------------------------------------------------------------|
| gt              | 1 if z_i is equivalent to the label (supervised oracle)                  |
| majority_vote   | 1 if z_i is in the group's most frequent answer class (hard vote)         |
| soft_vote       | share of the answer pool equivalent to z_i (paper §3.1; CAR enlarges it)  |
| format          | 1 if a `\\boxed{}` answer could be extracted (paper §3.1)                 |
| self_certainty  | mean over response tokens of KL(Uniform || pi) (Intuitor)               |
| entropy         | minus the mean token entropy on the answer span                          |
| coreward        | 1 if z_i matches the majority answer of the paraphrased question's group |
| process         | the PRM's aggregated step scores (`omgrpo.core.process`; unscored: group mean) |

A rollout without an extracted answer casts no vote and gets 0 from every vote-based reward and
from `format`; it never raises. Answers are compared with `omgrpo.core.answers` (exact equivalence)
under the `Grader` passed to `make_group` (the stage's: one per training step).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from omgrpo.core.answers import Grader, cluster, equivalent


@dataclass(frozen=True)
class RewardGroup:
    """One prompt's rollouts as the reward functions see them.

    `classes`, `pool_classes` and `partner_classes` share one id space (equivalence classes over
    all answers involved), so comparisons are integer equality. Build it with `make_group`.
    """

    answers: list[str | None]
    """z_i: extracted answers of the G rollouts (None: no boxed answer)."""
    classes: list[int | None]
    """Equivalence-class id of each rollout's answer."""
    label: str | None = None
    """Ground truth, if known (only `gt` trains on it; diagnostics may read it)."""
    pool_classes: list[int | None] | None = None
    """Extra voters in the soft-vote pool (CAR's pairwise answers); never trained on."""
    partner_classes: list[int | None] | None = None
    """CoReward: classes of the paraphrased question's rollouts."""
    self_certainty: list[float] | None = None
    """Per-rollout mean self-certainty of the response tokens."""
    answer_entropy: list[float | None] | None = None
    """Per-rollout mean token entropy on the answer span (None: no answer)."""
    max_entropy: float = 0.0
    """log(vocab size): the entropy given to rollouts without an answer span."""
    process: list[float | None] | None = None
    """Per-rollout aggregated PRM step scores (None: left unscored by the PRM's time budget)."""
    grader: Grader = field(default_factory=Grader, repr=False, compare=False)
    """The grader the classes were built with (`gt` compares answers to the label with it)."""

    @property
    def size(self) -> int:
        return len(self.answers)


def make_group(
    answers: Sequence[str | None],
    label: str | None = None,
    pool: Sequence[str | None] | None = None,
    partner: Sequence[str | None] | None = None,
    self_certainty: Sequence[float] | None = None,
    answer_entropy: Sequence[float | None] | None = None,
    max_entropy: float = 0.0,
    grader: Grader | None = None,
    process: Sequence[float | None] | None = None,
) -> RewardGroup:
    """Cluster the group's answers, the pool and the partner answers in one id space, with the
    stage's `grader` (default: a fresh default `Grader` for this group alone)."""
    grader = grader if grader is not None else Grader()
    answers = list(answers)
    pool = list(pool) if pool is not None else None
    partner = list(partner) if partner is not None else None
    ids = cluster(answers + (pool or []) + (partner or []), grader)
    g, p = len(answers), len(pool or [])
    return RewardGroup(
        answers=answers,
        classes=ids[:g],
        label=label,
        pool_classes=ids[g : g + p] if pool is not None else None,
        partner_classes=ids[g + p :] if partner is not None else None,
        self_certainty=list(self_certainty) if self_certainty is not None else None,
        answer_entropy=list(answer_entropy) if answer_entropy is not None else None,
        max_entropy=max_entropy,
        grader=grader,
        process=list(process) if process is not None else None,
    )


def majority_class(classes: Sequence[int | None]) -> int | None:
    """Most frequent non-None class. Tie rule: among tied classes, the one whose first
    occurrence comes first in the group (as `Counter.most_common`, used by TTRL)."""
    counts = Counter(c for c in classes if c is not None)
    if not counts:
        return None
    return counts.most_common(1)[0][0]


RewardFn = Callable[[RewardGroup], list[float]]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward '{name}'; valid rewards: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


@register_reward("gt")
def gt_reward(group: RewardGroup) -> list[float]:
    """1 if the answer is equivalent to the label (math-verify evaluates `2+2` to 4), else 0.

    >>> gt_reward(make_group(["4", "2+2", "5", None], label="4"))
    [1.0, 1.0, 0.0, 0.0]
    """
    if group.label is None:
        raise ValueError("reward 'gt' needs labels, but this problem has none")
    return [
        float(a is not None and equivalent(a, group.label, group.grader)) for a in group.answers
    ]


@register_reward("majority_vote")
def majority_vote_reward(group: RewardGroup) -> list[float]:
    """1 if the answer is in the group's majority class (see `majority_class` for ties).

    >>> majority_vote_reward(make_group(["3", "5", "3.0", None]))
    [1.0, 0.0, 1.0, 0.0]
    """
    top = majority_class(group.classes)
    return [float(c is not None and c == top) for c in group.classes]


@register_reward("soft_vote")
def soft_vote_reward(group: RewardGroup) -> list[float]:
    """Share of the answer pool equivalent to this rollout's answer (paper §3.1, §3.3).

    The pool is the group's extracted answers plus `pool_classes` (CAR); rollouts and pool
    entries without an answer are not voters (they are not in the denominator).

    >>> soft_vote_reward(make_group(["3", "5", "3.0", None]))
    [0.6666666666666666, 0.3333333333333333, 0.6666666666666666, 0.0]
    """
    voters = [c for c in group.classes + (group.pool_classes or []) if c is not None]
    if not voters:
        return [0.0] * group.size
    counts = Counter(voters)
    return [0.0 if c is None else counts[c] / len(voters) for c in group.classes]


def format_score(answer: str | None) -> float:
    """The format reward of one extracted answer: 1.0 if there is one, else 0.0.

    >>> format_score("3"), format_score(None)
    (1.0, 0.0)
    """
    return float(answer is not None)


@register_reward("format")
def format_reward(group: RewardGroup) -> list[float]:
    """1 if a boxed answer could be extracted.

    >>> format_reward(make_group(["3", None]))
    [1.0, 0.0]
    """
    return [format_score(a) for a in group.answers]


@register_reward("self_certainty")
def self_certainty_reward(group: RewardGroup) -> list[float]:
    """Intuitor's self-certainty: mean over response tokens of KL(U || pi(.|q, o_<t)).

    >>> self_certainty_reward(make_group(["1", None], self_certainty=[0.5, 2.0]))
    [0.5, 2.0]
    """
    if group.self_certainty is None:
        raise ValueError("reward 'self_certainty' needs per-rollout self-certainty values")
    return [float(x) for x in group.self_certainty]


@register_reward("entropy")
def entropy_reward(group: RewardGroup) -> list[float]:
    """Negative mean token entropy on the answer span; no answer span gets -log(V), the worst
    value, so the reward cannot be gamed by omitting the answer.

    >>> entropy_reward(make_group(["1", None], answer_entropy=[0.25, None], max_entropy=4.0))
    [-0.25, -4.0]
    """
    if group.answer_entropy is None:
        raise ValueError("reward 'entropy' needs per-rollout answer-span entropies")
    return [-group.max_entropy if h is None else -float(h) for h in group.answer_entropy]


@register_reward("coreward")
def coreward_reward(group: RewardGroup) -> list[float]:
    """1 if the answer matches the majority answer of the paraphrase's rollouts (cross-consensus).

    >>> coreward_reward(make_group(["3", "4"], partner=["4", "4", "3"]))
    [0.0, 1.0]
    """
    if group.partner_classes is None:
        raise ValueError("reward 'coreward' needs the paraphrased question's answers")
    top = majority_class(group.partner_classes)
    return [float(c is not None and c == top) for c in group.classes]


@register_reward("process")
def process_reward(group: RewardGroup) -> list[float]:
    """The PRM's aggregated step scores; a rollout the PRM's time budget left unscored gets the
    mean of its group's scored rollouts (advantage 0: neither pushed up nor down), or 0 when
    none of the group was scored.

    >>> process_reward(make_group(["1", None, "2"], process=[0.25, 0.75, None]))
    [0.25, 0.75, 0.5]
    """
    if group.process is None:
        raise ValueError("reward 'process' needs the PRM's scores (reward.prm)")
    scored = [s for s in group.process if s is not None]
    fill = float(np.mean(scored)) if scored else 0.0
    return [fill if s is None else float(s) for s in group.process]


def compute_rewards(
    groups: Sequence[RewardGroup], parts: Sequence[str], weights: dict[str, float] | None = None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Weighted sum of the named parts over a batch of groups (rollouts in group order).

    Returns (total (B,), {part: (B,)}) with B = sum of group sizes.
    """
    if not parts:
        raise ValueError("reward.parts is empty; name at least one of: " + ", ".join(REWARDS))
    weights = dict(weights or {})
    unknown = set(weights) - set(parts)
    if unknown:
        raise ValueError(f"reward.weights names {sorted(unknown)} which are not in reward.parts")
    fns = {name: get_reward(name) for name in parts}
    values = {
        name: np.array([r for g in groups for r in fn(g)], dtype=np.float64)
        for name, fn in fns.items()
    }
    total = sum(weights.get(name, 1.0) * v for name, v in values.items())
    return np.asarray(total, dtype=np.float64), values
