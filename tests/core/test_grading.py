"""Exact, bounded grading (a grader that merges two answers corrupts every vote): exact values, the
decimal rule, property tests over spellings, linear-time normalisation and the per-step grading
budget."""

from __future__ import annotations

import time
from contextlib import contextmanager
from decimal import Decimal, localcontext
from fractions import Fraction
from unittest import mock

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from omgrpo.core import answers
from omgrpo.core.answers import Grader, cluster, equivalent, normalize
from omgrpo.core.answers import worker as worker_module
from omgrpo.core.answers.exact import decimal_ulp, exact_value, values_match
from omgrpo.core.rewards import compute_rewards, make_group

# In-process properties only (reproducible and database-free by the conftest's profile).
FAST = settings(max_examples=150)


@contextmanager
def no_worker():
    """Fail if the math-verify worker is asked (these answers must be decided in-process)."""

    def refuse() -> None:
        raise AssertionError("the math-verify worker was asked")

    with mock.patch.object(worker_module, "get_pool", refuse):
        yield


# ------------------------------------------ answers an earlier grader merged or stalled on


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("1/2^{99}", "1/2^{98}"),  # before: True (float tolerance)
        ("2^{100}", "2^{100}+1"),  # before: True
        ("10^{10}", "10^{10}+1"),  # before: True
        ("10^{-13}", "0"),  # before: True
        ("\\frac1{2^{99}}", "\\frac1{2^{98}}"),  # math-verify false positive
        ("1-\\frac1e", "1+\\frac1e"),  # math-verify false positive
        ("\\{\\frac{1}{2^{99}}, 1\\}", "\\{\\frac{1}{2^{98}}, 1\\}"),  # same, inside a set
        ("e^{-200}", "0"),  # tiny irrational vs zero
        ("\\sqrt{2}", "1.414213562375"),  # 13 digits, but 1.9 units of the last one away
        ("9ab", "9"),  # math-verify reads only the `9` of `9ab`
        ("1,2,3,\\ldots", "1,2,3"),
    ],
)
def test_distinct_values_are_not_equivalent(a: str, b: str) -> None:
    assert equivalent(a, b, Grader()) is False
    assert equivalent(b, a, Grader()) is False


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("0.333333", "\\frac{1}{3}", True),  # before: False (the decimal rule, 6 digits)
        ("0.666666", "\\frac23", True),  # truncated
        ("0.666667", "\\frac23", True),  # rounded
        ("0.33", "\\frac{1}{3}", False),  # fewer than 6 significant digits: exact
        ("0.333334", "\\frac{1}{3}", True),  # within one unit of the last digit
        ("0.333335", "\\frac{1}{3}", False),  # more than one unit away
        ("0.500001", "\\frac12", False),  # a half is written exactly with 6 digits
        ("0.333333", "0.3333333", False),  # two decimals compare exactly
        ("3.14159", "\\pi", True),
        ("3.14", "\\pi", False),
        ("1.41421", "\\sqrt{2}", True),
    ],
)
def test_decimal_rule(a: str, b: str, expected: bool) -> None:
    assert equivalent(a, b, Grader()) is expected
    assert equivalent(b, a, Grader()) is expected


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("\\frac{6}{4}", "3/2"),
        ("1.5", "\\dfrac32"),
        ("2^{10}", "1024"),
        ("2^10", "1024"),  # TeX reads 2^1 0; math-verify (and every reader) means 1024
        ("1\\times10^{3}", "1000"),
        ("1.5\\cdot10^{-2}", "\\frac{3}{200}"),
        ("2^{-99}", "\\frac{1}{2^{99}}"),
        ("\\sqrt{8}", "2\\sqrt{2}"),
        ("\\log_2 8", "3"),
        ("\\{0.5, 1\\}", "\\{1, \\frac12\\}"),
    ],
)
def test_equal_values_in_different_spellings(a: str, b: str) -> None:
    assert equivalent(a, b, Grader()) is True
    assert equivalent(b, a, Grader()) is True


