"""The statistics a pre-registered study's report uses beyond the t-interval (study v4's
"Measures and verdicts", "Time to event", "Multiple comparisons", "Units nested in bases").

- `clopper_pearson`: the exact 95% interval of a share k / n;
- `binomial_p`: the exact binomial test of a share against a threshold, one-sided, on the
  predicted side and on the opposite side;
- `t_p`: the one-sided t-test of a mean against a threshold (`>`, `<`), and for `abs<` the
  larger of the two one-sided tests (TOST) on the predicted side;
- `holm`: Holm's step-down procedure over a family of p-values;
- `median_interval`: the sample median of right-censored times with its distribution-free
  order-statistic interval;
- `stratified`: per-base means and the base-stratified estimate (mean of base means, pooled
  within-base SD).

Every function takes plain numbers (no frames), so each is checked by hand in
tests/analysis/test_study.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = [
    "MedianInterval",
    "binomial_p",
    "clopper_pearson",
    "holm",
    "median_interval",
    "order_statistic_rank",
    "stratified",
    "t_p",
]


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of the share k / n."""
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence, "exact")
    return float(ci.low), float(ci.high)


def binomial_p(k: int, n: int, threshold: float, op: str) -> tuple[float, float]:
    """One-sided exact binomial p-values of k successes in n against the share `threshold`:
    (predicted side, opposite side). `op` `<`: the predicted side is "the share is below the
    threshold", p = P(X <= k); the opposite side p = P(X >= k). `>` the other way round."""
    if op not in (">", "<"):
        raise ValueError(f"a share is tested with > or <, not {op!r}")
    below = float(stats.binom.cdf(k, n, threshold))  # P(X <= k)
    above = float(stats.binom.sf(k - 1, n, threshold))  # P(X >= k)
    return (below, above) if op == "<" else (above, below)


