"""omgrpo's grader on math-verify's own regression pairs: agreement, by class of disagreement.

``python -m omgrpo.tools.grading_check [--mv]`` prints the table of `docs/grading.md`
(``--mv`` adds how many upstream labels the installed math-verify itself reproduces).

Each pair is graded as a vote grades it: the final answer of each side is the content of its
last ``\\boxed{}`` (a side without one is taken whole, as a bare answer), then `equivalent`
with a fresh default `Grader`. The fixture (`tests/fixtures/math_verify/pairs.jsonl`) holds the
``(gold, pred, expected)`` rows of math-verify's test suite with the options each test used.
A pair upstream marks different must never be equal here (a false positive would merge
distinct answers in a vote); false negatives are sorted into the classes below.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omgrpo.core.answers import Grader, equivalent, extract_boxed, normalize

__all__ = ["CLASSES", "Verdict", "agreement_table", "final_answer", "grade_pairs", "load_pairs"]

FIXTURE = Path(__file__).resolve().parents[2] / "tests/fixtures/math_verify/pairs.jsonl"

CLASSES = {
    "free_text": "a side is prose with no `\\boxed{}`: omgrpo grades the last box only",
    "several_boxes": "several `\\boxed{}` on a side: omgrpo grades the last one only",
    "units": "a unit or a percent word (`28 percent`, `125 miles`, `m²`, `€`)",
    "decimal_comma": "a comma as the decimal point (`1,22` = 1.22): omgrpo reads a list",
    "option": "the test sets a non-default math-verify option (precision, strict, set-relation)",
    "membership": "`x \\in S` against an inequality: math-verify compares them one way only",
    "upstream_fp": "the upstream label records a math-verify false positive (`1-1/e` = `1+1/e`)",
    "other": "anything else",
}
"""Classes of disagreement, checked in this order (the first that applies)."""

# Rows whose upstream label is a known math-verify false positive that omgrpo fixes on purpose
# (tests/core/test_grading.py::test_distinct_values_are_not_equivalent has the same pair).
_UPSTREAM_FP = {("tests/test_yujianll.py", "test_string_extraction", 9)}
_DEFAULT_OPTIONS = {"precision": 6, "strict": True, "allow_set_relation_comp": False}
_UNIT = re.compile(r"percent|pct|miles|cm\b|m²|€", re.IGNORECASE)
_PROSE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{4,}")  # a word that is not a LaTeX command
_MEMBERSHIP = re.compile(r"\\in\b")


@dataclass(frozen=True)
class Verdict:
    row: dict[str, Any]
    gold: str  # final answers as graded
    pred: str
    omgrpo: bool

    @property
    def expected(self) -> bool:
        return bool(self.row["expected"])

    @property
    def kind(self) -> str:
        """agree / false_positive / false_negative."""
        if self.omgrpo == self.expected:
            return "agree"
        return "false_positive" if self.omgrpo else "false_negative"


def load_pairs(path: str | Path = FIXTURE) -> list[dict[str, Any]]:
    """The fixture's rows (its first line is a header: upstream, commit, license)."""
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines[1:] if line.strip()]


def final_answer(text: str) -> str:
    """The content of the last ``\\boxed{}``, else the whole text (a bare answer)."""
    boxed = extract_boxed(text)
    return boxed.content if boxed is not None else text


def grade_pairs(rows: list[dict[str, Any]]) -> list[Verdict]:
    """omgrpo's verdict on each row, each with its own default `Grader` (its own budget)."""
    verdicts = []
    for row in rows:
        gold, pred = final_answer(row["gold"]), final_answer(row["pred"])
        verdicts.append(Verdict(row, gold, pred, equivalent(gold, pred, Grader())))
    return verdicts


