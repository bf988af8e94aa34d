"""Final-answer extraction: the content of the last ``\\boxed{}`` of a response.

The last box is the model's answer by rule: a malformed last box gives no answer rather than an
earlier box. The brace helpers here are shared with `normalize`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

__all__ = ["Boxed", "extract_boxed"]

logger = logging.getLogger(__name__)


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
