"""The empty-set convention of every logged mean and share: nan for a mean of nothing.

A mean over no items is undefined, and a logged 0.0 would read as a measured zero (no guesses,
no consistency) in a plot or a table; nan is skipped by the trackers and by pandas' means.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["mean_or_nan", "share_or_nan"]


def mean_or_nan(xs: Iterable[float]) -> float:
    """The mean of `xs`; nan when `xs` is empty."""
    values = list(xs)
    return float(sum(values) / len(values)) if values else float("nan")


def share_or_nan(hits: float, n: float) -> float:
    """`hits / n`; nan when `n` is 0 (a share of nothing)."""
    return hits / n if n else float("nan")
