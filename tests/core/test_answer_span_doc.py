"""docs/answer-span.md's tokenizer table, recomputed: every row's pre-tokens, the tokens the
paper's span (`boxed`) and the closing span (`closing`) mark, and the token that decides where the
answer ends, from the published pre-tokenizers of Qwen2.5/Qwen3 and Llama-3 (built with
`tokenizers`, no vocabulary or weights) and the project's own span code (`answer_token_mask`).

Offline and fast: two regex pre-tokenizers, a dozen short strings. ``python
tests/core/test_answer_span_doc.py`` prints the table rows for the endings in ``ENDINGS``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from tokenizers import Regex, pre_tokenizers

from omgrpo.core.spans import answer_char_span, answer_token_mask

DOC = Path(__file__).resolve().parents[2] / "docs" / "answer-span.md"

# Qwen2 / Qwen2.5 / Qwen3: digits one by one (`\p{N}`). transformers' PRETOKENIZE_REGEX in
# models/qwen2/tokenization_qwen2.py and Qwen2Converter in convert_slow_tokenizer.py.
QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama-3 (3, 3.1, 3.2, 3.3): digits in groups of up to three (`\p{N}{1,3}`), tiktoken's cl100k
# pattern. meta-llama/llama3 llama/tokenizer.py `pat_str`; TikTokenConverter's default pattern.
LLAMA3_REGEX = QWEN_REGEX.replace(r"\p{N}|", r"\p{N}{1,3}|")
FAMILIES = {"Qwen2.5/Qwen3": (QWEN_REGEX, 1), "Llama-3": (LLAMA3_REGEX, 3)}
EOS = "<eos>"
DEPENDS = "*"  # the cell's mark depends on the BPE merges inside a pre-token

# (response tail, ends with eos): the endings the doc's table must hold, for both families.
ENDINGS = [
    (r"is \boxed{1}", False),
    (r"is \boxed{17}", False),
    (r"is \boxed{123}", False),
    (r"is \boxed{1}.", False),
    (r"is $\boxed{1}$", False),
    (r"is $\mathbf{\boxed{1}}$", False),
    (r"is \boxed{\frac{1}{2}}", False),
    (r"is \boxed{1}", True),
    (r"is $\boxed{1}$", True),
]
REQUIRED = [r"\boxed{1}", r"\boxed{17}", r"\boxed{1}.", r"\boxed{1}$", r"\boxed{1}}$"]
REQUIRED += [r"\boxed{\frac{1}{2}}"]


def pre_tokenizer(regex: str) -> pre_tokenizers.PreTokenizer:
    """The family's `pre_tokenizer` as its tokenizer.json defines it: Split (isolated) with the
    regex, then ByteLevel without its own regex (so the Split is the only split)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


PRE = {family: pre_tokenizer(regex) for family, (regex, _) in FAMILIES.items()}


def code(piece: str) -> str:
    return f"`{piece}`"


def marks(pieces: list[tuple[str, tuple[int, int]]], text: str, span: str, eos: bool) -> str:
    """The pre-tokens `span` marks, through `answer_token_mask` on pre-token offsets (plus the
    eos as a stop token with an empty offset, as `response_offsets` gives it). A pre-token only
    partly inside the character span gets `*`: the BPE token holding the span's characters is
    marked, the rest only if merged with it. The eos gets `*` when the token before it is such a
    partly marked pre-token whose last character is outside the span."""
    n = len(text)
    offsets = [off for _, off in pieces] + ([(n, n)] if eos else [])
    stop = [False] * len(pieces) + ([True] if eos else [])
    mask = answer_token_mask(text, offsets, span, stop if eos else None).tolist()
    lo, hi = answer_char_span(text, span)
    out = []
    for (piece, (s, e)), marked in zip(pieces, mask):
        if marked:
            out.append(code(piece) + ("" if lo <= s and e <= hi else DEPENDS))
    if eos and mask[-1]:
        last_s, last_e = pieces[-1][1]
        certain = last_e <= hi or last_s >= hi
        out.append(code(EOS) + ("" if certain else DEPENDS))
    return " ".join(out) if out else "none"


