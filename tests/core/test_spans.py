"""Answer-token masks and response offsets, checked with two real fast tokenizers."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from omgrpo.core.answers import extract_boxed
from omgrpo.core.spans import (
    ANSWER_SPANS,
    _incremental_offsets,
    answer_char_span,
    answer_mask_for_ids,
    answer_token_mask,
    response_offsets,
    span_token_mask,
)
from omgrpo.models.tokenizer import build_char_tokenizer, build_tokenizer

# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def char_tok() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


def _corpus(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"so {a}+{b}={a + b}, the answer is \\boxed{{{a + b}}}.")
        lines.append(f"Thus x = \\boxed{{\\frac{{{a}}}{{{b + 1}}}}}. Done.")
        lines.append(f"We get {a}*{b} = {a * b}\nFinal: \\boxed{{{a * b}}}")
    return lines


def _train_byte_bpe(use_regex: bool) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on synthetic math text (GPT-2/Qwen-style pieces).

    Without the GPT-2 split regex, merges cross punctuation/digit boundaries (``{1``, ``}.``).
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def bpe_tok() -> PreTrainedTokenizerFast:
    return _train_byte_bpe(use_regex=False)


@pytest.fixture(scope="module")
def bpe_regex_tok() -> PreTrainedTokenizerFast:
    return _train_byte_bpe(use_regex=True)


@pytest.fixture(scope="module")
def toy_bpe_tok() -> PreTrainedTokenizerFast:
    """The toy presets' BPE (Qwen2's split: one digit per token) on this file's corpus."""
    return build_tokenizer("bpe", _corpus())


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

TEXTS = [
    "so 3+4=7, the answer is \\boxed{7}.",
    "so 12+30=42, the answer is \\boxed{42}.",
    "Thus x = \\boxed{\\frac{1}{2}}. Done.",
    "We get 6*7 = 42\nFinal: \\boxed{42}",
    "first \\boxed{3} then \\boxed{ 10 }.",
    "no spaces:\\boxed{123}}.",
    "fbox form \\fbox{-5}",
    "braceless \\boxed 5 done",
]


def _check_mask(text: str, offsets: list[tuple[int, int]], mask: torch.Tensor) -> None:
    """Every True token overlaps the content, every content char is covered by a True token,
    and tokens lying entirely in ``\\boxed{`` or the closing ``}`` are False."""
    boxed = extract_boxed(text)
    assert boxed is not None
    s, e = boxed.span
    assert mask.dtype == torch.bool and mask.shape == (len(offsets),)
    covered = set()
    for (a, b), m in zip(offsets, mask.tolist()):
        overlaps = a < e and b > s and b > a
        assert m == overlaps, (text, (a, b), text[a:b])
        if m:
            covered.update(range(max(a, s), min(b, e)))
        else:
            assert b <= s or a >= e or a == b  # outside the content, e.g. inside `\boxed{` / `}`
    assert covered == set(range(s, e))


# ----------------------------------------------------------------------------------------------
# answer_token_mask with the char tokenizer (hand-checked)
# ----------------------------------------------------------------------------------------------


def test_char_single_digit(char_tok):
    text = "so 3+4=7 \\boxed{7}"
    enc = char_tok(text, return_offsets_mapping=True, add_special_tokens=False)
    mask = answer_token_mask(text, enc["offset_mapping"])
    assert mask.dtype == torch.bool and mask.shape == (len(text),)
    assert mask.sum().item() == 1
    assert mask.nonzero().item() == len(text) - 2  # the `7` inside the box, not the `7` before
    assert char_tok.convert_ids_to_tokens([enc["input_ids"][len(text) - 2]]) == ["7"]


def test_char_multi_char_answer(char_tok):
    text = "so x = \\boxed{\\frac{1}{2}}."
    enc = char_tok(text, return_offsets_mapping=True, add_special_tokens=False)
    mask = answer_token_mask(text, enc["offset_mapping"])
    start = text.index("\\frac")
    end = start + len("\\frac{1}{2}")
    assert mask.tolist() == [start <= i < end for i in range(len(text))]
    assert "".join(c for c, m in zip(text, mask.tolist()) if m) == "\\frac{1}{2}"


