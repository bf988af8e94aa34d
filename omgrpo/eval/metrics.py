"""Benchmark metrics from a table of graded samples (pure functions over numpy arrays).

Per problem with n samples of which c are correct:
- avg@n, pass@k  as `omgrpo.core.accuracy` defines them (mean correctness of the n samples;
          the unbiased estimator of pass@k);
- maj@k   whether the most common answer among the first k samples (equivalence classes of
          `omgrpo.core.answers.cluster`; ties go to the class seen first) is correct;
- extraction rate: share of samples with a `\\boxed{}` answer.
Each is averaged over problems; `bootstrap_ci` resamples problems for a 95% interval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omgrpo.core.accuracy import per_problem_avg, per_problem_pass
from omgrpo.core.rewards import majority_class


def majority_correct(classes: Sequence[int | None], correct: Sequence[bool]) -> bool:
    """Whether the most common answer class is correct (no answer at all: False); the vote is
    training's (`omgrpo.core.rewards.majority_class`, ties to the class seen first)."""
    winner = majority_class(classes)
    if winner is None:
        return False
    return bool(correct[list(classes).index(winner)])


def ks_up_to(n: int) -> list[int]:
    """The k reported for maj@k: powers of two below n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def per_problem_scores(
    correct: Sequence[Sequence[bool]],
    classes: Sequence[Sequence[int | None]],
) -> dict[str, np.ndarray]:
    """Metric name -> score per problem (arrays of length P). Every problem needs the same
    number of samples n; pass@k for every k <= n, maj@k for `ks_up_to(n)`."""
    sizes = {len(c) for c in correct}
    if len(sizes) != 1:
        raise ValueError(f"every problem needs the same number of samples, got {sorted(sizes)}")
    n = sizes.pop()
    if n == 0:
        raise ValueError("no samples per problem")
    right = np.array([[bool(x) for x in row] for row in correct])
    scores: dict[str, np.ndarray] = {f"avg@{n}": per_problem_avg(right)}
    for k in range(1, n + 1):
        scores[f"pass@{k}"] = per_problem_pass(right, k)
    for k in ks_up_to(n):
        scores[f"maj@{k}"] = np.array(
            [majority_correct(cls[:k], row[:k]) for cls, row in zip(classes, right)], dtype=float
        )
    scores["extract_rate"] = np.array(
        [np.mean([c is not None for c in cls]) for cls in classes], dtype=float
    )
    return scores


def bootstrap_ci(
    scores: dict[str, np.ndarray], n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap interval of each metric's mean over problems (`scipy.stats.bootstrap`,
    method='percentile'; problems resampled with replacement, the same resamples for every
    metric, deterministic by `seed`)."""
    from scipy import stats

    names = list(scores)
    matrix = np.stack([np.asarray(scores[m], dtype=float) for m in names], axis=1)  # (P, M)
    if matrix.shape[0] < 2:  # scipy needs two observations; one problem has a point interval
        return {m: (float(v), float(v)) for m, v in zip(names, matrix.mean(axis=0))}
    res = stats.bootstrap(
        (matrix,),
        lambda x, axis: x.mean(axis=axis),
        n_resamples=n_boot,
        confidence_level=level,
        method="percentile",
        axis=0,
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    lo, hi = res.confidence_interval
    return {m: (float(a), float(b)) for m, a, b in zip(names, lo, hi)}


def summarize(
    correct: Sequence[Sequence[bool]],
    classes: Sequence[Sequence[int | None]],
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, dict[str, float | list[float]]]:
    """{"metrics": name -> mean over problems, "ci95": name -> [low, high]}."""
    scores = per_problem_scores(correct, classes)
    ci = bootstrap_ci(scores, n_boot=n_boot, seed=seed)
    return {
        "metrics": {m: float(v.mean()) for m, v in scores.items()},
        "ci95": {m: list(ci[m]) for m in scores},
    }
