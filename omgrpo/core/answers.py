"""Final-answer handling: ``\\boxed{}`` extraction, MATH-style normalisation, equivalence, clustering.

Every vote-based reward is computed on :func:`cluster` ids, so this module must be fast, total
(never raises) and deterministic, and must never merge two answers that denote different values.

Equivalence is exact: plain arithmetic is evaluated as rationals in-process (`omgrpo.core.exact`,
which also states the one tolerance rule: a decimal with ≥ 6 significant digits approximates a
non-decimal value within one unit of its last digit, so ``0.333333`` ≈ ``\\frac13``); other
numbers are compared exactly with sympy, and sets, intervals, equations and expressions by
math-verify, both in a killable worker process. Time is bounded: answers longer than
``MAX_ANSWER_CHARS`` are not parsed, and worker calls draw from a `GradingBudget` shared by a
whole training step (``reward.grading_budget_s``); past it, pairs fall back to normalised-string
identity and are counted (``answers/grading_timeouts``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from omgrpo.core.exact import PLAIN_NUMBER, decimal_ulp, exact_value, values_match

__all__ = [
    "MAX_ANSWER_CHARS",
    "Boxed",
    "GradingBudget",
    "cluster",
    "equivalent",
    "extract_boxed",
    "grading_budget",
    "grading_scope",
    "normalize",
    "set_math_verify",
    "use_grading_budget",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Boxed:
    """Content of a ``\\boxed{...}``; ``text[span[0]:span[1]] == content``."""

    content: str
    span: tuple[int, int]


_BOX_COMMANDS = ("\\boxed", "\\fbox")
# One token at a time: an escaped char (so ``\{``/``\}`` never count) or a bare brace.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
_BRACELESS_STOP = frozenset(" \t\n\r\f\v$}")


def _match_brace(text: str, open_idx: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``open_idx``, or -1 if it is never closed."""
    depth = 0
    for m in _BRACE_TOKEN.finditer(text, open_idx):
        tok = m.group()
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return -1


def _last_box_command(text: str) -> tuple[int, int] | None:
    """(start, end) of the last ``\\boxed``/``\\fbox`` control word (not e.g. ``\\boxedx``)."""
    best: tuple[int, int] | None = None
    for cmd in _BOX_COMMANDS:
        end = len(text)
        while True:
            i = text.rfind(cmd, 0, end)
            if i < 0:
                break
            j = i + len(cmd)
            if j >= len(text) or not text[j].isalpha():
                if best is None or i > best[0]:
                    best = (i, j)
                break
            end = i + len(cmd) - 1  # a longer command name: keep looking further left
    return best