@pytest.mark.parametrize("text", TEXTS)
def test_char_all_texts(char_tok, text):
    ids = char_tok.encode(text, add_special_tokens=False)
    offsets = response_offsets(char_tok, ids)
    assert offsets == [(i, i + 1) for i in range(len(text))]
    mask, decoded = answer_mask_for_ids(char_tok, ids)
    assert decoded == text
    _check_mask(text, offsets, mask)


def test_offset_mapping_formats(char_tok):
    text = "ok \\boxed{12}"
    offsets = char_tok(text, return_offsets_mapping=True)["offset_mapping"]
    expected = answer_token_mask(text, offsets)
    assert expected.sum().item() == 2
    assert torch.equal(answer_token_mask(text, torch.tensor(offsets)), expected)
    assert torch.equal(answer_token_mask(text, np.array(offsets)), expected)
    assert answer_token_mask(text, []).shape == (0,)


@pytest.mark.parametrize(
    "text",
    [
        "no box here, the answer is 7",
        "truncated \\boxed{12",
        "unclosed \\boxed{\\frac{1}{2}",
        "empty \\boxed{}",
        "earlier \\boxed{3} then unclosed \\boxed{4",
    ],
)
def test_no_valid_box_all_false(char_tok, bpe_tok, text):
    for tok in (char_tok, bpe_tok):
        ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        mask, _ = answer_mask_for_ids(tok, ids)
        assert mask.shape == (len(ids),) and not mask.any()


# ----------------------------------------------------------------------------------------------
# Byte-level BPE
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["bpe_tok", "bpe_regex_tok", "toy_bpe_tok"])
@pytest.mark.parametrize("text", TEXTS)
def test_bpe_mask_alignment(request, which, text):
    tok = request.getfixturevalue(which)
    ids = tok.encode(text, add_special_tokens=False)
    offsets = response_offsets(tok, ids)
    assert [text[a:b] for a, b in offsets] == [tok.decode([i]) for i in ids]
    mask, decoded = answer_mask_for_ids(tok, ids)
    assert decoded == text
    _check_mask(text, offsets, mask)


def test_bpe_token_straddles_open_brace(bpe_tok):
    text = "so 3+4=7, the answer is \\boxed{12}."
    ids = bpe_tok.encode(text, add_special_tokens=False)
    pieces = [bpe_tok.decode([i]) for i in ids]
    offsets = response_offsets(bpe_tok, ids)
    mask, _ = answer_mask_for_ids(bpe_tok, ids)
    first = text.index("{12}") + 1  # first answer digit
    k = next(k for k, (a, b) in enumerate(offsets) if a <= first < b)
    assert offsets[k][0] < first and "{1" in pieces[k], pieces  # e.g. `\boxed{1` or `{1`
    assert mask[k]
    # the token holding the closing brace also holds the last digit here (`2}.`) -> True;
    # nothing after it is True
    last = text.index("}", first)
    assert not mask[[k for k, (a, _) in enumerate(offsets) if a > last]].any()
    _check_mask(text, offsets, mask)


def test_bpe_brace_only_tokens_false(bpe_tok):
    text = "Thus x = \\boxed{\\frac{1}{2}}. Done."
    ids = bpe_tok.encode(text, add_special_tokens=False)
    offsets = response_offsets(bpe_tok, ids)
    mask, _ = answer_mask_for_ids(bpe_tok, ids)
    s, e = extract_boxed(text).span
    for (a, b), m in zip(offsets, mask.tolist()):
        if b <= s or a >= e:  # entirely in the prefix / `\boxed{` / the final `}` and after
            assert not m
    _check_mask(text, offsets, mask)


# ----------------------------------------------------------------------------------------------
# response_offsets: fast path, fallback, special tokens
# ----------------------------------------------------------------------------------------------


