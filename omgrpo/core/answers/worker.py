"""The math-verify worker: sympy / math-verify run in a killable pool process.

Process-wide state lives here on purpose: the worker pool (one per process, forked after a
background warm-up) and a memo of decided pairs. Neither holds per-stage policy: budgets, pair
timeouts and the math-verify switch belong to a `Grader`, which each stage creates and passes
explicitly. A cached outcome is a pure function of the pair, whatever stage asked first.
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import os
import re
import threading
from fractions import Fraction
from typing import Any

from omgrpo.core.answers.exact import values_match

__all__ = [
    "MISSING",
    "Side",
    "cached_outcome",
    "get_pool",
    "mv_worker",
    "remember",
    "start_grader_warm_up",
]

logger = logging.getLogger(__name__)

# One answer as the worker sees it: normalised text, exact value (if plain arithmetic), and the
# unit of its last digit if the decimal rule of `omgrpo.core.answers.exact` applies to it.
Side = tuple[str, Fraction | None, Fraction | None]

_POOL: Any = None
_POOL_PID: int | None = None
_POOL_LOCK = threading.Lock()
_FORK = "fork" in multiprocessing.get_all_start_methods()
_WARM: dict[int, threading.Event] = {}  # pid -> set once this process has warmed up sympy
_PAIR_CACHE: dict[tuple[Side, Side], bool | None] = {}  # None: timed out with a full timeout
_PAIR_CACHE_SIZE = 100_000


# ---- worker side (runs in the pool process; sympy / math-verify are imported only there) ----


def _mv_init() -> None:
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" warnings
    import math_verify.grader

    # math-verify rounds floats to 6 places and chops differences below ~1e-15 when it compares
    # numbers (so 1/2^99 "equals" 1/2^98, also inside sets, intervals and equations): compare
    # numbers exactly instead.
    math_verify.grader.sympy_numeric_eq = _mv_numeric_eq


_NOT_ALNUM = re.compile(r"[^0-9A-Za-z]+")


@functools.lru_cache(maxsize=4096)
def _mv_parse(text: str) -> tuple[Any, ...]:
    """math-verify's reading of a whole answer; () if it reads nothing or only a piece of it
    (it extracts ``9`` from ``9ab`` and ``1,2,3`` from ``1,2,3,\\ldots``)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    parsed = parse(f"${text}$", extraction_config=config, parsing_timeout=None)
    if len(parsed) == 2 and isinstance(parsed[1], str):
        read, whole = _NOT_ALNUM.sub("", parsed[1]), _NOT_ALNUM.sub("", text)
        if read != whole and read in whole:  # its match is a strict piece of the answer
            return ()
    return tuple(parsed)


def mv_worker(x: Side, y: Side) -> bool:
    """Whether two answers are equal, decided with sympy / math-verify (in the pool worker).

    Numbers (no free symbols) are compared exactly (`_sympy_numbers_equal`); everything else
    (sets, intervals, equations, expressions) by math-verify's `verify` in both orders
    (`_symmetric_verify`). math-verify's own SIGALRM timeouts are disabled: pebble kills the
    worker instead.
    """
    px, py = _mv_parse(x[0]), _mv_parse(y[0])
    if not px or not py:
        return False
    a, b = _sympy_value(px[0], x[1]), _sympy_value(py[0], y[1])
    if _is_number(a) and _is_number(b):
        return _sympy_numbers_equal(a, x[2], b, y[2])
    return _symmetric_verify(list(px), list(py))


def _symmetric_verify(gx: list[Any], gy: list[Any]) -> bool:
    """math-verify's `verify` made symmetric without merging what either order tells apart.

    `verify(gold, pred)` is one-sided on purpose: it reads a predicted equation by its right
    side only (so pred ``a + 3z = 0`` "equals" gold ``0``) and a predicted set against a gold
    tuple as a set (``\\{1, 3\\}`` "equals" ``(3, 1)``). Clustering needs a symmetric relation
    that never merges distinct answers, so both orders must agree; the one exception is an
    inequality against a set or interval (``0 < x < 1`` and ``(0, 1)``), which math-verify only
    compares with the inequality as gold. An equation thus equals a bare value only where
    math-verify reads it as an assignment in both orders: a left side of symbols alone
    (``x = 5``, ``f(x) = 1``, ``(p, q) = (3, 2)``, and so ``a + b = 0`` against ``0``).
    """
    from math_verify import verify

    forward = verify(gx, gy, timeout_seconds=None)
    if forward == verify(gy, gx, timeout_seconds=None):
        return bool(forward)
    return _inequality_and_set(gx[0], gy[0]) or _inequality_and_set(gy[0], gx[0])


def _inequality_and_set(a: Any, b: Any) -> bool:
    """`a` an inequality (or a chain of them, not an equation or a membership), `b` a set."""
    import sympy
    from math_verify.grader import is_equation, is_relation

    return is_relation(a) and not is_equation(a) and isinstance(b, sympy.Set)


def _sympy_value(parsed: Any, exact: Fraction | None) -> Any:
    import sympy

    if exact is not None:
        return sympy.Rational(exact.numerator, exact.denominator)
    return parsed


def _is_number(v: Any) -> bool:
    import sympy

    return isinstance(v, sympy.Expr) and bool(v.is_number)