def decider(pieces: list[tuple[str, tuple[int, int]]], text: str, group: int) -> str:
    """The pre-token at which the answer's end is decided, and whether each span marks it.

    When the content ends in a digit group shorter than the family's longest (`group`), the
    number's length was fixed when that group was written (another digit would have joined the
    group); it lies inside both spans, and a group of 2-3 digits being one token depends on the
    vocabulary (`*`). Otherwise the end is decided by the token holding the box's closing `}`
    (written "`}` of `}$`" when that `}` shares its pre-token): inside a span when that `}` is in
    it, outside when its pre-token does not touch the span, else `*` (inside only if merged with
    the content's last character)."""
    end = answer_char_span(text, "boxed")[1]
    last = next(p for p in pieces if p[1][0] < end <= p[1][1])
    if last[0].isdigit() and len(last[0]) < group:
        token = code(last[0]) + (DEPENDS if len(last[0]) > 1 else "")
        return f"{token} (`boxed`: inside, `closing`: inside)"
    holder = next(p for p in pieces if p[1][0] <= end < p[1][1])
    where = []
    for span in ("boxed", "closing"):
        s_lo, s_hi = answer_char_span(text, span)
        if s_lo <= end < s_hi:
            where.append(f"`{span}`: inside")
        elif holder[1][1] <= s_lo or holder[1][0] >= s_hi:
            where.append(f"`{span}`: outside")
        else:
            where.append(f"`{span}`: inside{DEPENDS}")
    token = code("}") + ("" if holder[0] == "}" else f" of {code(holder[0])}")
    return f"{token} ({', '.join(where)})"


def row(tail: str, eos: bool, family: str) -> list[str]:
    """The table's cells for one ending and family."""
    group = FAMILIES[family][1]
    pieces = PRE[family].pre_tokenize_str(tail)
    tokens = " ".join(code(p) for p, _ in pieces) + (f" {code(EOS)}" if eos else "")
    return [
        code(tail) + (" + eos" if eos else ""),
        family,
        tokens,
        marks(pieces, tail, "boxed", eos),
        marks(pieces, tail, "closing", eos),
        decider(pieces, tail, group),
    ]


def render(endings: list[tuple[str, bool]] = ENDINGS) -> str:
    return "\n".join(
        "| " + " | ".join(row(tail, eos, family)) + " |"
        for tail, eos in endings
        for family in FAMILIES
    )


def doc_rows() -> list[list[str]]:
    """The doc's tokenizer table: the rows of the first table whose header starts `| ending |`."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| ending |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


ENDING_CELL = re.compile(r"^`([^`]+)`( \+ eos)?$")


def test_table_rows_recompute():
    rows = doc_rows()
    assert rows, "no tokenizer table in docs/answer-span.md"
    for cells in rows:
        m = ENDING_CELL.match(cells[0])
        assert m, f"ending cell {cells[0]!r}: expected `text` or `text` + eos"
        assert cells[1] in FAMILIES, f"unknown family {cells[1]!r}"
        want = row(m.group(1), bool(m.group(2)), cells[1])
        assert cells == want, f"row for {cells[0]} / {cells[1]} drifted:\n{cells}\n{want}"


def test_table_covers_the_endings_for_both_families():
    seen = {(cells[0], cells[1]) for cells in doc_rows()}
    for tail, eos in ENDINGS:
        for family in FAMILIES:
            assert (code(tail) + (" + eos" if eos else ""), family) in seen, (tail, eos, family)
    tails = [ENDING_CELL.match(ending).group(1) for ending, _ in seen]
    for ending in REQUIRED:
        assert any(tail.endswith(ending) for tail in tails), ending
    assert any(ending.endswith("+ eos") for ending, _ in seen)


def test_the_leak_in_one_line():
    """The inference the doc draws: with Qwen's one-digit pre-tokens the choice between "1" and
    "17" is made at the `}` token, which the paper's span leaves out and the closing span holds;
    with Llama-3's groups "17" is one pre-token, inside the paper's span."""
    assert row(r"is \boxed{1}", False, "Qwen2.5/Qwen3")[5] == (
        "`}` (`boxed`: outside, `closing`: inside)"
    )
    assert [p for p, _ in PRE["Qwen2.5/Qwen3"].pre_tokenize_str("{17}")] == ["{", "1", "7", "}"]
    assert [p for p, _ in PRE["Llama-3"].pre_tokenize_str("{17}")] == ["{", "17", "}"]
    assert [p for p, _ in PRE["Llama-3"].pre_tokenize_str("{1234}")] == ["{", "123", "4", "}"]


def test_doc_quotes_the_regexes():
    text = DOC.read_text()
    assert f"`{QWEN_REGEX}`" in text
    assert f"`{LLAMA3_REGEX}`" in text


def test_regexes_match_the_installed_transformers():
    """Where transformers is installed, its Qwen2 tokenizer and its tiktoken converter (the
    Llama-3 conversion's default pattern) spell the same regexes (read as text, not imported)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("transformers is not installed")
    root = Path(spec.submodule_search_locations[0])
    qwen = root / "models" / "qwen2" / "tokenization_qwen2.py"
    convert = root / "convert_slow_tokenizer.py"
    if not (qwen.exists() and convert.exists()):
        pytest.skip("this transformers has no qwen2 tokenizer / converter source")
    assert f'PRETOKENIZE_REGEX = r"""{QWEN_REGEX}"""' in qwen.read_text()
    source = convert.read_text()
    tiktoken = source[source.index("class TikTokenConverter") :]
    assert f'pattern=r"""{LLAMA3_REGEX}"""' in tiktoken[: tiktoken.index("self.pattern")]


if __name__ == "__main__":
    print(render())