# ----------------------------------------------------------------------- exact evaluator


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("-3^2", Fraction(-9)),  # the power binds tighter than the sign
        ("2^{3^2}", Fraction(512)),
        ("\\frac{1}{2}+\\frac{1}{3}", Fraction(5, 6)),
        ("(1+2)\\times3", Fraction(9)),
        ("6\\div4", Fraction(3, 2)),
        ("10^{-3}", Fraction(1, 1000)),
        ("2^5", Fraction(32)),
        ("2^{10}", Fraction(1024)),
    ],
)
def test_exact_value(text: str, value: Fraction) -> None:
    assert exact_value(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "2^10",
        "x+1",
        "2\\frac12",
        "2(3)",
        "1/0",
        "0^{-1}",
        "4^{1/2}",
        "10^{10^{10}}",
        "{" * 300 + "1",
    ],
)
def test_exact_value_refuses(text: str) -> None:
    assert exact_value(text) is None  # left to the symbolic grader


def test_decimal_ulp() -> None:
    assert decimal_ulp("0.333333") == Fraction(1, 10**6)
    assert decimal_ulp("0.000333333") == Fraction(1, 10**9)  # leading zeros are not significant
    assert decimal_ulp("123456.7") == Fraction(1, 10)
    assert decimal_ulp("0.33333") is None
    assert decimal_ulp("333333") is None  # integers are exact


# ------------------------------------------------------------------ properties (hypothesis)


