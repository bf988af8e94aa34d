"""The toy world's fast tokenizers: character-level and byte-level BPE."""

from __future__ import annotations

import string

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from omgrpo.config import TaskConfig
from omgrpo.models.tokenizer import CHARS, build_char_tokenizer, build_tokenizer


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


# -- the toy BPE (the toy presets' default) -------------------------------------------------
@pytest.fixture(scope="module")
def bpe():
    from omegaconf import OmegaConf

    from omgrpo.models.toy import TOKENIZER_PROBLEMS, toy_corpus
    from omgrpo.tasks.toy import ToyWorldSpec, generate_sft_problems

    world = dict(max_start=10, max_operand=10, max_factor=3, max_value=50)
    spec = ToyWorldSpec.from_config(OmegaConf.merge(OmegaConf.structured(TaskConfig), world))
    problems = generate_sft_problems(TOKENIZER_PROBLEMS, 0, spec, set())
    return build_tokenizer("bpe", toy_corpus(problems))


def test_bpe_splits_digits_one_per_token_and_keeps_template_words_whole(bpe):
    text = "Evaluate left to right: 12+305*2\nSo the answer is \\boxed{610}."
    pieces = [bpe.decode([i]) for i in bpe(text, add_special_tokens=False)["input_ids"]]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("12305261" + "0")
    for word in ("Evaluate", " left", " answer", "boxed"):
        assert word in pieces
    assert len(pieces) < 0.6 * len(text)


def test_bpe_special_tokens_ids_eos_pad_and_template_match_the_char_tokenizer(bpe, tok):
    assert bpe.is_fast and bpe.padding_side == "left"
    for name in ("pad_token_id", "eos_token_id", "chat_template"):
        assert getattr(bpe, name) == getattr(tok, name)
    text = "<|im_start|>user\nHi<|im_end|>\n"
    assert bpe.convert_ids_to_tokens(bpe(text)["input_ids"])[0] == "<|im_start|>"
    assert bpe(text)["input_ids"].count(bpe.eos_token_id) == 1


@pytest.mark.parametrize("text", ["so 3+4=7\n\n  \\boxed{7}.", "é ü ∑ unseen: ~`|", ""])
def test_bpe_offsets_are_character_offsets_and_decoding_round_trips(bpe, text):
    enc = bpe(text, add_special_tokens=False, return_offsets_mapping=True)
    assert bpe.decode(enc["input_ids"]) == text  # byte-level: no unknown token
    if text.isascii():
        assert [text[a:b] for a, b in enc["offset_mapping"]] == [
            bpe.decode([i]) for i in enc["input_ids"]
        ]


def test_bpe_save_load_roundtrip_and_unknown_name(bpe, tmp_path):
    bpe.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Evaluate left to right: 7+5*3"
    assert loaded(text)["input_ids"] == bpe(text)["input_ids"]
    with pytest.raises(ValueError, match=r"unknown model\.tokenizer 'wordpiece'; valid: bpe, char"):
        build_tokenizer("wordpiece", [])
