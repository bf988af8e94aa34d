"""Extract math-verify's (gold, prediction, expected) regression pairs into a JSONL fixture.

Usage: python scripts/extract_math_verify_pairs.py MATH_VERIFY_CHECKOUT [OUT]

Reads every ``@pytest.mark.parametrize`` list in the checkout's ``tests/*.py`` whose argument
names include a gold and a prediction, plus the keyword options of the comparison call in the
test body (``match_types``, ``precision``, ``strict``, ...), with `ast`: nothing of the
checkout is imported or run (one row formats ``math.sqrt(17)`` in an f-string: it is evaluated
with only `math` in scope). Data only; math-verify is Apache-2.0 (see the fixture's README).
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

_GOLD = ("gold",)
_PRED = ("pred", "prediction")
_EXPECTED = ("expected", "result")
_OPTIONS = ("match_types", "precision", "strict", "allow_set_relation_comp")


def _argnames(node: ast.expr) -> list[str]:
    value = ast.literal_eval(node)
    names = value.split(",") if isinstance(value, str) else list(value)
    return [n.strip() for n in names]


def _call_options(fn: ast.FunctionDef) -> dict[str, object]:
    """Literal keyword options of the comparison call in the test body (parametrized ones are
    taken from the row instead)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "compare_strings":
            options = {}
            for kw in node.keywords:
                if kw.arg in _OPTIONS and not isinstance(kw.value, ast.Name):
                    options[kw.arg] = ast.literal_eval(kw.value)
            return options
    return {}


def _literal(node: ast.expr) -> object:
    """A literal row; one upstream row formats ``math.sqrt(17)`` in an f-string, so such rows
    are evaluated with only `math` in scope."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        code = compile(ast.Expression(node), "<row>", "eval")
        return eval(code, {"__builtins__": {}, "math": math})


def _pick(row: dict[str, object], names: tuple[str, ...]) -> object:
    return next(row[n] for n in names if n in row)


def pairs_of(path: Path, source_name: str) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    tree = ast.parse(path.read_text())
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for deco in fn.decorator_list:
            if not (isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("parametrize")):
                continue
            names = _argnames(deco.args[0])
            if not (set(names) & set(_GOLD) and set(names) & set(_PRED)):
                continue
            options = _call_options(fn)
            for i, element in enumerate(deco.args[1].elts):
                values = _literal(element)
                row = dict(zip(names, values))
                extra = {k: row[k] for k in _OPTIONS if k in row}
                rows.append(
                    {
                        "source": source_name,
                        "test": fn.name,
                        "index": i,
                        "gold": _pick(row, _GOLD),
                        "pred": _pick(row, _PRED),
                        "expected": int(_pick(row, _EXPECTED)),
                        "options": {**options, **extra},
                    }
                )
    return rows


def main(checkout: str, out: str = "tests/fixtures/math_verify/pairs.jsonl") -> None:
    """Write the pairs of the checkout at `checkout` to `out` (a header line, then the rows)."""
    root = Path(checkout)
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    rows = []
    for path in sorted((root / "tests").glob("test_*.py")):
        rows += pairs_of(path, f"tests/{path.name}")
    with open(out, "w") as f:
        f.write(
            json.dumps(
                {
                    "upstream": "huggingface/Math-Verify",
                    "commit": commit,
                    "license": "Apache-2.0",
                    "rows": len(rows),
                }
            )
            + "\n"
        )
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} pairs -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