def _exact_sympy(v: Any) -> Any:
    """Floats become the rational their decimal digits say; unevaluated arithmetic is evaluated."""
    import sympy

    if isinstance(v, sympy.Float):
        return sympy.Rational(str(v))
    return v.doit()


def _sympy_numbers_equal(a: Any, a_ulp: Fraction | None, b: Any, b_ulp: Fraction | None) -> bool:
    """Two sympy numbers: exact for rationals, the decimal rule for a decimal approximation, and
    otherwise distinct unless they agree to 40 significant digits and sympy cannot prove them
    different (``(a - b).equals(0)``)."""
    import sympy

    a, b = _exact_sympy(a), _exact_sympy(b)
    if not (a.is_finite and b.is_finite):  # infinities, nan, or finiteness unknown
        # only a signed infinity equals itself: `12:00` and `1:00` both read as 1/0 (zoo)
        return bool(a == b) and a.is_extended_real is True
    if a.is_Rational and b.is_Rational:
        return values_match(
            Fraction(int(a.p), int(a.q)), a_ulp, Fraction(int(b.p), int(b.q)), b_ulp
        )
    if a_ulp is not None or b_ulp is not None:  # decimal approximation of an irrational value
        approx, ulp, other = (a, a_ulp, b) if a_ulp is not None else (b, b_ulp, a)
        return bool(
            abs(sympy.N(other - approx, 30)) < sympy.Rational(ulp.numerator, ulp.denominator)
        )
    diff = a - b
    scale = max(abs(sympy.N(a, 20)), abs(sympy.N(b, 20)))
    if abs(sympy.N(diff, 50)) > scale * sympy.Rational(1, 10**40):
        return False
    return diff.equals(0) is not False


def _mv_numeric_eq(a: Any, b: Any, float_rounding: int, numeric_precision: int) -> bool:
    """Exact stand-in for `math_verify.grader.sympy_numeric_eq` (same signature)."""
    from sympy import MatrixBase

    if isinstance(a, MatrixBase) and isinstance(b, MatrixBase):
        return a.shape == b.shape and all(
            _mv_numeric_eq(x, y, float_rounding, numeric_precision) for x, y in zip(a, b)
        )
    if _is_number(a) and _is_number(b):
        return _sympy_numbers_equal(a, None, b, None)
    return False  # expressions with symbols: math-verify's symbolic check decides


# ---- main-process side ----


def _shutdown_pool() -> None:
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None and os.getpid() == _POOL_PID:  # never touch a fork-inherited pool
        try:
            pool.stop()
            pool.join(timeout=5)
        except Exception:
            pass


def _warm_up() -> None:
    """Import and exercise sympy / math-verify in this process (~2-5 s), so that every worker
    forked from it afterwards, restarts after a kill included, is ready in milliseconds."""
    try:
        _mv_init()
        mv_worker(("x+1", None, None), ("1+x", None, None))
    except Exception:
        logger.warning("math-verify warm-up failed", exc_info=True)
    finally:
        _WARM[os.getpid()].set()


def start_grader_warm_up() -> threading.Event | None:
    """Start this process's math-verify warm-up (`_warm_up`) in a background thread, once;
    returns the event set when it is done (None where workers are spawned, not forked). The
    trainer starts it at setup so that no training step pays for it."""
    if not _FORK:
        return None
    pid = os.getpid()
    with _POOL_LOCK:
        if pid not in _WARM:
            _WARM[pid] = threading.Event()
            threading.Thread(
                target=_warm_up, name="omgrpo-math-verify-warm-up", daemon=True
            ).start()
        return _WARM[pid]


def get_pool(wait: float) -> Any:
    """The worker pool, or None if it is not ready within `wait` seconds.

    With fork, the warm-up runs once per process in a background thread and the pool is built
    after it, so the caller waits at most `wait` (its budget) and never blocks training for the
    import; a caller that runs out of time counts a timeout and a later one finds it ready.
    """
    global _POOL, _POOL_PID
    pid = os.getpid()
    warm = start_grader_warm_up()
    if warm is not None and not warm.wait(timeout=max(wait, 0.0)):
        return None
    with _POOL_LOCK:
        if _POOL is not None and pid == _POOL_PID and _POOL.active:
            return _POOL
        # None yet, inherited through fork() (unusable in the child), or stopped: build anew.
        _shutdown_pool()
        from pebble import ProcessPool

        # fork where available: spawn/forkserver re-import the caller's __main__, which re-runs
        # any unguarded user script inside the worker. The forked worker only runs sympy /
        # math-verify code, never torch or CUDA, so inheriting the trainer's state is harmless.
        _POOL = ProcessPool(
            max_workers=1,
            initializer=_mv_init,
            context=multiprocessing.get_context("fork" if _FORK else "spawn"),
        )
        _POOL_PID = pid
        return _POOL


atexit.register(_shutdown_pool)


MISSING = object()


def cached_outcome(key: tuple[Side, Side]) -> Any:
    """The remembered outcome of a pair (True / False / None for a full-timeout give-up), or
    `MISSING` when it was never decided in this process."""
    return _PAIR_CACHE.get(key, MISSING)


def remember(key: tuple[Side, Side], outcome: bool | None) -> None:
    if len(_PAIR_CACHE) >= _PAIR_CACHE_SIZE:
        _PAIR_CACHE.clear()
    _PAIR_CACHE[key] = outcome