def _spellings(value: Fraction) -> list[str]:
    """Ways to write `value` exactly that the in-process evaluator reads."""
    sign = "-" if value < 0 else ""
    p, q = abs(value.numerator), value.denominator
    out = [f"{sign}\\frac{{{p}}}{{{q}}}", f"{sign}\\dfrac{{{2 * p}}}{{{2 * q}}}", f"{sign}{p}/{q}"]
    out.append(f"{sign}\\frac{{{p}}}{{{q}}}+0" if q > 1 else f"{sign}{p}")
    out.append(f"{value - 1}+1" if q == 1 else f"\\frac{{{value.numerator - q}}}{{{q}}}+1")
    for base in (2, 10):
        for n, d in ((p, q), (q, p)):
            e = _exact_log(n, base)
            if e is not None and e > 0 and d == 1:
                power = f"{base}^{{{e}}}" if n == p else f"{base}^{{-{e}}}"
                out.append(sign + power)
    k = _terminating_digits(q)
    if k is not None:  # a terminating decimal: plain and scientific notation
        digits = str(p * 10**k // q).rjust(k + 1, "0")
        decimal = digits[:-k] + "." + digits[-k:] if k else digits
        out.append(sign + decimal + ("0" if k else ""))
        mantissa, exponent = p * 10**k // q, -k
        while mantissa and mantissa % 10 == 0:
            mantissa, exponent = mantissa // 10, exponent + 1
        out.append(f"{sign}{mantissa}\\times10^{{{exponent}}}")
        out.append(f"{sign}{mantissa}\\cdot 10^{{{exponent}}}")
    if q == 1 and p >= 1000 and p < 10**12:
        out.append(f"{sign}{p:,}")  # thousands separators
    return out


def _exact_log(n: int, base: int) -> int | None:
    e = 0
    while n > 1 and n % base == 0:
        n //= base
        e += 1
    return e if n == 1 else None


def _terminating_digits(q: int) -> int | None:
    """k such that q divides 10^k (the value has k decimal digits), else None."""
    for k in range(40):
        if 10**k % q == 0:
            return k
    return None


small = st.integers(-(10**6), 10**6)
values = st.one_of(
    st.builds(Fraction, small),
    st.builds(Fraction, small, st.integers(1, 10**6)),
    st.builds(lambda e, s: s * Fraction(2) ** e, st.integers(-120, 120), st.sampled_from([1, -1])),
    st.builds(lambda e, s: s * Fraction(10) ** e, st.integers(-30, 30), st.sampled_from([1, -1])),
    st.builds(lambda m, e: Fraction(m) * Fraction(10) ** e, small, st.integers(-15, 15)),
)


def _near(v: Fraction, how: int) -> Fraction:
    """A different value close to v (the cases float tolerance used to merge)."""
    return [v + 1, v - 1, 2 * v if v else Fraction(1), v / 2 if v else Fraction(-1)][how]


@FAST
@given(values, st.data())
@pytest.mark.slow
def test_equal_values_in_any_spelling_are_equivalent(value: Fraction, data) -> None:
    spellings = _spellings(value)
    a = data.draw(st.sampled_from(spellings))
    b = data.draw(st.sampled_from(spellings))
    with no_worker():
        assert equivalent(a, b, Grader()), (a, b)


@FAST
@given(values, st.integers(0, 3), st.data())
@pytest.mark.slow
def test_distinct_exact_values_are_never_equivalent(value: Fraction, how: int, data) -> None:
    other = _near(value, how)
    # The decimal rule aside (tested below), any spelling of one is never any spelling of the
    # other: drop decimal spellings with 6+ significant digits on one side.
    a = data.draw(st.sampled_from(_spellings(value)))
    b = data.draw(st.sampled_from(_spellings(other)))
    if decimal_ulp(normalize(a)) is None and decimal_ulp(normalize(b)) is None:
        with no_worker():
            assert not equivalent(a, b, Grader()), (a, b)


def _rule_reference(decimal: str, value: Fraction) -> bool:
    """The decimal rule written out plainly with 100-digit decimals (on the decimal as
    normalised: trailing zeros state no precision)."""
    decimal = decimal.rstrip("0").rstrip(".") if "." in decimal else decimal
    if "." not in decimal:
        return Fraction(decimal) == value
    digits_after = len(decimal.split(".")[1])
    significant = len(decimal.replace("-", "").replace(".", "").lstrip("0"))
    exact = Fraction(decimal)
    if exact == value:
        return True
    if significant < 6 or (value * 10**digits_after).denominator == 1:
        return False
    with localcontext() as ctx:
        ctx.prec = 100
        approx = Decimal(value.numerator) / Decimal(value.denominator)
        return abs(approx - Decimal(decimal)) < Decimal(10) ** -digits_after


@FAST
@given(
    st.integers(1, 10**9),
    st.integers(1, 10**6),
    st.integers(0, 3),
    st.integers(-2, 2),
)
def test_decimal_rule_matches_its_reference(p: int, q: int, shift: int, nudge: int) -> None:
    value = Fraction(p, q)
    k = 6 + shift
    # the decimal that rounds / truncates value to k digits, nudged by a few units
    assume(int(value * 10**k) + nudge >= 0)
    digits = str(int(value * 10**k) + nudge).rjust(k + 1, "0")
    decimal = digits[:-k] + "." + digits[-k:]
    fraction = f"\\frac{{{p}}}{{{q}}}"
    assert decimal_ulp(decimal) is not None or len(decimal.replace(".", "").lstrip("0")) < 6
    with no_worker():
        assert equivalent(decimal, fraction, Grader()) is _rule_reference(decimal, value), (
            decimal,
            value,
        )


@FAST
@given(values, values)
def test_values_match_is_exact_without_a_decimal(x: Fraction, y: Fraction) -> None:
    assert values_match(x, None, y, None) is (x == y)


# --------------------------------------------------------------------------- bounded time


@pytest.mark.parametrize(
    "text",
    [
        "{" * 5000 + "1" + "}" * 5000,  # before: 15 s
        "{" * 50_000 + "1" + "}" * 50_000,  # before: > 20 s
        "\\frac12" * (1_000_000 // 7),  # before: > 20 s
        "{" * 499 + "1" + "}" * 499,  # under the length cap: still linear
        "\\frac12" * 140,
        "\\text{a}" * 120,
    ],
)
def test_normalize_is_fast_on_pathological_input(text: str) -> None:
    t0 = time.process_time()  # CPU time: the work done, not how busy the machine is
    once = normalize(text)
    assert time.process_time() - t0 < 0.5
    assert normalize(once) == once


def test_over_long_answers_match_only_themselves() -> None:
    long = "1" + "0" * answers.MAX_ANSWER_CHARS
    assert normalize(long) == long
    with no_worker():
        assert equivalent(long, long, Grader())
        assert not equivalent(long, long + "0", Grader())
        assert not equivalent(long, "1" + "0" * (answers.MAX_ANSWER_CHARS - 1) + ".0", Grader())


TOWERS = [f"{k}^{{{k}^{{{k}^{{{k}}}}}}}" for k in range(3, 9)]  # sympy cannot evaluate these


@pytest.mark.slow
def test_budget_bounds_a_group_of_towers() -> None:
    """Before: `cluster` of these 6 answers took > 100 s (5 s per call, 2-3x that per timeout)."""
    t0 = time.perf_counter()
    grader = Grader(budget_s=3, pair_timeout=5)
    ids = cluster(TOWERS, grader)
    elapsed = time.perf_counter() - t0
    assert ids == list(range(len(TOWERS)))  # undecided pairs: different
    assert grader.timeouts > 0
    assert elapsed < grader.budget_s + 3, elapsed  # + killing and forking a worker under load


PATHOLOGICAL = [
    "{" * 5000 + "1" + "}" * 5000,
    "{" * 499 + "2" + "}" * 499,
    "\\frac12" * (1_000_000 // 7),
    "\\frac13" * (1_000_000 // 7),
    *TOWERS[:3],
    "k^{k^{k^{k}}}",
    "x^{x^{x^{x^{x}}}}-k^{k^{k}}",
    "10^{10^{10}}",
    "10^{10^{10}}+1",
    "e^{e^{e^{e^{10}}}}",
    "\\sqrt{2}^{\\sqrt{2}^{\\sqrt{2}^{\\sqrt{2}}}}",
    "\\frac{\\frac{\\frac{1}{x}}{y+\\frac1z}}{\\sqrt[7]{\\pi^{e}}}",
    "7",
    "7",
]


@pytest.mark.slow
def test_a_step_of_pathological_answers_stays_within_the_budget() -> None:
    """The trainer's reward path (one budget per step, `make_group` then `compute_rewards`, and
    the label check) on a group built to stall a grader: done within budget + 1 s."""
    budget_s = 3.0
    t0 = time.perf_counter()
    grading = Grader(budget_s, pair_timeout=5)
    group = make_group(PATHOLOGICAL, label="7", grader=grading)
    correct = [equivalent(a, "7", grading) for a in PATHOLOGICAL]
    total, parts = compute_rewards([group], ["soft_vote", "format"])
    elapsed = time.perf_counter() - t0
    assert elapsed < budget_s + 3, elapsed  # + killing and forking a worker under load
    assert grading.timeouts > 0
    assert correct[-2:] == [True, True] and not any(correct[:-2])
    assert group.classes[-1] == group.classes[-2]  # the two 7s still vote together
    assert len(total) == len(PATHOLOGICAL) and parts["format"].tolist() == [1.0] * len(total)


@pytest.mark.skipif(not worker_module._FORK, reason="workers are spawned here: nothing to warm")
def test_grader_warm_up_starts_once_per_process_and_finishes():
    event = answers.start_grader_warm_up()
    assert answers.start_grader_warm_up() is event  # one warm-up per process
    assert event.wait(timeout=120)
    assert equivalent("x+1", "1+x", Grader())  # the pool then answers within a default budget


# ------------------------------------------------------------------- one grader per stage


@pytest.mark.slow
def test_validation_grades_with_its_own_budget(tiny_overrides, monkeypatch):
    """A training step that spends its whole budget leaves validation's intact, and step-0
    validation gets `reward.grading_budget_s` (before: it drew from a never-reset context)."""
    from omgrpo.backends.native import trainer as native
    from omgrpo.backends.native import validation
    from omgrpo.config import compose

    real_score, real_make = native.score_step, validation.make_group
    step_graders: list[Grader] = []
    val_graders: list[Grader] = []

    def exhausting_score(*args, grader: Grader, **kwargs):
        batch = real_score(*args, grader=grader, **kwargs)
        grader.spent = grader.budget_s  # as if this step's pairs had used it all
        step_graders.append(grader)
        return batch

    def spying_make(*args, grader: Grader, **kwargs):
        val_graders.append(grader)
        return real_make(*args, grader=grader, **kwargs)

    monkeypatch.setattr(native, "score_step", exhausting_score)
    monkeypatch.setattr(validation, "make_group", spying_make)
    overrides = ["trainer.steps=2", "eval.every=1", "reward.grading_budget_s=7.5"]
    native.train(compose([*tiny_overrides, *overrides, "run.name=budgets"]))
    per_stage = list({id(g): g for g in val_graders}.values())
    assert len(step_graders) == 2 and len(per_stage) == 3  # validations at steps 0, 1, 2
    assert all(g.left() <= 0 for g in step_graders)
    assert all(g.budget_s == 7.5 and g.left() > 0 for g in per_stage)
    assert not {id(g) for g in per_stage} & {id(g) for g in step_graders}


# ------------------------------------------- false positives found on math-verify's suite


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # an equation whose left side is not a single variable is not its right side
        ("a + 3z = 0", "0"),
        ("2x + z = 1", "1"),
        ("a^2 + b = 0", "0"),
        ("7 = 11a + c", "11a + c"),
        # an ordered tuple is not a set
        ("(3,1)", "\\{1,3\\}"),
        ("(3, 1)", "{1, 3}"),
        # a comma followed by a space separates list items, not thousands
        ("32, 349", "32349"),
        ("\\boxed{32, 349}", "32349"),
        ("1, 000", "1000"),
        # `a:b` with b = 0 is no number (sympy's zoo), and two of them are not equal
        ("12:00", "1:00"),
    ],
)
def test_math_verify_suite_false_positives_stay_fixed(a: str, b: str) -> None:
    assert equivalent(a, b, Grader()) is False
    assert equivalent(b, a, Grader()) is False


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("x = 5", "5"),  # a single variable's assignment is its value
        ("k=\\frac12", "0.5"),
        ("32,349", "32349"),  # no space: a thousands separator
        ("32,\\! 349", "32349"),  # `\!` marks a thousands separator
        ("11,\\!111,\\!111,\\!100", "11111111100"),
        ("\\{1,3\\}", "\\{3,1\\}"),
        ("0 < x < 1", "(0, 1)"),  # an inequality and its interval: math-verify, one way
        ("\\infty", "\\infty"),
    ],
)
def test_what_those_fixes_keep_equal(a: str, b: str) -> None:
    assert equivalent(a, b, Grader()) is True
    assert equivalent(b, a, Grader()) is True