def classify(v: Verdict) -> str:
    """The class of a disagreement (`CLASSES`); "agree" for an agreement."""
    if v.kind == "agree":
        return "agree"
    row = v.row
    if (row["source"], row["test"], row["index"]) in _UPSTREAM_FP:
        return "upstream_fp"
    options = row.get("options", {})
    if any(options.get(k, d) != d for k, d in _DEFAULT_OPTIONS.items()):
        return "option"
    texts = (row["gold"], row["pred"])
    if any(t.count("\\boxed") > 1 for t in texts):
        return "several_boxes"
    if any(extract_boxed(t) is None and _PROSE.search(_words(t)) for t in texts):
        return "free_text"
    if any(_UNIT.search(t) for t in texts):
        return "units"
    if _decimal_comma(v.gold, v.pred) or _decimal_comma(v.pred, v.gold):
        return "decimal_comma"
    if any(_MEMBERSHIP.search(t) for t in (v.gold, v.pred)):
        return "membership"
    return "other"


def _words(text: str) -> str:
    """The text without LaTeX commands and unit words (what is left of prose)."""
    return _UNIT.sub(" ", re.sub(r"\\[a-zA-Z]+", " ", text))


def _decimal_comma(a: str, b: str) -> bool:
    """`a` is `b` with a comma for its decimal point (`1000,99` and `1000.99`)."""
    return "," in a and normalize(a.replace(",", ".")) == normalize(b)


def agreement_table(verdicts: list[Verdict]) -> str:
    """The Markdown table of `docs/grading.md`: counts by outcome and class."""
    kinds = Counter(v.kind for v in verdicts)
    by_class = Counter((v.kind, classify(v)) for v in verdicts if v.kind != "agree")
    lines = [
        "| pairs | agree | false positives | false negatives |",
        "|---|---|---|---|",
        f"| {len(verdicts)} | {kinds['agree']} | {kinds['false_positive']} "
        f"| {kinds['false_negative']} |",
        "",
        "| outcome | class | pairs | meaning |",
        "|---|---|---|---|",
    ]
    for (kind, cls), n in sorted(by_class.items()):
        lines.append(f"| {kind.replace('_', ' ')} | {cls} | {n} | {CLASSES[cls]} |")
    return "\n".join(lines)


def mv_reproduces(row: dict[str, Any]) -> bool:
    """Whether the installed math-verify gives the row's upstream label (its test's options)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    options = row.get("options", {})
    kinds = options.get("match_types")
    if kinds is None:  # a test that calls parse / verify with their defaults
        gold, pred = parse(row["gold"]), parse(row["pred"])
        return bool(verify(gold, pred)) == bool(row["expected"])
    config = [
        LatexExtractionConfig(boxed_match_priority=0) if k == "latex" else ExprExtractionConfig()
        for k in kinds
    ]
    ok = verify(
        parse(row["gold"], config),
        parse(row["pred"], config),
        float_rounding=options.get("precision", 6),
        strict=options.get("strict", True),
        allow_set_relation_comp=options.get("allow_set_relation_comp", False),
    )
    return bool(ok) == bool(row["expected"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default=str(FIXTURE))
    parser.add_argument("--mv", action="store_true", help="also run the installed math-verify")
    parser.add_argument("--list", action="store_true", help="list every disagreement")
    args = parser.parse_args(argv)
    if not Path(args.fixture).is_file():  # the default lives in a source checkout, not a wheel
        parser.error(f"no fixture at {args.fixture}: pass --fixture PATH to a pairs.jsonl "
                     "(tests/fixtures/math_verify/pairs.jsonl in a clone of omgrpo)")  # fmt: skip
    rows = load_pairs(args.fixture)
    verdicts = grade_pairs(rows)
    print(agreement_table(verdicts))
    if args.mv:
        import importlib.metadata

        same = sum(mv_reproduces(r) for r in rows)
        version = importlib.metadata.version("math-verify")
        print(f"\nmath-verify {version} reproduces {same} of {len(rows)} upstream labels")
    if args.list:
        for v in verdicts:
            if v.kind != "agree":
                r = v.row
                print(f"{v.kind} {classify(v)} {r['test']}[{r['index']}]: {v.gold!r} | {v.pred!r}")


if __name__ == "__main__":
    main()
