"""Loading the policy: the cached toy base, or any local HF causal-LM directory / hub id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from omgrpo.console import quiet_library_bars
from omgrpo.core.task import TaskSplits

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# What a local HF causal-LM directory holds: one file of each group.
MODEL_FILES = {
    "config": ("config.json",),
    "weights": (
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    ),
    "tokenizer": ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt"),
}


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


def base_model_dir(model_cfg: Any, task_cfg: Any, splits: TaskSplits | None) -> str:
    """Directory or hub id of the base model (training the toy base on first use; only the toy
    base needs the task's `splits`, to keep its warm start off them)."""
    if model_cfg.path:
        path = str(model_cfg.path)
        local = Path(path).expanduser()
        if path.startswith(("/", "./", "../", "~")) and not local.exists():
            raise FileNotFoundError(f"model.path '{path}' does not exist")
        if not local.exists():
            return path  # a hub id
        check_model_dir(local)
        return str(local)
    if task_cfg.name != "toy":
        raise ValueError("the toy model only knows the toy task; set model.path for other tasks")
    if splits is None:
        raise ValueError("the toy base needs the toy task's splits (omgrpo.tasks.load_task)")
    from omgrpo.models.toy import ensure_toy_base

    seen = {p.question for split in (splits.train, splits.val, splits.test) for p in split}
    return str(ensure_toy_base(model_cfg, task_cfg, seen))


def check_model_dir(path: Path) -> None:
    """Refuse a local `model.path` that is not a HF model directory, saying which files were
    expected (transformers' own errors name a missing tokenizer backend instead)."""
    if not path.is_dir():
        raise ValueError(f"model.path '{path}' is a file; it must be a HF model directory")
    present = {p.name for p in path.iterdir()}
    missing = [
        f"{group} ({' or '.join(names)})"
        for group, names in MODEL_FILES.items()
        if not present & set(names)
    ]
    if missing:
        found = ", ".join(sorted(present)[:10]) or "nothing"
        raise ValueError(
            f"model.path '{path}' is not a Hugging Face model directory: missing "
            f"{'; '.join(missing)}. It holds: {found}. Point model.path at the folder with "
            "config.json (as written by save_pretrained), or set it to null for the toy model"
        )


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(path)
    if not tok.is_fast:
        raise ValueError(f"{path}: omgrpo needs a fast tokenizer (offset mappings)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    quiet_library_bars()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device)
