"""Final-answer handling: ``\\boxed{}`` extraction, MATH-style normalisation, equivalence, clustering.

Every vote-based reward is computed on :func:`cluster` ids, so this module must be fast, total
(never raises) and deterministic.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import multiprocessing
import os
import re
import threading
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

__all__ = [
    "Boxed",
    "cluster",
    "equivalent",
    "extract_boxed",
    "normalize",
    "set_math_verify",
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
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_SIMPLE_RATIONAL = re.compile(r"(-?)(?:(\d+(?:\.\d+)?)|\\frac\{(\d+)\}\{(\d+)\})")

_MAX_PASSES = 8


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


def _read_arg(s: str, i: int) -> tuple[str, int] | None:
    """Read one macro argument at ``s[i:]``; return it braced, plus the index after it."""
    n = len(s)
    while i < n and s[i] == " ":
        i += 1
    if i >= n:
        return None
    c = s[i]
    if c == "{":
        close = _match_brace(s, i)
        if close < 0:
            return None
        return s[i : close + 1], close + 1
    if c == "\\":
        j = i + 1
        while j < n and s[j].isalpha():
            j += 1
        if j == i + 1:  # control symbol like `\{`
            j = min(i + 2, n)
        return "{" + s[i:j] + "}", j
    if c in "}^_&=,()[]":
        return None
    return "{" + c + "}", i + 1


def _fix_frac_sqrt(s: str) -> str:
    """``\\frac12`` → ``\\frac{1}{2}``, ``\\sqrt2`` → ``\\sqrt{2}`` (handles nesting)."""
    if "\\frac" not in s and "\\sqrt" not in s:
        return s
    # Right to left, so fixing an inner/later macro never shifts an earlier match's offset.
    for m in reversed(list(_FRAC_OR_SQRT.finditer(s))):
        pos = m.end()
        pieces: list[str] = []
        if m.group(1) == "sqrt":
            if pos < len(s) and s[pos] == "[":  # optional root index `\sqrt[3]{x}`
                close = s.find("]", pos)
                if close < 0:
                    continue
                pieces.append(s[pos : close + 1])
                pos = close + 1
            nargs = 1
        else:
            nargs = 2
        for _ in range(nargs):
            arg = _read_arg(s, pos)
            if arg is None:
                break
            pieces.append(arg[0])
            pos = arg[1]
        else:
            fixed = "".join(pieces)
            if fixed != s[m.end() : pos]:  # rebuild only when needed (keeps clean input linear)
                s = s[: m.end()] + fixed + s[pos:]
    return s


def _unwrap_outer(s: str) -> str:
    """``{5}`` → ``5``; ``\\boxed{5}`` passed in whole → ``5``."""
    while True:
        for prefix in ("{", "\\boxed{", "\\fbox{"):
            if s.startswith(prefix) and _match_brace(s, len(prefix) - 1) == len(s) - 1:
                s = s[len(prefix) : -1]
                break
        else:
            return s


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
    if s.startswith("+") and _PLAIN_NUMBER.fullmatch(s):
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
    """MATH-style normalisation (Hendrycks ``strip_string`` plus extras). Never raises."""
    if not isinstance(answer, str):
        answer = str(answer)
    try:
        return _normalize_cached(answer)
    except Exception:
        logger.debug("normalize failed", exc_info=True)
        return answer.strip()


# --------------------------------------------------------------------------------------------
# Equivalence
# --------------------------------------------------------------------------------------------

_MATH_VERIFY_ENABLED = True
_POOL: Any = None
_POOL_PID: int | None = None
_POOL_LOCK = threading.Lock()


def set_math_verify(enabled: bool) -> None:
    """Turn the math-verify fallback on/off (off: only normalised/numeric equality count)."""
    global _MATH_VERIFY_ENABLED
    _MATH_VERIFY_ENABLED = bool(enabled)


def _mv_init() -> None:
    # Pay the sympy/antlr import inside the initializer: pebble starts a task's timeout clock
    # only once the worker acknowledges it, i.e. after this has run.
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" warnings
    import math_verify  # noqa: F401


def _mv_worker(gold: str, pred: str) -> bool:
    """Runs in the pool worker. math-verify's own SIGALRM timeouts are disabled; pebble enforces."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    g = parse(f"${gold}$", extraction_config=config, parsing_timeout=None)
    p = parse(f"${pred}$", extraction_config=config, parsing_timeout=None)
    if not g or not p:
        return False
    # verify() is asymmetric (assignment/interval handling); clustering needs symmetry.
    return bool(verify(g, p, timeout_seconds=None) or verify(p, g, timeout_seconds=None))


def _mv_kind_worker(text: str) -> tuple[str, float | None]:
    """Runs in the pool worker: what math-verify makes of one answer. ("none", None) when it
    extracts nothing; ("num", value) for a real number (`3+4`, `\\sqrt{2}/2`); ("sym", None) for
    an expression with free symbols (never equal to a number); ("other", None) otherwise (sets,
    intervals, equations, ...: decided pairwise)."""
    import sympy
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    parsed = parse(
        f"${text}$",
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=None,
    )
    if not parsed:
        return ("none", None)
    value = parsed[0]
    if isinstance(value, sympy.Expr):
        if value.free_symbols:
            return ("sym", None)
        if value.is_number:
            number = complex(value.evalf())
            if number.imag == 0 and math.isfinite(number.real):
                return ("num", number.real)
    return ("other", None)


