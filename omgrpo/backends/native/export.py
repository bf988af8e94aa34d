"""A native checkpoint as a Hugging Face model directory that vLLM, `transformers` and lm-eval
read: `save_pretrained` (safetensors) + the base's tokenizer (chat template included) + the
generation config, and `omgrpo_export.json` saying which run, step and config it came from.

The weights are written in the dtype they were trained in (bf16 on a GPU, fp32 on the CPU),
so the directory's model computes what the trainer's policy computed at that step. A LoRA
run's checkpoint holds only its adapters: they are merged into a fresh copy of the base (W +
(alpha / r) B A, rounded to the base's dtype; peft's `merge_and_unload`), and the directory is
a plain model, no adapter files, no peft needed to load it.
"""

from __future__ import annotations

import datetime as _dt
import gc
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from omgrpo.backends.native.checkpoint import (
    STATE_FILE,
    check_sha256s,
    checkpoint_model,
    file_sha256,
    resume_relevant,
    verify_checkpoint,
)
from omgrpo.errors import InputError, read_mapping
from omgrpo.models.loading import base_model_dir
from omgrpo.staging import staged_dir
from omgrpo.tracking import flatten

EXPORT_META = "omgrpo_export.json"


class ExportError(InputError):
    """An exported directory whose files do not match the checksums in its omgrpo_export.json
    (a flipped byte, a truncated copy), or whose metadata cannot be read."""


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of the settings that change training (the keys a resume compares), so two
    exports of runs trained alike share it whatever their names, roots or trackers."""
    relevant = {k: v for k, v in flatten(config).items() if resume_relevant(k)}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()


def run_base_dir(config: dict[str, Any]) -> str:
    """The run's base model directory (or hub id); the toy task is loaded only for a toy base,
    so exporting a run on files does not need its data files on this machine."""
    cfg = OmegaConf.create(config)
    if cfg.model.path:
        return base_model_dir(cfg.model, cfg.task, None)
    from omgrpo.tasks import load_task

    return base_model_dir(cfg.model, cfg.task, load_task(cfg.task))


def check_export_target(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty: export into a new folder")


def read_checkpoint_state(checkpoint_dir: str | Path, mmap: bool = False) -> dict[str, Any]:
    """A native checkpoint's state, its files checked against its manifest first
    (`verify_checkpoint`); every failure (a damaged or missing file, a manifest or state that
    is not a checkpoint's) is a CheckpointError naming the file."""
    from omgrpo.errors import CheckpointError

    checkpoint_dir = Path(checkpoint_dir)
    state_file = checkpoint_dir / STATE_FILE
    verify_checkpoint(checkpoint_dir)  # CheckpointError naming a damaged file or manifest
    if not state_file.is_file():
        raise CheckpointError("missing (a checkpoint holds its state here)", file=state_file)
    try:  # mmap: the optimizer state in the same file is never read into memory
        state = torch.load(state_file, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # torch names no file: a truncated or foreign file
        raise CheckpointError(
            f"not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
            file=state_file,
        ) from e
    if not isinstance(state, dict) or not {"config", "step"} <= set(state):
        raise CheckpointError(
            "not an omgrpo checkpoint", file=state_file, expected="a state with config and step"
        )
    return state


def weight_checksums(model_dir: Path) -> dict[str, str]:
    """sha256 of every file of an export (weights, configs, tokenizer) but its metadata, by
    path relative to the directory: what `verify_export` checks before anything loads it."""
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != EXPORT_META)
    return {str(p.relative_to(model_dir)): file_sha256(p) for p in files}


def verify_export(model_dir: str | Path) -> dict[str, Any] | None:
    """An exported directory's omgrpo_export.json, after checking every file it lists against
    its sha256 (ExportError naming a missing or damaged file); None for a model directory
    `omgrpo export` did not write. Exports written before checksums existed are only read."""
    model_dir = Path(model_dir)
    path = model_dir / EXPORT_META
    if not path.is_file():
        return None
    try:
        meta = read_mapping(path, "an omgrpo export's metadata (a JSON object)")
    except InputError as e:
        raise ExportError(str(e)) from e
    if "sha256" not in meta:  # written before exports carried checksums
        return meta
    check_sha256s(model_dir, meta["sha256"], path, error=ExportError, again="export the run again")
    return meta


def export_checkpoint(
    checkpoint_dir: str | Path,
    out: str | Path,
    *,
    run_dir: str | Path | None = None,
    label: str = "",
    why: str = "",
) -> Path:
    """Write the checkpoint in `checkpoint_dir` as a HF model directory `out` (which must not
    exist or be empty); raises CheckpointError naming a file that fails the manifest check.
    The torch copy made here lives on the CPU and is gone when this returns."""
    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    check_export_target(out)
    state = read_checkpoint_state(checkpoint_dir, mmap=True)
    config, step = state["config"], int(state["step"])
    base = run_base_dir(config)
    # written aside and renamed into place: a killed export leaves no half directory at `out`
    with staged_dir(out) as tmp:
        model = checkpoint_model(state, base, torch.device("cpu"))  # the adapters merged
        dtype = model.dtype
        model.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        del model, state
        gc.collect()  # the caller may build vLLM next: no torch copy of the weights is left
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
        write_export_meta(
            tmp,
            run_dir=run_dir,
            checkpoint_dir=checkpoint_dir,
            label=label or f"step_{step}",
            why=why,
            step=step,
            config=config,
            base=base,
            dtype=str(dtype).removeprefix("torch."),
        )
    return out


def write_export_meta(
    model_dir: Path,
    *,
    run_dir: str | Path | None,
    checkpoint_dir: Path,
    label: str,
    why: str,
    step: int,
    config: dict[str, Any],
    base: str | None,
    dtype: str,
) -> None:
    """`omgrpo_export.json`: which run, checkpoint, step and config the weights came from
    (`omgrpo eval` reads the run's config, hence its task, from here), and the sha256 of every
    other file in `model_dir` (`verify_export`): written last. Both backends' exports."""
    meta = {
        "format": 1,
        "run": Path(run_dir).name if run_dir else None,
        "run_dir": str(Path(run_dir).resolve()) if run_dir else None,
        "checkpoint": label,
        "checkpoint_dir": str(Path(checkpoint_dir).resolve()),
        "why": why,
        "step": step,
        "config_sha256": config_hash(config),
        "base_model": base,
        "dtype": dtype,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": config,  # the run's resolved config: `omgrpo eval` reads its task from here
        "sha256": weight_checksums(model_dir),  # `omgrpo eval` verifies them (verify_export)
    }
    (model_dir / EXPORT_META).write_text(json.dumps(meta, indent=2, default=str) + "\n")