_symbols = st.sampled_from(["a", "b", "x", "y", "z", "\\sqrt{y}"])
_with_numbers = st.sampled_from(["2x", "3z", "a^2", "y^3", "1"])


@settings(max_examples=30)
@given(st.lists(_symbols, max_size=2, unique=True), _with_numbers, st.integers(-20, 20))
def test_an_equation_is_never_its_right_side(symbols: list[str], term: str, value: int) -> None:
    """`lhs = v` against `v` for a left side with a number in it (math-verify's `verify` reads a
    predicted equation by its right side; omgrpo must not, in either order). A left side of
    symbols alone names a quantity (`x = 5`, `f(x) = 1`): math-verify's assignment rule."""
    equation = f"{' + '.join([*symbols, term])} = {value}"
    assert not equivalent(equation, str(value), Grader()), equation
    assert not equivalent(str(value), equation, Grader()), equation


@FAST
@given(st.integers(1, 999), st.integers(0, 999), st.sampled_from([", ", ",  ", ",\n"]))
def test_a_comma_space_group_is_a_list_not_thousands(head: int, tail: int, sep: str) -> None:
    listed, number = f"{head}{sep}{tail:03d}", f"{head}{tail:03d}"
    assert normalize(normalize(listed)) == normalize(listed)  # still idempotent
    assert normalize(listed) != normalize(number)
    assert normalize(f"{head},{tail:03d}") == normalize(number)
    with no_worker():  # decided by the exact path once the list is read as a list
        assert equivalent(f"{head},{tail:03d}", number, Grader())


