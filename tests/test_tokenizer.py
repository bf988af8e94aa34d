"""The toy world's character-level fast tokenizer."""

from __future__ import annotations

import string

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from omgrpo.models.tokenizer import CHARS, build_char_tokenizer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


def test_is_fast_and_vocab(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.is_fast
    assert len(tok) == 4 + len(CHARS) == 100
    assert "\n" in CHARS and " " in CHARS and "\t" not in CHARS
    assert set(string.ascii_letters + string.digits + string.punctuation) <= set(CHARS)


def test_eos_pad_ids(tok):
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.padding_side == "left"
    assert tok.bos_token_id is None
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]
    assert batch["attention_mask"][0] == [0, 0, 1, 1]


def test_offsets_one_char_per_token(tok):
    text = "so 3+4=7\n\n  \\boxed{7}.\nend"
    enc = tok(text, return_offsets_mapping=True)
    assert len(enc["input_ids"]) == len(text)  # no BOS/EOS added by default
    assert enc["offset_mapping"] == [(i, i + 1) for i in range(len(text))]
    assert tok.convert_ids_to_tokens(enc["input_ids"]) == list(text)


def test_special_tokens_are_single_tokens_in_text(tok):
    text = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    newline = tok.convert_tokens_to_ids("\n")
    body = tok.encode("user\nhi", add_special_tokens=False)
    assert enc["input_ids"] == [1, *body, 2, newline, 0]
    assert enc["offset_mapping"][0] == (0, 12)
    assert tok.decode(enc["input_ids"]) == text
    assert tok.decode(enc["input_ids"], skip_special_tokens=True) == "user\nhi\n"


def test_unknown_char(tok):
    ids = tok.encode("a\tb", add_special_tokens=False)
    assert ids[1] == tok.unk_token_id
    assert len(ids) == 3


@pytest.mark.parametrize(
    "text",
    [
        "".join(CHARS),
        "a . b , c 's n't  x ? !",  # no clean-up of spaces before punctuation
        "  leading and trailing  \n\n",
        "\\boxed{\\frac{1}{2}}",
        "",
    ],
)
def test_decode_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_chat_template(tok):
    system, question = "You are a calculator.\nBox it.", "What is 3+4?"
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out == (
        "<|im_start|>system\n"
        + system
        + "<|im_end|>\n<|im_start|>user\n"
        + question
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert out == no_gen + "<|im_start|>assistant\n"


def test_save_load_roundtrip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(loaded, PreTrainedTokenizerFast) and loaded.is_fast
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.chat_template == tok.chat_template
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.unk_token_id) == (2, 0, 3)
    assert loaded.padding_side == "left"
    text = "<|im_start|>assistant\nx = 3\n\\boxed{3}<|im_end|>"
    a = tok(text, return_offsets_mapping=True)
    b = loaded(text, return_offsets_mapping=True)
    assert a["input_ids"] == b["input_ids"]
    assert a["offset_mapping"] == b["offset_mapping"]
    assert loaded.decode(b["input_ids"]) == text
    msgs = [{"role": "user", "content": "q"}]
    assert loaded.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    ) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
