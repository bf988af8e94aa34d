"""Test helper shared across test folders (tests/ is on sys.path through the rootdir conftest)."""

import torch
from omegaconf import OmegaConf

from omgrpo.models.tokenizer import build_char_tokenizer
from omgrpo.models.toy import build_toy_model


def random_toy_model(num_layers: int, seed: int, num_heads: int = 2, num_kv_heads: int = 1):
    """A random toy Qwen3 (hidden size 32, char tokenizer) with an untied random output layer,
    so greedy tokens vary by row. Returns (model, tokenizer)."""
    tok = build_char_tokenizer()
    arch = dict(hidden_size=32, num_layers=num_layers, num_heads=num_heads)
    cfg = OmegaConf.create(dict(arch, num_kv_heads=num_kv_heads))
    model = build_toy_model(cfg, tok, seed=seed).eval()
    head = torch.nn.Linear(32, len(tok), bias=False)
    with torch.no_grad():
        head.weight.copy_(
            torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(7))
        )
    model.lm_head = head
    return model, tok


def tiny_qwen3_config(tokenizer, num_layers: int = 2, **kw):
    """A tiny random Qwen3 shape (hidden 32, 2 heads, 1 K/V head) for the tokenizer, e.g. the
    PRM checkpoints the tests build (`num_labels=2` for a token-classification head)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        **kw,
    )
