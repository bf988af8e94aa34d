"""avg@k and pass@k of graded samples, the one definition of each: native and verl validation,
the toy base checks and `omgrpo eval` all read them from here.

`correct[i]` holds the graded samples of problem i (bools, or 0/1 scores):
- avg@k   each problem's mean correctness over its samples (the paper's "avg@16": 16 samples,
          averaged), then averaged over problems;
- pass@k  chance that at least one of k samples drawn without replacement from a problem's n
          is correct, the unbiased estimator of Chen et al. (2021):
          1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i);
          with k = n (the default) it is 1.0 if any sample is correct, else 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

__all__ = ["avg_at_k", "mean_pass_at_k", "pass_at_k", "per_problem_avg", "per_problem_pass"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem (n samples, c correct, 1 <= k <= n)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def per_problem_avg(correct: Sequence[Sequence[float]]) -> np.ndarray:
    """Each problem's mean correctness over its samples (length P)."""
    return np.array([np.mean(c) for c in correct], dtype=float)


def per_problem_pass(correct: Sequence[Sequence[bool]], k: int | None = None) -> np.ndarray:
    """Each problem's pass@k (length P); k = None: each problem's own number of samples."""
    return np.array(
        [pass_at_k(len(c), int(np.count_nonzero(c)), k or len(c)) for c in correct], dtype=float
    )


def avg_at_k(
    correct: Sequence[Sequence[float]], per: Literal["problem", "sample"] = "problem"
) -> float:
    """avg@k. `per="problem"`: the mean of `per_problem_avg` (validation, eval);
    `per="sample"`: the share of all samples that are correct (the toy base checks). Both are
    the same number when every problem has k samples, up to the last bit of rounding."""
    if per == "sample":
        return sum(int(np.count_nonzero(c)) for c in correct) / sum(len(c) for c in correct)
    return float(np.mean(per_problem_avg(correct)))


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int | None = None) -> float:
    """pass@k averaged over problems (k = None: each problem's own number of samples, so the
    share of problems with at least one correct sample)."""
    return float(np.mean(per_problem_pass(correct, k)))