@FAST
@given(st.integers(1, 999), st.integers(0, 999))
def test_a_comma_space_group_never_equals_its_thousands_reading(head: int, tail: int) -> None:
    assert not equivalent(f"{head}, {tail:03d}", f"{head}{tail:03d}", Grader(math_verify=False))


# --------------------------------------------------------- math-verify's own test suite


@pytest.mark.slow
def test_no_false_positives_on_math_verify_suite() -> None:
    """No pair math-verify's tests mark different is equal here (tests/fixtures/math_verify:
    its regression pairs, graded as a vote grades them; `omgrpo.tools.grading_check`)."""
    from omgrpo.tools.grading_check import grade_pairs, load_pairs

    different = [r for r in load_pairs() if not r["expected"]]
    assert len(different) >= 35
    merged = [(v.gold, v.pred) for v in grade_pairs(different) if v.omgrpo]
    assert merged == []


@pytest.mark.slow
def test_docs_report_the_agreement_on_math_verify_suite() -> None:
    """docs/grading.md shows the table `python -m omgrpo.tools.grading_check` prints."""
    from pathlib import Path

    from omgrpo.tools.grading_check import agreement_table, grade_pairs, load_pairs

    verdicts = grade_pairs(load_pairs())
    assert not [v for v in verdicts if v.kind == "false_positive"]
    docs = Path(__file__).resolve().parents[2] / "docs" / "grading.md"
    assert agreement_table(verdicts) in docs.read_text()


def test_grading_check_names_a_missing_fixture(tmp_path, capsys) -> None:
    """An installed wheel has no tests/ folder: the tool says where it looked and what to pass."""
    from omgrpo.tools.grading_check import main

    missing = tmp_path / "pairs.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["--fixture", str(missing)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--fixture" in err
