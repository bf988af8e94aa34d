"""MATH-style normalisation of a final answer (Hendrycks ``strip_string`` plus extras).

`normalize` is total and idempotent, and must never map two answers that denote different
values to one string: every vote compares normal forms first.
"""

from __future__ import annotations

import functools
import logging
import re

from omgrpo.core.answers.exact import PLAIN_NUMBER
from omgrpo.core.answers.extract import _brace_partners, _match_brace

__all__ = ["MAX_ANSWER_CHARS", "normalize"]

logger = logging.getLogger(__name__)

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
_COMMA_SPACE = re.compile(r",\s+")
_THOUSANDS_NEG_SPACE = re.compile(r"(?<=\d),\\!\s*(?=\d)")

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


def _comma_list(s: str) -> str | None:
    """``32, 349`` is two numbers, not 32349: where only the spaces after its commas keep an
    answer from reading as a thousands-separated number, it is a list, normalised to
    ``32, 349`` (one space after each comma, none elsewhere) so that it never meets the normal
    form of ``32,349`` (32349) on a later pass either. None for any other answer."""
    if _COMMA_SPACE.search(s) is None:
        return None
    tight = _unwrap_outer(_SPACES.sub("", s))  # `{32, 349}` too
    if not _THOUSANDS.fullmatch(tight):
        return None
    return tight.replace(",", ", ")


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
    s = _THOUSANDS_NEG_SPACE.sub(",", s)  # `32,\! 349`: `\!` marks a thousands separator
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
    listed = _comma_list(s)
    if listed is not None:
        return listed
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