def test_special_tokens_get_empty_offsets(bpe_tok, char_tok):
    for tok in (bpe_tok, char_tok):
        text = "so 3+4=7 \\boxed{7}"
        ids = tok.encode(text, add_special_tokens=False)
        n = len(text)
        gen = [*ids, tok.eos_token_id, tok.pad_token_id, tok.pad_token_id]
        offsets = response_offsets(tok, gen)
        assert len(offsets) == len(gen)
        assert offsets[len(ids) :] == [(n, n)] * 3
        mask, decoded = answer_mask_for_ids(tok, torch.tensor(gen))
        assert decoded == text
        assert mask.shape == (len(gen),) and not mask[len(ids) :].any()
        assert mask.sum().item() >= 1
        # left padding before the response: empty offsets at 0
        offsets = response_offsets(tok, [tok.pad_token_id, *ids])
        assert offsets[0] == (0, 0)
    assert response_offsets(char_tok, []) == []
    assert response_offsets(char_tok, [char_tok.eos_token_id]) == [(0, 0)]


def test_text_with_special_tokens_kept(char_tok):
    text = "x \\boxed{5}<|im_end|>"
    ids = char_tok.encode(text, add_special_tokens=False)
    offsets = response_offsets(char_tok, ids, text=text)
    assert offsets[-1] == (len(text) - len("<|im_end|>"), len(text))
    assert answer_token_mask(text, offsets).sum().item() == 1


def _noncanonical_ids(tok, pieces: list[str]) -> list[int]:
    return [i for p in pieces for i in tok.encode(p, add_special_tokens=False)]


def test_fallback_noncanonical_split(bpe_tok):
    pieces = ["so 3", "+4=7, the answer is \\box", "ed{1", "2}. \\boxed{\\fr", "ac{1}{", "2}}."]
    text = "".join(pieces)
    ids = _noncanonical_ids(bpe_tok, pieces)
    assert ids != bpe_tok.encode(text, add_special_tokens=False)  # really non-canonical
    gen = [*ids, bpe_tok.eos_token_id]
    offsets = response_offsets(bpe_tok, gen)
    assert len(offsets) == len(gen)
    assert offsets[-1] == (len(text), len(text))
    assert [text[a:b] for a, b in offsets[:-1]] == [bpe_tok.decode([i]) for i in ids]
    mask, decoded = answer_mask_for_ids(bpe_tok, gen)
    assert decoded == text
    _check_mask(text, offsets[:-1], mask[:-1])
    marked = "".join(text[a:b] for (a, b), m in zip(offsets, mask.tolist()) if m)
    assert "\\frac{1}{2}" in marked


def test_fallback_matches_fast_path(bpe_tok):
    text = "We get 6*7 = 42, café\nFinal: \\boxed{42}"  # `é` is two byte-level tokens
    ids = bpe_tok.encode(text, add_special_tokens=False)
    fast = response_offsets(bpe_tok, ids)
    assert _incremental_offsets(bpe_tok, ids, text) == fast
    e = text.index("é")
    assert [k for k, (a, b) in enumerate(fast) if a <= e < b] != []


def test_fallback_splits_multibyte_char(bpe_tok):
    # Sample-like sequence: the two UTF-8 bytes of `é` and the answer digits as separate tokens.
    text = "é \\boxed{é1}"
    byte_ids = bpe_tok.convert_tokens_to_ids(list("Ã©"))  # byte-level symbols of é
    ids = [*byte_ids, *bpe_tok.encode(" \\boxed{", add_special_tokens=False)]
    ids += [*byte_ids, *_noncanonical_ids(bpe_tok, ["1", "}"])]
    assert bpe_tok.decode(ids) == text
    offsets = response_offsets(bpe_tok, ids)
    assert offsets[:2] == [(0, 1), (0, 1)]  # both bytes cover the character
    mask, _ = answer_mask_for_ids(bpe_tok, ids)
    _check_mask(text, offsets, mask)
    assert mask.tolist()[-3:] == [True, True, False] and mask.sum().item() == 3