def t_p(values: Sequence[float], op: str, threshold: float) -> tuple[float, float]:
    """One-sided t-test p-values of the mean of `values` against `threshold` on n - 1 degrees
    of freedom: (predicted side, opposite side).

    `>`: predicted p = P(T >= t), t = (mean - threshold) / se; opposite p = P(T <= t).
    `<`: the other way round.
    `abs<` (TOST): predicted p = the larger of the tests of mean > -threshold and
    mean < +threshold; opposite p = the smaller of the tests of mean > +threshold and
    mean < -threshold (the interval lies entirely outside +-threshold on one side or the
    other; both cannot be small at once).
    NaN with fewer than two values; a zero spread gives 0 or 1 (0.5 exactly at the threshold)."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n < 2:
        return math.nan, math.nan
    mean, se, dof = float(x.mean()), float(x.std(ddof=1)) / math.sqrt(n), n - 1

    def above(level: float) -> float:  # p of "the mean is above level"
        if se == 0:
            return 0.0 if mean > level else 1.0 if mean < level else 0.5
        return float(stats.t.sf((mean - level) / se, dof))

    def below(level: float) -> float:  # p of "the mean is below level"
        if se == 0:
            return 0.0 if mean < level else 1.0 if mean > level else 0.5
        return float(stats.t.cdf((mean - level) / se, dof))

    if op == ">":
        return above(threshold), below(threshold)
    if op == "<":
        return below(threshold), above(threshold)
    if op == "abs<":
        inside = max(above(-threshold), below(threshold))
        outside = min(above(threshold), below(-threshold))
        return inside, outside
    raise ValueError(f"unknown op {op!r}")


def holm(pvalues: Mapping[str, float], alpha: float) -> dict[str, tuple[bool, float]]:
    """Holm's step-down procedure at familywise level `alpha`: per hypothesis, (rejected,
    Holm-adjusted p). Sorted ascending, p_(i) is rejected while p_(j) <= alpha / (m - j + 1)
    for every j <= i; the adjusted p is max_{j <= i} min(1, (m - j + 1) p_(j)). A missing
    p-value (NaN: not run, one unit) counts as 1."""
    m = len(pvalues)
    ordered = sorted(pvalues.items(), key=lambda kv: (_or_one(kv[1]), kv[0]))
    out: dict[str, tuple[bool, float]] = {}
    running, rejecting = 0.0, True
    for i, (name, p) in enumerate(ordered):
        p = _or_one(p)
        rejecting = rejecting and p <= alpha / (m - i)
        running = max(running, min(1.0, (m - i) * p))
        out[name] = (rejecting, running)
    return out


def _or_one(p: float | None) -> float:
    return 1.0 if p is None or math.isnan(p) else float(p)


def order_statistic_rank(n: int, confidence: float = 0.95) -> tuple[int, float]:
    """The rank r of the distribution-free interval [X_(r), X_(n-r+1)] for the median of n
    values and its coverage 1 - 2 P(Bin(n, 1/2) <= r - 1): the largest r whose coverage is at
    least `confidence`, else r = 1 with the coverage it has (n = 6: r = 1, 96.9%;
    n = 5: 93.8%, below 95%)."""
    best = (1, 1.0 - 2.0 * float(stats.binom.cdf(0, n, 0.5)))
    for r in range(1, n // 2 + 1):
        coverage = 1.0 - 2.0 * float(stats.binom.cdf(r - 1, n, 0.5))
        if coverage >= confidence:
            best = (r, coverage)
    return best


@dataclass(frozen=True)
class MedianInterval:
    """The median of right-censored times and its order-statistic interval, as text: a
    censored bound reads "> <censor>" (or "> x" where the median is known only to exceed x)."""

    median: str
    low: str
    high: str
    coverage: float
    n: int


def median_interval(
    times: Sequence[float | None], censor: int, confidence: float = 0.95
) -> MedianInterval:
    """`times`: one per unit, None where the event had not happened by `censor` (right-
    censored; every unit is followed to `censor`, so a censored unit is later than any event).
    The median of an even n averages the two middle values; where the upper one is censored
    the median is only known to exceed (x + censor) / 2."""
    n = len(times)
    if n == 0:
        return MedianInterval("–", "–", "–", math.nan, 0)
    ordered = sorted(math.inf if t is None else float(t) for t in times)
    r, coverage = order_statistic_rank(n, confidence)

    def text(value: float) -> str:
        return f"> {censor}" if math.isinf(value) else f"{value:g}"

    if n % 2:
        median = text(ordered[n // 2])
    else:
        lo, hi = ordered[n // 2 - 1], ordered[n // 2]
        if math.isinf(lo):
            median = f"> {censor}"
        elif math.isinf(hi):
            median = f"> {(lo + censor) / 2:g}"
        else:
            median = f"{(lo + hi) / 2:g}"
    return MedianInterval(median, text(ordered[r - 1]), text(ordered[n - r]), coverage, n)


def stratified(by_base: Mapping[str, Sequence[float]]) -> dict:
    """Per base: n, mean and 95% t-interval (n_b - 1 df); and the base-stratified estimate: the
    mean of the base means with the pooled within-base SD on n - B degrees of freedom (se =
    s_pooled * sqrt(sum 1 / n_b) / B). Bases with fewer than two values give no interval."""
    from omgrpo.analysis.load import t_critical

    bases: dict[str, dict] = {}
    squares, dof = 0.0, 0
    for base, values in by_base.items():
        x = np.asarray(values, dtype=float)
        mean = float(x.mean()) if len(x) else math.nan
        ci = None
        if len(x) >= 2:
            half = t_critical(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
            ci = (mean - half, mean + half)
            squares += float(((x - mean) ** 2).sum())
            dof += len(x) - 1
        bases[base] = {"n": len(x), "mean": mean, "ci95": ci}
    means = [b["mean"] for b in bases.values() if b["n"]]
    estimate = float(np.mean(means)) if means else math.nan
    ci = None
    if dof >= 1 and means:
        pooled = math.sqrt(squares / dof)
        se = pooled * math.sqrt(sum(1 / b["n"] for b in bases.values() if b["n"])) / len(means)
        half = t_critical(dof) * se
        ci = (estimate - half, estimate + half)
    return {"bases": bases, "estimate": estimate, "ci95": ci, "dof": dof}
