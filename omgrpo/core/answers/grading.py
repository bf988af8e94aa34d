"""Equivalence and clustering of final answers, under a `Grader` created per stage.

Equivalence is exact: plain arithmetic is evaluated as rationals in-process
(`omgrpo.core.answers.exact`, which also states the one tolerance rule: a decimal with ≥ 6
significant digits approximates a non-decimal value within one unit of its last digit, so
``0.333333`` ≈ ``\\frac13``); other numbers are compared exactly with sympy, and sets, intervals,
equations and expressions by math-verify, both in a killable worker process
(`omgrpo.core.answers.worker`). Time is bounded: answers longer than ``MAX_ANSWER_CHARS`` are
not parsed, and worker calls draw from the budget of the `Grader` passed in (one per training
step, one per validation, eval or CAR stage); past it, pairs fall back to normalised-string
identity and are counted (`Grader.timeouts`, logged as ``answers/grading_timeouts``).
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from omgrpo.core.answers import worker
from omgrpo.core.answers.exact import PLAIN_NUMBER, decimal_ulp, exact_value, values_match
from omgrpo.core.answers.normalize import MAX_ANSWER_CHARS, normalize
from omgrpo.core.answers.worker import Side

__all__ = [
    "DEFAULT_GRADING_BUDGET_S",
    "DEFAULT_PAIR_TIMEOUT_S",
    "Grader",
    "cluster",
    "equivalent",
]

logger = logging.getLogger(__name__)

DEFAULT_GRADING_BUDGET_S = 10.0
"""Seconds of math-verify work one `Grader` allows by default (`reward.grading_budget_s`)."""
DEFAULT_PAIR_TIMEOUT_S = 5.0
"""Seconds one answer pair may take in the worker by default (`reward.equivalence_timeout`)."""
_RESULT_GRACE_S = 0.2  # waiting this much past a task's timeout lets pebble's own timeout fire


@dataclass
class Grader:
    """The grading policy and budget of one stage (a training step's scoring, a validation, an
    eval, a CAR clustering), passed explicitly to `equivalent` and `cluster`.

    Each math-verify call is charged its wall time (a worker restart after a kill included) and
    may run at most ``min(pair_timeout, seconds left)``. Once `budget_s` is spent, undecided
    pairs fall back to normalised-string identity (not equivalent) and count in `timeouts`, as
    do pairs whose call timed out. With `math_verify` off only normalised / exact equality
    count. A stage that needs a fresh budget creates a new Grader; nothing carries over.
    """

    budget_s: float = DEFAULT_GRADING_BUDGET_S
    pair_timeout: float = DEFAULT_PAIR_TIMEOUT_S
    math_verify: bool = True
    spent: float = 0.0
    timeouts: int = 0

    @classmethod
    def from_config(cls, reward: Any) -> Grader:
        """A fresh grader with `reward.grading_budget_s`, `reward.equivalence_timeout` and
        `reward.math_verify` (`RewardConfig`, or verl's `omgrpo.reward` section)."""
        return cls(
            budget_s=float(reward.grading_budget_s),
            pair_timeout=float(reward.equivalence_timeout),
            math_verify=bool(reward.math_verify),
        )

    def left(self) -> float:
        return self.budget_s - self.spent

    def warm_up(self) -> None:
        """Start the worker's sympy / math-verify import in the background (no-op when off)."""
        if self.math_verify:
            worker.start_grader_warm_up()


def _worker_equal(x: Side, y: Side, grader: Grader) -> bool:
    """Ask the worker within the grader's budget; a timeout (or no budget left) counts and
    gives False.

    Outcomes are memoised per pair process-wide; a pair that timed out with the full pair
    timeout is not tried again (it still counts as a timeout each time it is asked).
    """
    key = (x, y)
    outcome = worker.cached_outcome(key)
    if outcome is not worker.MISSING:
        grader.timeouts += outcome is None
        return bool(outcome)
    if grader.left() <= 0:
        grader.timeouts += 1
        return False
    t0 = time.monotonic()
    future, wait = None, 0.0
    try:
        pool = worker.get_pool(grader.left())
        wait = min(grader.pair_timeout, grader.left() - (time.monotonic() - t0))
        if pool is None or wait <= 0:
            raise TimeoutError
        future = pool.schedule(worker.mv_worker, args=(x, y), timeout=wait)
        outcome = bool(future.result(timeout=wait + _RESULT_GRACE_S))
    except (TimeoutError, futures.TimeoutError):
        if future is not None:
            future.cancel()
        logger.debug("math-verify gave up after %.1fs on %r vs %r", wait, x[0], y[0])
        grader.timeouts += 1
        if wait >= grader.pair_timeout:
            worker.remember(key, None)
        return False
    except Exception:  # worker crash (pebble replaces it), pickling error, ...
        logger.debug("math-verify failed on %r vs %r", x[0], y[0], exc_info=True)
        outcome = False
    finally:
        grader.spent += time.monotonic() - t0
    worker.remember(key, outcome)
    return outcome


_exact_value = functools.lru_cache(maxsize=100_000)(exact_value)


def _side(s: str, other: str) -> Side:
    ulp = None if PLAIN_NUMBER.fullmatch(other) else decimal_ulp(s)
    return (s, _exact_value(s), ulp)


def _equal(x: str, y: str, grader: Grader) -> bool:
    """Equivalence of two normalised answers (see `equivalent`)."""
    if x == y:
        return True
    if not x or not y or len(x) > MAX_ANSWER_CHARS or len(y) > MAX_ANSWER_CHARS:
        return False
    if PLAIN_NUMBER.fullmatch(x) and PLAIN_NUMBER.fullmatch(y):  # two literals: exact
        return _exact_value(x) == _exact_value(y)
    sx, sy = _side(x, y), _side(y, x)
    if sx[1] is not None and sy[1] is not None:
        return values_match(sx[1], sx[2], sy[1], sy[2])
    if not grader.math_verify:
        return False
    if x > y:  # one order per pair: a symmetric relation and one cache entry
        sx, sy = sy, sx
    return _worker_equal(sx, sy, grader)


def _safe_equal(x: str, y: str, grader: Grader) -> bool:
    try:
        return _equal(x, y, grader)
    except Exception:
        logger.debug("equivalent failed", exc_info=True)
        return False


def equivalent(a: str, b: str, grader: Grader) -> bool:
    """Whether two final answers denote the same value. Never raises.

    1. equal after :func:`normalize` → True; answers over ``MAX_ANSWER_CHARS`` stop here;
    2. both plain arithmetic (integers, decimals, fractions, integer powers, scientific
       notation) → exact rational comparison plus the decimal rule of `exact`, final;
    3. otherwise (if ``grader.math_verify``) sympy / math-verify in a killable worker process:
       numbers compared exactly, other objects by math-verify (both orders), within the
       grader's budget.

    The worker is forked where the platform allows it; elsewhere (macOS, Windows) it is spawned,
    which re-imports the caller's ``__main__``: entry-point scripts there need an
    ``if __name__ == "__main__":`` guard.
    """
    return _safe_equal(normalize(a), normalize(b), grader)


def cluster(answers: list[str | None], grader: Grader) -> list[int | None]:
    """Equivalence-class ids in order of first appearance (None stays None).

    Each answer is compared against one representative per existing class (the first member),
    i.e. equivalence is treated as transitive via representatives: an answer joins the first
    class whose representative it matches, even if it would not match other members. All pairs
    draw from `grader`'s budget.
    """
    ids: list[int | None] = []
    by_norm: dict[str, int] = {}
    reps: list[str] = []  # normalised representative of each class, by class id
    for ans in answers:
        if ans is None:
            ids.append(None)
            continue
        norm = normalize(ans)
        cid = by_norm.get(norm)
        if cid is None:
            cid = next((k for k, rep in enumerate(reps) if _safe_equal(rep, norm, grader)), None)
            if cid is None:
                cid = len(reps)
                reps.append(norm)
            by_norm[norm] = cid
        ids.append(cid)
    return ids