@settings(max_examples=200)  # derandomized, no database: the conftest profile
@given(st.data())
@pytest.mark.slow
def test_batched_span_mask_equals_row_by_row(data):
    """span_token_mask on (B, T, 2) offsets and (B, 2) spans equals it row by row."""
    rows, width = data.draw(st.integers(1, 5)), data.draw(st.integers(0, 8))
    pair = st.tuples(st.integers(0, 12), st.integers(0, 12)).map(sorted)
    offsets = torch.tensor(
        data.draw(
            st.lists(st.lists(pair, min_size=width, max_size=width), min_size=rows, max_size=rows)
        ),
        dtype=torch.long,
    ).reshape(rows, width, 2)
    spans = torch.tensor(data.draw(st.lists(pair, min_size=rows, max_size=rows)))
    batched = span_token_mask(offsets, spans)
    for i in range(rows):
        assert torch.equal(batched[i], span_token_mask(offsets[i], tuple(spans[i].tolist())))


# ----------------------------------------------------------------------------------------------
# The answer span as a choice (`algorithm.answer_span`): boxed (the paper's) / closing /
# closing_line, hand-computed on the shipped toy BPE, the char tokenizer and a BPE whose `}`
# merges with its neighbours
# ----------------------------------------------------------------------------------------------


def _paper_answer_mask(text, offsets):
    """The answer mask as it was before the span choice (the paper's span, verbatim)."""
    boxed = extract_boxed(text)
    return span_token_mask(offsets, None if boxed is None else boxed.span)


@pytest.fixture(scope="module")
def shipped_tok():
    """The toy presets' tokenizer as shipped with the toy base (omgrpo/bases/)."""
    from transformers import AutoTokenizer

    from omgrpo.models.bases import SHIPPED_DIR

    return AutoTokenizer.from_pretrained(sorted(SHIPPED_DIR.glob("toy-base-*"))[0])


def _marked(tok, ids, span):
    mask, _ = answer_mask_for_ids(tok, ids, span=span)
    return [tok.decode([i]) for i, m in zip(ids, mask.tolist()) if m]


def test_answer_char_span_hand_computed():
    text = "3+4=17\nSo the answer is \\boxed{17}."
    s = text.index("{17}") + 1
    assert answer_char_span(text) == (s, s + 2)  # `17`
    assert answer_char_span(text, "closing") == (s, s + 3)  # `17}`
    assert answer_char_span(text, "closing_line") == (7, len(text))  # `So ... }.`
    two_lines = "So \\boxed{7}.\nDone"
    assert answer_char_span(two_lines, "closing_line") == (0, two_lines.index("\n"))
    # brace-less: the character that stops the answer; at the end of the text there is none
    assert answer_char_span("\\boxed 5 ok", "closing") == (7, 9)
    assert answer_char_span("\\boxed 5", "closing") == (7, 8)
    # closing_only: the closing character alone (the `}`; brace-less: the one that stops it)
    assert answer_char_span(text, "closing_only") == (s + 2, s + 3)  # `}`
    assert text[slice(*answer_char_span(text, "closing_only"))] == "}"
    assert answer_char_span("\\boxed 5 ok", "closing_only") == (8, 9)
    assert answer_char_span("\\boxed 5", "closing_only") == (8, 8)  # none: marks no token
    assert answer_char_span("x \\boxed{}", "closing_only") is None  # an empty box: no answer
    for span in ANSWER_SPANS:
        assert answer_char_span("no box", span) is None
        assert answer_char_span("cut \\boxed{1", span) is None
    with pytest.raises(ValueError, match="unknown answer span 'last'"):
        answer_char_span(text, "last")


def test_shipped_toy_bpe_closing_masks_the_brace_token_and_eos(shipped_tok):
    """The toy BPE writes `\\boxed{17}.` as ` \\`, `boxed`, `{`, `1`, `7`, `}.`, eos."""
    tok = shipped_tok
    text = "3+4=17\nSo the answer is \\boxed{17}."
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[-7:] == [" \\", "boxed", "{", "1", "7", "}.", "<|im_end|>"]
    assert _marked(tok, ids, "boxed") == ["1", "7"]
    assert _marked(tok, ids, "closing") == ["1", "7", "}.", "<|im_end|>"]
    assert _marked(tok, ids, "closing_only") == ["}.", "<|im_end|>"]  # the digits trained
    line = ["So", " the", " answer", " is", " \\", "boxed", "{", "1", "7", "}.", "<|im_end|>"]
    assert _marked(tok, ids, "closing_line") == line
    # the response goes on after the box: its eos decides nothing about the answer
    more = [*tok.encode(text + " So", add_special_tokens=False), tok.eos_token_id]
    assert _marked(tok, more, "closing") == ["1", "7", "}."]
    assert _marked(tok, more, "closing_only") == ["}."]
    # the whole line, to the end of the response: its eos too
    assert (
        "".join(_marked(tok, more, "closing_line")) == "So the answer is \\boxed{17}. So<|im_end|>"
    )


