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
