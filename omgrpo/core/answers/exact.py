"""Exact values of plain numeric answers, and the one tolerance rule for decimal approximations.

:func:`exact_value` reads a normalised answer built only from integers, decimals, ``\\frac``,
``+ - * / \\times \\cdot \\div``, integer powers (``2^{100}``, ``10^{-3}``, ``2^5``) and
parentheses / braces as an exact :class:`~fractions.Fraction`, in time linear in its length.
Anything else (symbols, roots, ``2^10`` which TeX reads as ``2^1 0``, implicit products such as
``2\\frac12``, powers beyond ``MAX_BITS``) gives None and is left to the symbolic grader.

Decimal rule (:func:`values_match`): values are compared exactly, except that a decimal written
with at least ``APPROX_DIGITS`` significant digits and ``k`` digits after the point stands for
any value that lies strictly within ``10^-k`` of it (one unit of its last digit, so both rounded
and truncated approximations count) and is not itself a decimal with at most ``k`` digits.
So ``0.333333`` ≈ ``\\frac13``, ``0.666666`` ≈ ``0.666667`` ≈ ``\\frac23``, ``3.14159`` ≈ ``\\pi``,
but ``0.33`` ≠ ``\\frac13`` (too few digits to be an approximation), ``0.500001`` ≠ ``\\frac12``
(a half is written exactly in 6 digits) and two decimals (or a decimal and an integer) are equal
only if they are the same number.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["APPROX_DIGITS", "MAX_BITS", "decimal_ulp", "exact_value", "values_match"]

APPROX_DIGITS = 6
"""Fewest significant digits that make a decimal an approximation (see the module docstring)."""
MAX_BITS = 100_000
"""Largest numerator/denominator (in bits) a power may produce; larger powers are not evaluated."""

_MAX_DEPTH = 50  # nesting of groups and signs; deeper input is left to the symbolic grader
_TOKEN = re.compile(r"\d+(?:\.\d+)?|\\(?:frac|times|cdot|div)(?![a-zA-Z])|[-+*/^(){}]")
_PLAIN_DECIMAL = re.compile(r"[+-]?(\d+)\.(\d+)")
PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
"""An integer or decimal literal (such answers are never approximated by the decimal rule)."""


class _Unsupported(Exception):
    """The answer is not a plain numeric expression (or is too large to evaluate)."""


def _tokenize(s: str) -> list[str]:
    tokens, pos = [], 0
    for m in _TOKEN.finditer(s):
        if m.start() != pos:
            raise _Unsupported
        tokens.append(m.group())
        pos = m.end()
    if pos != len(s):
        raise _Unsupported
    return tokens


class _Parser:
    """Recursive descent over the tokens; every method returns an exact Fraction."""

    _MUL_OPS = frozenset({"*", "/", "\\times", "\\cdot", "\\div"})

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _Unsupported
        self.i += 1
        return tok

    def nest(self, step: int) -> None:
        self.depth += step
        if self.depth > _MAX_DEPTH:
            raise _Unsupported

    def expr(self) -> Fraction:
        self.nest(1)
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        self.nest(-1)
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in self._MUL_OPS:
            op = self.take()
            rhs = self.factor()
            if op in ("/", "\\div"):
                if rhs == 0:
                    raise _Unsupported
                value /= rhs
            else:
                value *= rhs
        return value

    def factor(self) -> Fraction:
        if self.peek() in ("+", "-"):
            sign = self.take()
            self.nest(1)
            value = self.factor()
            self.nest(-1)
            return -value if sign == "-" else value
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take("^")
        if self.peek() == "{":
            exponent = self.group()
        else:  # TeX takes one character: `2^5`; `2^10` is `2^1 0`, ambiguous, so not ours
            tok = self.take()
            if len(tok) != 1 or not tok.isdigit():
                raise _Unsupported
            exponent = Fraction(int(tok))
        return _power(base, exponent)

    def atom(self) -> Fraction:
        tok = self.peek()
        if tok == "\\frac":
            self.take()
            num = self.group()
            den = self.group()
            if den == 0:
                raise _Unsupported
            return num / den
        if tok == "{":
            return self.group()
        if tok == "(":
            self.take()
            value = self.expr()
            self.take(")")
            return value
        if tok is not None and tok[0].isdigit():
            self.take()
            return Fraction(tok)
        raise _Unsupported

    def group(self) -> Fraction:
        self.take("{")
        value = self.expr()
        self.take("}")
        return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1 or (base == 0 and exponent <= 0):
        raise _Unsupported
    e = abs(exponent.numerator)
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    if size * e > MAX_BITS:
        raise _Unsupported
    value = base**e
    return 1 / value if exponent < 0 else value


def exact_value(s: str) -> Fraction | None:
    """The exact value of a plain numeric answer (already normalised), else None. Never raises.

    >>> exact_value("\\\\frac{6}{4}"), exact_value("1\\\\times10^{3}"), exact_value("x+1")
    (Fraction(3, 2), Fraction(1000, 1), None)
    """
    if PLAIN_NUMBER.fullmatch(s):  # the common case, without the parser
        return Fraction(s)
    try:
        parser = _Parser(_tokenize(s))
        value = parser.expr()
        if parser.i != len(parser.tokens):
            return None
        return value
    except (_Unsupported, RecursionError, ValueError, ZeroDivisionError, OverflowError):
        return None


def decimal_ulp(s: str) -> Fraction | None:
    """One unit of the last digit of a decimal with ≥ ``APPROX_DIGITS`` significant digits
    (``"0.333333"`` → 1/10^6), i.e. the precision it states; None for any other answer."""
    m = _PLAIN_DECIMAL.fullmatch(s)
    if m is None:
        return None
    digits = (m.group(1) + m.group(2)).lstrip("0")
    if len(digits) < APPROX_DIGITS:
        return None
    return Fraction(1, 10 ** len(m.group(2)))


def values_match(x: Fraction, x_ulp: Fraction | None, y: Fraction, y_ulp: Fraction | None) -> bool:
    """Exact equality, or the decimal rule when one side is a decimal approximation.

    ``x_ulp`` / ``y_ulp`` come from :func:`decimal_ulp` and are passed only when the other answer
    is not itself an integer or decimal literal (two literals compare exactly).
    """
    if x == y:
        return True
    if x_ulp is None and y_ulp is None:
        return False
    approx, ulp, other = (x, x_ulp, y) if x_ulp is not None else (y, y_ulp, x)
    assert ulp is not None
    terminates = (other / ulp).denominator == 1  # `other` has at most k decimal digits
    return not terminates and abs(other - approx) < ulp