@functools.lru_cache(maxsize=100_000)
def _math_verify_kind(text: str, timeout: int) -> tuple[str, float | None]:
    """One worker call per distinct answer (cached), so clustering a group costs O(answers)
    math-verify calls for numbers and unparseable text instead of O(answers x classes)."""
    try:
        return _get_pool().schedule(_mv_kind_worker, args=(text,), timeout=timeout).result()
    except Exception:  # timeout or worker crash: let the pairwise check decide
        logger.debug("math-verify parse failed on %r", text, exc_info=True)
        return ("expr", None)


def _kind(text: str, rational: Fraction | None, timeout: int) -> tuple[str, float | None]:
    """Plain numbers and simple fractions are numbers without asking the worker."""
    if _PLAIN_NUMBER.fullmatch(text):
        return ("num", float(Decimal(text)))
    if rational is not None:
        return ("num", float(rational))
    return _math_verify_kind(text, timeout)


def _shutdown_pool() -> None:
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None and os.getpid() == _POOL_PID:  # never touch a fork-inherited pool
        try:
            pool.stop()
            pool.join(timeout=5)
        except Exception:
            pass


def _get_pool() -> Any:
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        pid = os.getpid()
        if _POOL is not None and pid == _POOL_PID and _POOL.active:
            return _POOL
        # None yet, inherited through fork() (unusable in the child), or stopped: build anew.
        _shutdown_pool()
        from pebble import ProcessPool

        # fork where available: spawn/forkserver re-import the caller's __main__, which re-runs
        # any unguarded user script inside the worker. The forked worker only runs sympy /
        # math-verify code, never torch or CUDA, so inheriting the trainer's state is harmless.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        _POOL = ProcessPool(
            max_workers=1,
            initializer=_mv_init,
            context=multiprocessing.get_context(method),
        )
        _POOL_PID = pid
        return _POOL


atexit.register(_shutdown_pool)


@functools.lru_cache(maxsize=100_000)
def _math_verify_equal(x: str, y: str, timeout: int) -> bool:
    """math-verify in the worker; callers pass the pair sorted so the cache is symmetric."""
    try:
        future = _get_pool().schedule(_mv_worker, args=(x, y), timeout=timeout)
        return bool(future.result())
    except TimeoutError:
        logger.debug("math-verify timed out after %ss on %r vs %r", timeout, x, y)
        return False
    except Exception:  # worker crash (pebble replaces it), pickling error, ...
        logger.debug("math-verify failed on %r vs %r", x, y, exc_info=True)
        return False


def _numbers_close(x: str, y: str) -> bool:
    if "." not in x and "." not in y:
        return Decimal(x) == Decimal(y)  # exact (tolerances are for decimal round-off only)
    dx, dy = Decimal(x), Decimal(y)
    return abs(dx - dy) <= max(Decimal("1e-9"), Decimal("1e-9") * max(abs(dx), abs(dy)))


def _simple_rational(s: str) -> Fraction | None:
    m = _SIMPLE_RATIONAL.fullmatch(s)
    if m is None:
        return None
    sign, dec, num, den = m.groups()
    if dec is not None:
        value = Fraction(dec)
    elif int(den) == 0:
        return None
    else:
        value = Fraction(int(num), int(den))
    return -value if sign else value


def _coerce_timeout(timeout: Any) -> int:
    try:
        return max(1, int(timeout))
    except (TypeError, ValueError, OverflowError):
        return 5


def equivalent(a: str, b: str, timeout: int = 5) -> bool:
    """Whether two final answers are mathematically the same. Never raises.

    1. equal after :func:`normalize`;
    2. both plain numbers → numeric comparison (abs/rel tol 1e-9; integers exactly), final;
    3. otherwise math-verify in a killable worker process (``timeout`` seconds, int ≥ 1).

    The worker is forked where the platform allows it; elsewhere (macOS, Windows) it is spawned,
    which re-imports the caller's ``__main__``: entry-point scripts there need an
    ``if __name__ == "__main__":`` guard.
    """
    try:
        x, y = normalize(a), normalize(b)
        if x == y:
            return True
        if _PLAIN_NUMBER.fullmatch(x) and _PLAIN_NUMBER.fullmatch(y):
            return _numbers_close(x, y)
        # Cheap exact path for `0.5` vs `\frac{1}{2}`; a miss still goes to math-verify
        # (which also accepts rounded decimals such as 0.333333 vs 1/3).
        rx, ry = _simple_rational(x), _simple_rational(y)
        if rx is not None and rx == ry:
            return True
        if not _MATH_VERIFY_ENABLED or not x or not y:
            return False
        timeout = _coerce_timeout(timeout)
        (kx, vx), (ky, vy) = _kind(x, rx, timeout), _kind(y, ry, timeout)
        if kx == "none" or ky == "none":
            return False  # math-verify reads nothing in one of them: verify() would say False
        if kx == ky == "num":
            return math.isclose(vx, vy, rel_tol=1e-9, abs_tol=1e-12)
        if {kx, ky} == {"num", "sym"}:
            return False
        if x > y:
            x, y = y, x
        return _math_verify_equal(x, y, timeout)
    except Exception:
        logger.debug("equivalent failed", exc_info=True)
        return False


def cluster(answers: list[str | None]) -> list[int | None]:
    """Equivalence-class ids in order of first appearance (None stays None).

    Each answer is compared against one representative per existing class (the first member),
    i.e. equivalence is treated as transitive via representatives: an answer joins the first
    class whose representative it matches, even if it would not match other members.
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
            cid = next((k for k, rep in enumerate(reps) if equivalent(rep, norm)), None)
            if cid is None:
                cid = len(reps)
                reps.append(norm)
            by_norm[norm] = cid
        ids.append(cid)
    return ids
