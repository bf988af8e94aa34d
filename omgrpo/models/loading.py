"""Loading the policy: the cached toy base, or any local HF causal-LM directory / hub id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from omgrpo.tasks.base import TaskSplits

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown model.dtype '{name}'; valid: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def base_model_dir(model_cfg: Any, task_cfg: Any, splits: TaskSplits) -> str:
    """Directory or hub id of the base model (training the toy base on first use)."""
    if model_cfg.path:
        path = str(model_cfg.path)
        if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().exists():
            raise FileNotFoundError(f"model.path '{path}' does not exist")
        return str(Path(path).expanduser()) if Path(path).expanduser().exists() else path
    if task_cfg.name != "toy":
        raise ValueError("the toy model only knows the toy task; set model.path for other tasks")
    from omgrpo.models.toy import ensure_toy_base

    seen = {p.question for split in (splits.train, splits.val, splits.test) for p in split}
    return str(ensure_toy_base(model_cfg, task_cfg, seen))


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(path)
    if not tok.is_fast:
        raise ValueError(f"{path}: omgrpo needs a fast tokenizer (offset mappings)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device)
