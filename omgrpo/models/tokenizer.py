"""Character-level HF *fast* tokenizer for the CPU toy world.

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

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
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
