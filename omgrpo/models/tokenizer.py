"""The toy world's HF *fast* tokenizers: a byte-level BPE like a real LLM's (the default) and a
character-level one.

**BPE** (`build_bpe_tokenizer`): trained with the ``tokenizers`` library on toy-world text, with
Qwen2's pre-tokenizer (its split regex, digits one per token as in Qwen and Llama, then
GPT-2 byte-level pieces), so any text encodes without unknown tokens, offsets are real
character offsets and words of the prompt template are single tokens. The same special tokens
and ChatML template as the character tokenizer (ids 0, 1, 2 below).

**Character** (`build_char_tokenizer`):

Every printable ASCII character (plus ``\\n``) is exactly one token, so token ``i`` of an encoding
covers text characters ``[i, i+1)`` and offset mappings are exact. The ChatML special tokens
``<|im_start|>`` / ``<|im_end|>`` are matched as single tokens anywhere in the text, like in Qwen.

Vocabulary (ids in this order)::

    0 <|endoftext|>   pad
    1 <|im_start|>
    2 <|im_end|>      eos (end of a chat turn)
    3 [UNK]           any character outside the vocabulary
    4.. the 95 printable ASCII characters of ``string.printable`` (minus ``\\t\\r\\x0b\\x0c``), ``\\n``

Built in memory with the ``tokenizers`` library: no download, no files. The result is a
``transformers.PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5) that
round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
UNK_TOKEN = "[UNK]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)

#: One token per character: printable ASCII (no tab / CR / vertical tab / form feed) + newline.
#: ``string.printable`` already ends with whitespace; we keep " " and "\n" only.
CHARS: tuple[str, ...] = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")

#: Plain ChatML (the Qwen format without Qwen's default system prompt / tool-call branches).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the toy world's character-level fast tokenizer.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``eos_token="<|im_end|>"``, ``pad_token="<|endoftext|>"``,
        left padding, the ChatML ``chat_template`` and no automatically added BOS/EOS
        (``add_special_tokens=True`` adds nothing). ``len(tok) == 100``.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split into single characters. Oniguruma's "." does not match "\n", hence [\s\S].
    # WordLevel keeps each piece's offsets, so offsets are exactly (i, i+1) per character.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates the token strings without inserting spaces.
    backend.decoder = decoders.Fuse()

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[IM_START],  # transformers 5 name of additional_special_tokens
        padding_side="left",
        # Never "clean up" spaces before punctuation on decode: decode(encode(s)) == s.
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


#: Qwen2's split regex (tokenizer.json of Qwen2/2.5/3): ``\p{N}`` alone isolates every digit.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TOKENIZERS = ("bpe", "char")


def build_bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` (deterministic for a given corpus).

    Returns:
        A ``PreTrainedTokenizerFast`` with the special tokens, ids 0-2, eos, pad, left padding
        and ChatML template of `build_char_tokenizer`, the 256 byte tokens and merges up to
        `vocab_size`; no unknown token (every byte has a token).
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[:3]]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        extra_special_tokens=[IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tokenizer(name: str, corpus: Iterable[str]) -> PreTrainedTokenizerFast:
    """The toy tokenizer called `name` (``bpe``: trained on `corpus`; ``char``)."""
    if name == "bpe":
        return build_bpe_tokenizer(corpus)
    if name == "char":
        return build_char_tokenizer()
    raise ValueError(f"unknown model.tokenizer '{name}'; valid: {', '.join(TOKENIZERS)}")
