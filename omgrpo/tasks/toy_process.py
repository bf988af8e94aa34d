"""Process quality in the toy world, graded exactly (no judge).

The paper's appendix "Direct Process-Quality Evaluation" scores reasoning ReCEval-style with an
LLM judge: are the steps correct, do they move toward the result (informativeness), does the
final answer follow from them (support). In the toy world every step is a line `a op b = c` and
the problem's chain is known, so each can be counted. The same reading splits the guess rate into
its kinds, which tell how the guess route works: a box that is not the value the reasoning computed
last is a truncated copy ("1" for 152: the answer stopped early), a copy error (one digit off), a
consequence of a malformed line, or a guess from the prior.
"""

from __future__ import annotations

import re

from omgrpo.core.answers import normalize
from omgrpo.core.task import ProcessGrade

# `a op b = c` on one line, with the spacing the toy world's `last_result` accepts.
_COMPUTED = re.compile(r"^\s*(\d+)\s*([+\-*])\s*(\d+)\s*=\s*(\d+)\s*$")
_QUESTION = re.compile(r"^Evaluate left to right: (\d+)((?:[+\-*]\d+)+)$")
_OPERATION = re.compile(r"([+\-*])(\d+)")

Chain = tuple[int, list[tuple[str, int]]]


def parse_question(question: str) -> Chain | None:
    """The start value and the operations of a toy question ("Evaluate left to right: 7+5*3"
    -> (7, [("+", 5), ("*", 3)])); None for any other text (a paraphrase, a file task)."""
    m = _QUESTION.match(question.strip())
    if m is None:
        return None
    return int(m.group(1)), [(op, int(n)) for op, n in _OPERATION.findall(m.group(2))]


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def reasoning_lines(text: str) -> tuple[list[tuple[int, str, int, str]], int]:
    """The computed lines (a, op, b, c as written) before the last `\\boxed`, and the number of
    malformed ones. The text on the box's own line before `\\boxed` ("So the answer is ") is
    the closing sentence, not a line, unless it is itself a computed line (as `last_result`
    reads it); blank lines are skipped."""
    box = text.rfind("\\boxed")
    segments = (text if box < 0 else text[:box]).split("\n")
    computed, malformed = [], 0
    for i, segment in enumerate(segments):
        m = _COMPUTED.match(segment)
        if m:
            computed.append((int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)))
        elif segment.strip() and (box < 0 or i < len(segments) - 1):
            malformed += 1
    return computed, malformed


def _one_edit(a: str, b: str) -> bool:
    """Whether `a` and `b` differ by one substituted, inserted or deleted character, or by two
    neighbours swapped."""
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        swapped = len(diff) == 2 and diff[1] == diff[0] + 1
        return len(diff) == 1 or (swapped and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long_ = sorted((a, b), key=len)
    if len(long_) - len(short) != 1:
        return False
    return any(long_[:i] + long_[i + 1 :] == short for i in range(len(long_)))


def guess_kind(answer: str | None, computed: str | None, malformed: int) -> str | None:
    """The kind of guess (`omgrpo.core.task.GUESS_KINDS`) of a box holding `answer` after
    reasoning whose last computed value is `computed` (None: no computed line) with `malformed`
    malformed lines; None when it is no guess (no answer, or the computed value boxed). Tested
    in order: no computed line (malformed lines only: `malformed`, nothing at all: `prior`),
    a proper prefix of the computed value (`truncated`), one edit away (`copy_error`), any
    malformed line (`malformed`), else `prior`."""
    if answer is None:
        return None
    boxed = normalize(answer)
    if computed is not None and boxed == computed:
        return None
    if computed is None:
        return "malformed" if malformed else "prior"
    if boxed and computed.startswith(boxed):
        return "truncated"
    if _one_edit(boxed, computed):
        return "copy_error"
    return "malformed" if malformed else "prior"


def grade_process(chain: Chain, text: str, answer: str | None) -> ProcessGrade:
    """`text`'s reasoning graded against the problem `chain` (`parse_question`); `answer` is
    the rollout's extracted boxed answer (None: none)."""
    start, operations = chain
    computed, malformed = reasoning_lines(text)
    valid = sum(_apply(a, op, b) == int(c) for a, op, b, c in computed)
    informative, value = 0, start
    for a, op, b, c in computed:
        if informative < len(operations) and a == value and (op, b) == operations[informative]:
            informative += 1
            value = int(c)
    last = computed[-1][3] if computed else None
    kind = guess_kind(answer, last, malformed)
    chained = all(
        a == (start if i == 0 else int(computed[i - 1][3])) for i, (a, *_) in enumerate(computed)
    )
    lines = len(computed) + malformed
    return ProcessGrade(
        lines=lines,
        valid=valid,
        informative=informative,
        malformed=malformed,
        supported=bool(
            answer is not None
            and computed
            and kind is None
            and not malformed
            and valid == len(computed)
            and chained
        ),
        chain_correct=bool(
            lines == len(operations) == valid == informative and not malformed and operations
        ),
        guess_kind=kind,
    )