def extract_boxed(text: str) -> Boxed | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed 5`` in ``text``.

    A malformed last box (unclosed brace, e.g. a truncated generation) or empty content gives
    None: we never fall back to an earlier box, since the model's final answer is the last one.
    """
    try:
        hit = _last_box_command(text)
        if hit is None:
            return None
        _, j = hit
        n = len(text)
        k = j
        while k < n and text[k].isspace():
            k += 1
        if k < n and text[k] == "{":
            close = _match_brace(text, k)
            if close < 0:
                return None
            start, end = k + 1, close
        else:
            # Brace-less form: one token after the command, up to whitespace / `$` / `}` / end.
            start = end = k
            while end < n and text[end] not in _BRACELESS_STOP:
                end += 1
        content = text[start:end]
        if not content.strip():
            return None
        return Boxed(content=content, span=(start, end))
    except Exception:  # never let a weird rollout crash the reward
        logger.debug("extract_boxed failed", exc_info=True)
        return None


# --------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------

# `(?![a-zA-Z])` everywhere so that e.g. `\right` never eats `\rightarrow`.
# `\\\\` (a LaTeX row break) is matched first and kept, so `\\\\ ` is never read as `\\ `.
_SPACING = re.compile(r"\\\\|\\[,;:! ]|\\q?quad(?![a-zA-Z])|\\displaystyle(?![a-zA-Z])|~")
_LEFT_RIGHT_DOT = re.compile(r"\\(?:left|right)\.")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)(?![a-zA-Z])")
_FRAC_VARIANTS = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![a-zA-Z])|°")
_TEXT_CMD = re.compile(r"\\(?:text|textrm|textnormal|textbf|textit|mbox)\s*\{")
_UNIT_EXPONENT = re.compile(r"\s*\^\s*(?:\{[^{}]*\}|\w)\s*")
_SHORT_VAR = re.compile(r"(?:[a-zA-Z]|\\[a-zA-Z]+)(?:'|_\{?[a-zA-Z0-9]+\}?)?")
_SPACES = re.compile(r"\s+")
_FRAC_OR_SQRT = re.compile(r"\\(frac|sqrt)(?![a-zA-Z])")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_BARE_LEADING_DOT = re.compile(r"(?<![\w.})\]])\.(?=\d)")
_DECIMAL = re.compile(r"(?<![\w.])(\d+)\.(\d+)(?![\d.])")
_LEADING_ZEROS = re.compile(r"(?<![\w.])0+(?=\d)")
_INT_SLASH_INT = re.compile(r"([+-]?)(\d+)/(\d+)")

_MAX_PASSES = 8
MAX_ANSWER_CHARS = 1000
"""Longer answers are not normalised or graded: they match only an identical string. (Final
answers are short; this bounds the work a degenerate rollout can cause.)"""


def _spacing_repl(m: re.Match[str]) -> str:
    return m.group() if m.group() == "\\\\" else " "


def _unwrap_text(s: str) -> str:
    """Drop trailing ``\\text{unit}`` (after a non-empty value), unwrap every other ``\\text``."""
    out: list[str] = []
    pos = 0
    seen_value = False  # anything non-blank before the current group?
    while True:
        m = _TEXT_CMD.search(s, pos)
        if m is None:
            out.append(s[pos:])
            break
        close = _match_brace(s, m.end() - 1)
        if close < 0:  # unbalanced: leave the rest alone
            out.append(s[pos:])
            break
        inner = s[m.end() : close]
        rest = s[close + 1 :]
        # A unit is a text group at the very end (optionally `^2`) that follows some value.
        is_trailing = rest.strip() == "" or _UNIT_EXPONENT.fullmatch(rest) is not None
        before = s[pos : m.start()]
        seen_value = seen_value or bool(before.strip())
        out.append(before)
        if is_trailing and seen_value:
            break
        out.append(inner.strip())
        seen_value = seen_value or bool(inner.strip())
        pos = close + 1
    return "".join(out)


def _strip_equation_lhs(s: str) -> str:
    """``x = 5`` / ``k=5`` → ``5``: only for one plain ``=`` with a short variable on the left."""
    if s.count("=") != 1:
        return s
    i = s.index("=")
    if i > 0 and s[i - 1] in "<>!:":
        return s
    lhs, rhs = s[:i].strip(), s[i + 1 :].strip()
    if rhs and _SHORT_VAR.fullmatch(lhs):
        return rhs
    return s


def _remove_spaces(s: str) -> str:
    """Remove all whitespace, except one space between a control word and a letter.

    Deleting that space would change how LaTeX tokenises (``\\pi r`` → ``\\pir``).
    """

    def repl(m: re.Match[str]) -> str:
        i = m.start()
        j = m.end()
        if j < len(s) and s[j].isalpha():
            k = i
            while k > 0 and s[k - 1].isalpha() and s[k - 1].isascii():
                k -= 1
            if k < i and k > 0 and s[k - 1] == "\\":
                return " "
        return ""

    return _SPACES.sub(repl, s)


def _read_arg(s: str, i: int, partners: dict[int, int]) -> tuple[int, int, bool] | None:
    """One macro argument at ``s[i:]`` (after spaces): (start, end, already braced)."""
    n = len(s)
    while i < n and s[i] == " ":
        i += 1
    if i >= n:
        return None
    c = s[i]
    if c == "{":
        close = partners.get(i, -1)
        return None if close < 0 else (i, close + 1, True)
    if c == "\\":
        j = i + 1
        while j < n and s[j].isalpha():
            j += 1
        if j == i + 1:  # control symbol like `\{`
            j = min(i + 2, n)
        return i, j, False
    if c in "}^_&=,()[]":
        return None
    return i, i + 1, False


def _fix_frac_sqrt(s: str) -> str:
    """``\\frac12`` → ``\\frac{1}{2}``, ``\\sqrt2`` → ``\\sqrt{2}`` (nested too), in linear time.

    Every macro's arguments are read in the original string (braces matched once), and the
    edits are only added braces and dropped spaces, applied together at the end.
    """
    if "\\frac" not in s and "\\sqrt" not in s:
        return s
    partners = _brace_partners(s)
    opens: dict[int, int] = {}  # index -> `{` to insert before it
    closes: dict[int, int] = {}  # index -> `}` to insert before it
    drops: dict[int, int] = {}  # start -> end of spaces to drop before an argument
    token_end = 0  # end of the last bare token braced: a macro inside it is that argument
    for m in _FRAC_OR_SQRT.finditer(s):
        if m.start() < token_end:  # e.g. the `\sqrt` of `\frac\sqrt2`
            continue
        pos = m.end()
        if m.group(1) == "sqrt" and pos < len(s) and s[pos] == "[":  # root index `\sqrt[3]{x}`
            close = s.find("]", pos)
            if close < 0:
                continue
            pos = close + 1
        args: list[tuple[int, int, int, bool]] = []  # (spaces start, start, end, braced)
        for _ in range(1 if m.group(1) == "sqrt" else 2):
            arg = _read_arg(s, pos, partners)
            if arg is None:
                break
            args.append((pos, *arg))
            pos = arg[1]
        else:
            for before, start, end, braced in args:
                if start > before:
                    drops[before] = start
                if not braced:
                    opens[start] = opens.get(start, 0) + 1
                    closes[end] = closes.get(end, 0) + 1
                    token_end = max(token_end, end)
    if not (opens or drops):
        return s
    out: list[str] = []
    last = 0
    for p in sorted(opens.keys() | closes.keys() | drops.keys()):
        out.append(s[last:p] + "}" * closes.get(p, 0) + "{" * opens.get(p, 0))
        last = drops.get(p, p)
    out.append(s[last:])
    return "".join(out)


def _brace_partners(s: str) -> dict[int, int]:
    """``{open index: close index}`` of every matched brace pair, in one pass."""
    partners: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_TOKEN.finditer(s):
        if m.group() == "{":
            stack.append(m.start())
        elif m.group() == "}" and stack:
            partners[stack.pop()] = m.start()
    return partners


def _unwrap_outer(s: str) -> str:
    """``{5}`` → ``5``; ``\\boxed{5}`` passed in whole → ``5``. Linear: braces matched once."""
    if not s.startswith(("{", "\\boxed{", "\\fbox{")):
        return s
    partners = _brace_partners(s)
    i, j = 0, len(s)  # the answer is s[i:j]
    while True:
        for prefix in ("{", "\\boxed{", "\\fbox{"):
            k = i + len(prefix) - 1  # index of the prefix's `{`
            if s.startswith(prefix, i) and partners.get(k) == j - 1:
                i, j = k + 1, j - 1
                break
        else:
            return s[i:j]


def _normalize_numbers(s: str) -> str:
    if "{,}" in s:  # `1{,}000` is LaTeX for a thousands separator
        s = s.replace("{,}", ",")
    if _THOUSANDS.fullmatch(s):  # whole string only: `(1,000)` / `1,2` stay tuples
        s = s.replace(",", "")
    s = _BARE_LEADING_DOT.sub("0.", s)

    def fix_decimal(m: re.Match[str]) -> str:
        frac = m.group(2).rstrip("0")
        return f"{m.group(1)}.{frac}" if frac else m.group(1)

    s = _DECIMAL.sub(fix_decimal, s)
    s = _LEADING_ZEROS.sub("", s)
    if s.startswith("+") and PLAIN_NUMBER.fullmatch(s):
        s = s[1:]
    if s == "-0":
        s = "0"
    return s


def _int_slash_int(s: str) -> str:
    m = _INT_SLASH_INT.fullmatch(s)
    if m is None:
        return s
    sign = "-" if m.group(1) == "-" else ""
    return f"{sign}\\frac{{{m.group(2)}}}{{{m.group(3)}}}"


def _normalize_once(s: str) -> str:
    s = s.strip()
    if not s:
        return s
    s = _SPACING.sub(_spacing_repl, s)
    s = _LEFT_RIGHT_DOT.sub("", s)
    s = _LEFT_RIGHT.sub("", s)
    s = _FRAC_VARIANTS.sub(r"\\frac", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = _unwrap_text(s).strip()
    if len(s) > 1 and s.endswith(".") and not s.endswith(".."):  # keep `...`
        s = s[:-1]
    s = _strip_equation_lhs(s)
    s = _remove_spaces(s)
    s = _fix_frac_sqrt(s)
    s = _unwrap_outer(s)
    s = _normalize_numbers(s)
    s = _int_slash_int(s)
    return s


@functools.lru_cache(maxsize=100_000)
def _normalize_cached(answer: str) -> str:
    s = answer
    # Iterate to a fixpoint so that normalize() is idempotent even when one rewrite exposes
    # another (e.g. a unit removed, then a trailing `.` visible).
    for _ in range(_MAX_PASSES):
        nxt = _normalize_once(s)
        if nxt == s:
            break
        s = nxt
    return s


def normalize(answer: str) -> str:
    """MATH-style normalisation (Hendrycks ``strip_string`` plus extras). Never raises.

    Answers longer than ``MAX_ANSWER_CHARS`` are unparseable: returned stripped but otherwise
    as they are (and graded by string identity only).
    """
    if not isinstance(answer, str):
        answer = str(answer)
    if len(answer) > MAX_ANSWER_CHARS and len(answer.strip()) > MAX_ANSWER_CHARS:
        return answer.strip()
    try:
        return _normalize_cached(answer)
    except Exception:
        logger.debug("normalize failed", exc_info=True)
        return answer.strip()


# --------------------------------------------------------------------------------------------
# Equivalence
# --------------------------------------------------------------------------------------------

DEFAULT_GRADING_BUDGET_S = 10.0
"""Seconds of math-verify work one `GradingBudget` allows by default (`reward.grading_budget_s`)."""
DEFAULT_PAIR_TIMEOUT_S = 5.0
"""Seconds one answer pair may take in the worker by default (`reward.equivalence_timeout`)."""
_RESULT_GRACE_S = 0.2  # waiting this much past a task's timeout lets pebble's own timeout fire

_MATH_VERIFY_ENABLED = True
_POOL: Any = None
_POOL_PID: int | None = None
_POOL_LOCK = threading.Lock()
_PAIR_CACHE: dict[tuple[Any, Any], bool | None] = {}  # None: timed out with the full pair timeout
_PAIR_CACHE_SIZE = 100_000

# One answer as the worker sees it: normalised text, exact value (if plain arithmetic), and the
# unit of its last digit if the decimal rule of `omgrpo.core.exact` applies to it.
_Side = tuple[str, Fraction | None, Fraction | None]


@dataclass
class GradingBudget:
    """Worker time shared by every `cluster` / `equivalent` call of one training step.

    Each math-verify call is charged its wall time (a worker restart after a kill included) and
    may run at most ``min(pair_timeout, seconds left)``. Once the budget is spent, undecided
    pairs fall back to normalised-string identity (not equivalent) and count in `timeouts`, as do
    pairs whose call timed out.
    """

    seconds: float = DEFAULT_GRADING_BUDGET_S
    pair_timeout: float = DEFAULT_PAIR_TIMEOUT_S
    spent: float = 0.0
    timeouts: int = 0

    def left(self) -> float:
        return self.seconds - self.spent


_BUDGET: ContextVar[GradingBudget | None] = ContextVar("omgrpo_grading_budget", default=None)


def use_grading_budget(budget: GradingBudget) -> GradingBudget:
    """Make `budget` the one later `cluster` / `equivalent` calls in this context draw from, up
    to the end of the enclosing `grading_scope` (the trainer sets one per step). Returns it."""
    _BUDGET.set(budget)
    return budget


@contextmanager
def grading_scope() -> Iterator[None]:
    """Budgets set with `use_grading_budget` inside the block end with it."""
    token = _BUDGET.set(None)
    try:
        yield
    finally:
        _BUDGET.reset(token)


@contextmanager
def grading_budget(
    seconds: float = DEFAULT_GRADING_BUDGET_S, pair_timeout: float = DEFAULT_PAIR_TIMEOUT_S
) -> Iterator[GradingBudget]:
    """A fresh `GradingBudget` shared by the calls inside the block."""
    with grading_scope():
        budget = GradingBudget(seconds=float(seconds), pair_timeout=float(pair_timeout))
        use_grading_budget(budget)
        yield budget


def _active_budget() -> GradingBudget:
    """The budget set for this context, else a fresh default one for this call alone."""
    return _BUDGET.get() or GradingBudget()


def set_math_verify(enabled: bool) -> None:
    """Turn the math-verify fallback on/off (off: only normalised/exact equality count)."""
    global _MATH_VERIFY_ENABLED
    _MATH_VERIFY_ENABLED = bool(enabled)


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


def _mv_worker(x: _Side, y: _Side) -> bool:
    """Whether two answers are equal, decided with sympy / math-verify (in the pool worker).

    Numbers (no free symbols) are compared exactly (`_sympy_numbers_equal`); everything else
    (sets, intervals, equations, expressions) by math-verify's `verify` in both orders, since
    clustering needs a symmetric relation. math-verify's own SIGALRM timeouts are disabled:
    pebble kills the worker instead.
    """
    from math_verify import verify

    px, py = _mv_parse(x[0]), _mv_parse(y[0])
    if not px or not py:
        return False
    a, b = _sympy_value(px[0], x[1]), _sympy_value(py[0], y[1])
    if _is_number(a) and _is_number(b):
        return _sympy_numbers_equal(a, x[2], b, y[2])
    gx, gy = list(px), list(py)
    return bool(verify(gx, gy, timeout_seconds=None) or verify(gy, gx, timeout_seconds=None))


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

    from omgrpo.core.exact import values_match

    a, b = _exact_sympy(a), _exact_sympy(b)
    if not (a.is_finite and b.is_finite):  # infinities, nan, or finiteness unknown
        return bool(a == b)
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


_FORK = "fork" in multiprocessing.get_all_start_methods()
_WARM: dict[int, threading.Event] = {}  # pid -> set once this process has warmed up sympy


def _warm_up() -> None:
    """Import and exercise sympy / math-verify in this process (~2-5 s), so that every worker
    forked from it afterwards, restarts after a kill included, is ready in milliseconds."""
    try:
        _mv_init()
        _mv_worker(("x+1", None, None), ("1+x", None, None))
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


def _get_pool(wait: float) -> Any:
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


def _remember(key: tuple[Any, Any], outcome: bool | None) -> None:
    if len(_PAIR_CACHE) >= _PAIR_CACHE_SIZE:
        _PAIR_CACHE.clear()
    _PAIR_CACHE[key] = outcome


def _worker_equal(x: _Side, y: _Side, budget: GradingBudget) -> bool:
    """Ask the worker within the budget; a timeout (or no budget left) counts and gives False.

    Outcomes are cached per pair; a pair that timed out with the full pair timeout is not tried
    again (it still counts as a timeout each time it is asked).
    """
    key = (x, y)
    if key in _PAIR_CACHE:
        outcome = _PAIR_CACHE[key]
        if outcome is None:
            budget.timeouts += 1
            return False
        return outcome
    if budget.left() <= 0:
        budget.timeouts += 1
        return False
    t0 = time.monotonic()
    future, wait = None, 0.0
    try:
        pool = _get_pool(budget.left())
        wait = min(budget.pair_timeout, budget.left() - (time.monotonic() - t0))
        if pool is None or wait <= 0:
            raise TimeoutError
        future = pool.schedule(_mv_worker, args=(x, y), timeout=wait)
        outcome = bool(future.result(timeout=wait + _RESULT_GRACE_S))
    except (TimeoutError, futures.TimeoutError):
        if future is not None:
            future.cancel()
        logger.debug("math-verify gave up after %.1fs on %r vs %r", wait, x[0], y[0])
        budget.timeouts += 1
        if wait >= budget.pair_timeout:
            _remember(key, None)
        return False
    except Exception:  # worker crash (pebble replaces it), pickling error, ...
        logger.debug("math-verify failed on %r vs %r", x[0], y[0], exc_info=True)
        outcome = False
    finally:
        budget.spent += time.monotonic() - t0
    _remember(key, outcome)
    return outcome


_exact_value = functools.lru_cache(maxsize=100_000)(exact_value)


def _side(s: str, other: str) -> _Side:
    ulp = None if PLAIN_NUMBER.fullmatch(other) else decimal_ulp(s)
    return (s, _exact_value(s), ulp)


def _equal(x: str, y: str, budget: GradingBudget) -> bool:
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
    if not _MATH_VERIFY_ENABLED:
        return False
    if x > y:  # one order per pair: a symmetric relation and one cache entry
        sx, sy = sy, sx
    return _worker_equal(sx, sy, budget)


def equivalent(a: str, b: str) -> bool:
    """Whether two final answers denote the same value. Never raises.

    1. equal after :func:`normalize` → True; answers over ``MAX_ANSWER_CHARS`` stop here;
    2. both plain arithmetic (integers, decimals, fractions, integer powers, scientific
       notation) → exact rational comparison plus the decimal rule of `omgrpo.core.exact`, final;
    3. otherwise sympy / math-verify in a killable worker process: numbers compared exactly,
       other objects by math-verify (both orders), within the active `GradingBudget`.

    The worker is forked where the platform allows it; elsewhere (macOS, Windows) it is spawned,
    which re-imports the caller's ``__main__``: entry-point scripts there need an
    ``if __name__ == "__main__":`` guard.
    """
    return _safe_equal(normalize(a), normalize(b), _active_budget())


def cluster(answers: list[str | None]) -> list[int | None]:
    """Equivalence-class ids in order of first appearance (None stays None).

    Each answer is compared against one representative per existing class (the first member),
    i.e. equivalence is treated as transitive via representatives: an answer joins the first
    class whose representative it matches, even if it would not match other members. All pairs
    share the active `GradingBudget` (a fresh default one when none is set).
    """
    budget = _active_budget()
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
            cid = next((k for k, rep in enumerate(reps) if _safe_equal(rep, norm, budget)), None)
            if cid is None:
                cid = len(reps)
                reps.append(norm)
            by_norm[norm] = cid
        ids.append(cid)
    return ids


def _safe_equal(x: str, y: str, budget: GradingBudget) -> bool:
    try:
        return _equal(x, y, budget)
    except Exception:
        logger.debug("equivalent failed", exc_info=True)
        return False