def test_char_closing_masks_the_brace_and_only_an_eos_right_after_it(char_tok):
    tok = char_tok
    ended = [*tok.encode("x \\boxed{5}", add_special_tokens=False), tok.eos_token_id]
    assert _marked(tok, ended, "closing") == ["5", "}", "<|im_end|>"]
    assert _marked(tok, ended, "closing_only") == ["}", "<|im_end|>"]
    dot = [*tok.encode("x \\boxed{5}.", add_special_tokens=False), tok.eos_token_id]
    assert _marked(tok, dot, "closing") == ["5", "}"]  # `.` and eos are format
    assert _marked(tok, dot, "closing_only") == ["}"]
    assert "".join(_marked(tok, dot, "closing_line")) == "x \\boxed{5}.<|im_end|>"
    # padding after the eos is never the answer; one stop token at most
    padded = [*ended, tok.pad_token_id, tok.pad_token_id]
    mask, _ = answer_mask_for_ids(tok, padded, span="closing")
    assert mask.tolist()[-5:] == [True, True, True, False, False]


def test_merged_brace_token_is_masked_whole(bpe_tok):
    """A byte BPE without the split regex merges `}` with its neighbours: the whole token of
    the closing brace is the answer's under `closing` (and the eos right after it)."""
    tok = bpe_tok
    text = "Thus x = \\boxed{\\frac{1}{2}}. Done."
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    pieces = [tok.decode([i]) for i in ids]
    assert pieces == ["Thus x = \\boxed{\\frac{", "1", "}{2", "}}. Done.", "<|im_end|>"]
    # the merged `}}. Done.` holds the content's last `}`: already the paper's answer token
    assert _marked(tok, ids, "boxed") == pieces[:4]
    assert _marked(tok, ids, "closing") == pieces
    # closing_only: the token holding the closing `}`, whole (here it also holds the content's
    # last `}`, so it is the paper's answer token too), and the eos
    assert _marked(tok, ids, "closing_only") == pieces[3:]
    text = "so 3+4=7, the answer is \\boxed{12}."
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[-3:] == [", the answer is \\boxed{12", "}.", "<|im_end|>"]
    assert _marked(tok, ids, "boxed") == [", the answer is \\boxed{12"]
    assert _marked(tok, ids, "closing") == pieces[-3:]
    assert _marked(tok, ids, "closing_only") == pieces[-2:]


@pytest.mark.parametrize("which", ["char_tok", "bpe_tok", "bpe_regex_tok", "shipped_tok"])
def test_default_span_is_the_papers_mask_bit_for_bit(request, which):
    tok = request.getfixturevalue(which)
    for text in [*TEXTS, "no box", "cut \\boxed{1", "3+4=17\nSo the answer is \\boxed{17}."]:
        ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id, tok.pad_token_id]
        offsets = response_offsets(tok, ids)
        old = _paper_answer_mask(text, offsets)
        assert torch.equal(answer_mask_for_ids(tok, ids)[0], old)
        assert torch.equal(answer_mask_for_ids(tok, ids, span="boxed")[0], old)
        assert torch.equal(answer_token_mask(text, offsets), old)
        closing = answer_mask_for_ids(tok, ids, span="closing")[0]
        assert torch.equal(closing & old, old)  # closing only adds tokens
        assert old.any() == (extract_boxed(text) is not None)
        # closing_only is what closing adds to the paper's span (a closing character exists
        # in all these texts but the unboxed ones)
        only = answer_mask_for_ids(tok, ids, span="closing_only")[0]
        assert torch.equal(closing, old | only), text
        assert only.any() == (extract_boxed(text) is not None)
