"""Token <-> character alignment of the final boxed answer in a generated response.

Outcome masking needs to know which *response tokens* spell the final answer. The answer is
located at the character level by :func:`omgrpo.core.answers.extract_boxed` (the content of the last
``\\boxed{...}``) and mapped to tokens through per-token character offsets.

* :func:`response_offsets` -- character offsets of generated token ids in the decoded text;
  works with any HF fast tokenizer, including sampled (non-canonical) token sequences and
  byte-level BPE pieces that split a UTF-8 character.
* :func:`answer_token_mask` -- boolean mask of the tokens overlapping the answer content.
* :func:`answer_mask_for_ids` -- both in one call.
* :func:`span_token_mask` -- the tokens overlapping any character span (token roles).
* :func:`answer_char_span` / :func:`with_stop_token` -- the span choice (`algorithm.answer_span`,
  :data:`ANSWER_SPANS`): the paper's box content, or also the tokens that end the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omgrpo.core.answers import Boxed, extract_boxed
from omgrpo.core.choices import ANSWER_SPANS

__all__ = [
    "ANSWER_SPANS",
    "answer_char_span",
    "answer_mask_for_ids",
    "answer_token_mask",
    "response_offsets",
    "span_token_mask",
    "with_stop_token",
]


_REPLACEMENT = "\ufffd"  # what decoders emit for an incomplete UTF-8 byte sequence


def _as_offset_tensor(offset_mapping: Any) -> torch.Tensor:
    """``offset_mapping`` (list of pairs, (T, 2) tensor / array) -> (T, 2) int64 tensor."""
    if isinstance(offset_mapping, torch.Tensor):
        offsets = offset_mapping.detach().to(device="cpu", dtype=torch.long)
    else:
        offsets = torch.as_tensor([tuple(map(int, p)) for p in offset_mapping], dtype=torch.long)
    return offsets.reshape(-1, 2)


def answer_char_span(
    text: str, span: str = "boxed", boxed: Boxed | None = None
) -> tuple[int, int] | None:
    """Character span ``[start, end)`` of the answer in ``text`` (None: no well-formed box).

    `boxed`: the content of the last box. `closing`: the content and the character right after
    it (the closing ``}``; for a brace-less ``\\boxed 5`` the character that stops it, none at
    the end of the text). `closing_only`: that character alone (empty when there is none).
    `closing_line`: from the start of the box's line to its end (the next
    newline, excluded, or the end of the text). ``boxed``: ``extract_boxed(text)``, if known.
    """
    if span not in ANSWER_SPANS:
        raise ValueError(f"unknown answer span '{span}'; valid: {', '.join(ANSWER_SPANS)}")
    boxed = boxed if boxed is not None else extract_boxed(text)
    if boxed is None:
        return None
    start, end = boxed.span
    if span == "closing":
        return start, min(end + 1, len(text))
    if span == "closing_only":
        return end, min(end + 1, len(text))
    if span == "closing_line":
        line_end = text.find("\n", end)
        return text.rfind("\n", 0, start) + 1, len(text) if line_end < 0 else line_end
    return start, end


def with_stop_token(mask: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """``mask`` (..., T) bool plus each stop token (``stop``: eos and other special tokens) that
    directly follows a marked token: the eos ending a response right after its answer."""
    after = torch.zeros_like(mask)
    after[..., 1:] = mask[..., :-1]
    return mask | (stop.bool() & after)


def answer_token_mask(
    response_text: str, offset_mapping: Any, span: str = "boxed", stop: Any = None
) -> torch.Tensor:
    """Mark the response tokens that spell the final boxed answer.

    Args:
        response_text: the decoded response (the text the offsets index into).
        offset_mapping: (T, 2) character offsets ``(start, end)`` of each response token into
            ``response_text`` -- a list of pairs, a tensor or a numpy array.
        span: which span (:data:`ANSWER_SPANS`, :func:`answer_char_span`); the default is the
            paper's and is what the rest of this docstring describes.
        stop: (T,) bool, the stop tokens (eos); with a span other than `boxed`, the one right
            after the span's last token is marked too.

    Returns:
        (T,) ``torch.bool`` tensor: True on every non-empty token that contains at least one
        character of the answer *content* span of ``extract_boxed(response_text)``, i.e.
        ``start < span_end and end > span_start``. Tokens made only of ``\\boxed{`` or of the
        closing ``}`` are False; a token straddling ``{`` and the first answer character is True.
        All False when there is no (well-formed) boxed answer or its content is empty.
    """
    mask = span_token_mask(offset_mapping, answer_char_span(response_text, span))
    if span != "boxed" and stop is not None:
        mask = with_stop_token(mask, torch.as_tensor(stop, dtype=torch.bool))
    return mask


def span_token_mask(
    offset_mapping: Any, span: tuple[int, int] | torch.Tensor | None
) -> torch.Tensor:
    """(T,) bool: the non-empty tokens overlapping the character span `[start, end)` (all False
    for None or an empty span). Batched: offsets (B, T, 2) and spans (B, 2) -> (B, T)."""
    if isinstance(offset_mapping, torch.Tensor) and offset_mapping.dim() == 3:
        offsets = offset_mapping
    else:
        offsets = _as_offset_tensor(offset_mapping)
    starts, ends = offsets[..., 0], offsets[..., 1]
    if span is None:
        return torch.zeros(starts.shape, dtype=torch.bool)
    span = torch.as_tensor(span, dtype=torch.long)
    span_start, span_end = span[..., 0, None], span[..., 1, None]
    return (starts < span_end) & (ends > span_start) & (ends > starts)


def _ids_list(token_ids: Any) -> list[int]:
    if hasattr(token_ids, "tolist"):  # torch tensor / numpy array
        token_ids = token_ids.tolist()
    return [int(i) for i in token_ids]


def _committed_len(prefix: str, text: str) -> int:
    """Length of ``prefix`` minus trailing replacement chars that stand for an incomplete
    UTF-8 character (they are not in ``text`` at that position)."""
    n = len(prefix)
    while (
        n > 0
        and prefix[n - 1] == _REPLACEMENT
        and not (n <= len(text) and text[n - 1] == _REPLACEMENT)
    ):
        n -= 1
    return n


def _incremental_offsets(tokenizer: Any, ids: list[int], text: str) -> list[tuple[int, int]]:
    """Offsets of ``ids`` (no special tokens) from the lengths of decoded prefixes.

    Token k covers ``[committed(decode(ids[:k])), len(decode(ids[:k+1])))``: a byte-level token
    that only completes part of a UTF-8 character covers that whole character (as do all the
    tokens of that character), like the offsets of a fast tokenizer. Clipped to ``len(text)`` and
    made monotone. O(T^2) decoding; only used when re-tokenization does not reproduce ``ids``.
    """
    n = len(text)
    offsets: list[tuple[int, int]] = []
    prev_start = prev_end = 0
    start = 0  # committed length of the previous prefix
    for k in range(len(ids)):
        prefix = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
        end = min(max(len(prefix), prev_end), n)
        s = min(max(start, prev_start), end)
        offsets.append((s, end))
        prev_start, prev_end = s, end
        start = min(_committed_len(prefix, text), n)
    return offsets


def response_offsets(
    tokenizer: Any,
    token_ids: Sequence[int] | torch.Tensor,
    text: str | None = None,
    encoding: Any = None,
    special: frozenset[int] | None = None,
) -> list[tuple[int, int]]:
    """Character offsets of generated token ids in the decoded response text.

    Args:
        tokenizer: an HF fast tokenizer (``PreTrainedTokenizerFast`` / ``TokenizersBackend``).
        token_ids: (T,) generated ids, possibly containing special tokens (eos, pad).
        text: the response text; defaults to ``tokenizer.decode(token_ids, skip_special_tokens=True)``.

    Returns:
        T pairs ``(start, end)`` into ``text``. Special tokens get the empty offset ``(p, p)``
        where ``p`` is the end of the preceding token (0 at the start). Fast path: re-tokenize
        ``text`` with offsets and use them when the ids equal the non-special generated ids;
        otherwise (sampled non-canonical splits, byte pieces) fall back to incremental decoding.
        Fast-path offsets are the tokenizer's own: with a ``ByteLevel(trim_offsets=True)``
        post-processor (GPT-2; not Qwen2 / Llama 3) they exclude a token's leading/trailing
        whitespace, so a whitespace-only token has an empty offset.
        encoding: ``text`` already encoded with offsets (``input_ids``, ``offset_mapping``;
        e.g. one row of a batch call), so a batch of responses is re-tokenized in one call.
        special: ``tokenizer.all_special_ids`` as a set, when the caller already has it (the
            property rebuilds the list on every access).
    """
    ids = _ids_list(token_ids)
    if special is None:
        special = frozenset(tokenizer.all_special_ids)
    if text is None:
        text = tokenizer.decode(ids, skip_special_tokens=True)
    kept = [i for i in ids if i not in special]

    kept_offsets: list[tuple[int, int]] | None = None
    if kept:
        enc = encoding or tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        enc_ids = list(enc["input_ids"])
        if enc_ids == ids:  # ``text`` was decoded with its special tokens kept
            return [(int(s), int(e)) for s, e in enc["offset_mapping"]]
        if enc_ids == kept:
            kept_offsets = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
        else:
            kept_offsets = _incremental_offsets(tokenizer, kept, text)

    out: list[tuple[int, int]] = []
    cursor = 0
    it = iter(kept_offsets or [])
    for i in ids:
        if i in special:
            out.append((cursor, cursor))
        else:
            start, end = next(it)
            out.append((start, end))
            cursor = max(cursor, end)
    return out


def answer_mask_for_ids(
    tokenizer: Any,
    token_ids: Sequence[int] | torch.Tensor,
    text: str | None = None,
    span: str = "boxed",
) -> tuple[torch.Tensor, str]:
    """Answer-token mask of generated ids.

    Args:
        tokenizer: an HF fast tokenizer.
        token_ids: (T,) generated ids (special tokens allowed; answer tokens only as below).
        text: the response text; defaults to ``tokenizer.decode(token_ids, skip_special_tokens=True)``.
        span: which span (:data:`ANSWER_SPANS`); the special token right after any span but
            `boxed` (the eos ending the response there) is marked too.

    Returns:
        ``(mask, text)``: (T,) bool mask (see :func:`answer_token_mask`) and the response text.
    """
    ids = _ids_list(token_ids)
    if text is None:
        text = tokenizer.decode(ids, skip_special_tokens=True)
    special = frozenset(tokenizer.all_special_ids)
    stop = [i in special for i in ids]
    offsets = response_offsets(tokenizer, ids, text, special=special)
    return answer_token_mask(text, offsets, span, stop), text
