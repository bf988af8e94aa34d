"""Checkpoints that make `run.resume=true` continue a killed run exactly (on CPU, bit for bit).

A checkpoint holds the policy (every weight; with LoRA only the adapters, `model_weights`),
optimizer and scheduler state, every RNG the loop consumes, the loop's counters and the
resolved config it was written under. It is written to a temporary
directory, its sha256 goes into `manifest.json`, `COMPLETE` is written last and the directory
is renamed into place, so a kill during saving never leaves a half checkpoint that resume
would pick; a file damaged later (a full disk, a bad copy) fails its checksum, is named in a
warning, and resume falls back to the newest intact checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from omgrpo.errors import CheckpointError, InputError, read_json
from omgrpo.models.loading import load_model
from omgrpo.models.lora import (
    adapter_state_dict,
    apply_lora,
    load_adapter_state,
    lora_enabled,
    merge_adapters,
)
from omgrpo.tracking import flatten
from omgrpo.tracking.store import RunStore

STATE_FILE = "state.pt"
MANIFEST = "manifest.json"

# Settings that may differ between the checkpoint's config and the resuming one: where the run
# lives, how it is named and grouped in trackers, how it is mirrored and shown, when and how
# many checkpoints are kept. None of them changes a trained weight or a logged value. (eval.* is not here: validation draws from the CUDA RNG
# on a GPU, so its schedule changes the training trajectory there, and its other settings
# change what the val/* curves mean mid-run.)
RESUME_IGNORED_KEYS = {
    "run.resume",
    "run.root",
    "run.experiment",
    "run.variant",
    "run.tags",
    "trainer.progress",
    "trainer.threads",
    "trainer.log_every",
    "trainer.save_every",
    "trainer.keep_checkpoints",
    "trainer.keep_best",
    # where the base comes from (shipped or trained): the base of a run that has a checkpoint
    # is already in the cache; the key, not this, names the weights
    "model.warm_start.shipped",
}
# `diagnostics.*` only adds its own metrics (the mechanism probe leaves the trajectory
# unchanged: tests/backends/native/test_mechanism.py)
RESUME_IGNORED_SECTIONS = ("tracking.", "console.", "diagnostics.")


class CheckpointWarning(UserWarning):
    """A checkpoint failed its checksum or could not be read; an older one is used."""


def resume_relevant(key: str) -> bool:
    """Whether a (flattened) config key must match for a checkpoint to be resumed."""
    return key not in RESUME_IGNORED_KEYS and not key.startswith(RESUME_IGNORED_SECTIONS)


_ABSENT = "<absent>"


def config_diff(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ (or exist on one side only), leaving out the settings that do
    not change training (`resume_relevant`). A key absent on one side and null on the other is
    the same setting: a key added later with a null default (off), e.g.
    `algorithm.top_entropy_quantile`, is absent from the config of a run written before it
    existed, which then still resumes (and counts as finished under the same config)."""
    a, b = flatten(saved), flatten(current)
    keys = sorted(k for k in set(a) | set(b) if resume_relevant(k))
    return [
        f"{k}: {a.get(k, _ABSENT)!r} -> {b.get(k, _ABSENT)!r}"
        for k in keys
        if _setting(a, k) != _setting(b, k)
    ]


def _setting(flat: dict, key: str) -> Any:
    """The value of `key` as a setting: an absent key reads as null."""
    return flat.get(key)


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_weights(model: torch.nn.Module, adapters: Any = None) -> dict[str, Any]:
    """What a checkpoint holds of the policy: `model`'s whole state dict under "model"; with
    LoRA (`adapters`, the peft wrapper of `model`) only the adapters' weights under
    "adapters" and the frozen base's dtype under "base_dtype" (the base is the run's
    `model.path` or toy base, unchanged by training: export and eval load it from there)."""
    if adapters is None:
        return {"model": model.state_dict()}
    base_dtype = next(p.dtype for p in model.parameters() if not p.requires_grad)
    return {
        "adapters": adapter_state_dict(adapters),
        "base_dtype": str(base_dtype).removeprefix("torch."),
    }


def restore_weights(state: dict[str, Any], model: torch.nn.Module, adapters: Any = None) -> None:
    """Load a checkpoint's `model_weights` into the policy (`adapters`: its peft wrapper when
    the run trains LoRA adapters). Raises ValueError when one side has LoRA and the other
    not."""
    if adapters is None:
        if "model" not in state:
            raise ValueError("the checkpoint holds LoRA adapters, the run trains every weight")
        model.load_state_dict(state["model"])
        return
    if "adapters" not in state:
        raise ValueError("the checkpoint holds every weight, the run trains LoRA adapters")
    load_adapter_state(adapters, state["adapters"])


def checkpoint_model(
    state: dict[str, Any], base: str, device: torch.device, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """A plain Hugging Face model computing the checkpoint's policy: the base loaded in
    `dtype` (None: the dtype the run trained in) with the checkpoint's weights, or with its
    LoRA adapters merged into the base's weights (`merge_adapters`; a fresh copy of the base,
    never a training policy)."""
    if "adapters" not in state:
        weights = state["model"]
        if dtype is None:
            dtype = next(t.dtype for t in weights.values() if t.is_floating_point())
        model = load_model(base, device, dtype)
        model.load_state_dict(weights)
        return model
    if dtype is None:
        dtype = getattr(torch, state["base_dtype"])
    model_cfg = OmegaConf.create(state["config"]).model
    if not lora_enabled(model_cfg):
        raise ValueError("the checkpoint holds LoRA adapters but its config has model.lora.rank 0")
    # the adapters' random start is overwritten by the checkpoint's: any seed
    peft_model = apply_lora(load_model(base, device, dtype), model_cfg.lora, seed=0)
    load_adapter_state(peft_model, state["adapters"])
    return merge_adapters(peft_model)


def save_checkpoint(
    path: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    loop_state: dict[str, Any],
    config: dict[str, Any],
    adapters: Any = None,
) -> None:
    """Write a checkpoint of `model` (with `adapters`, its peft wrapper: the LoRA adapters
    only, `model_weights`) and the run state to `path`, atomically, with its checksum."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state_file = tmp / STATE_FILE
    torch.save(
        {
            "step": step,
            **model_weights(model, adapters),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "loop": loop_state,
            "config": config,
        },
        state_file,
    )
    with state_file.open("rb") as f:
        os.fsync(f.fileno())  # on disk before the manifest vouches for it
    manifest = {"step": step, "sha256": {STATE_FILE: file_sha256(state_file)}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    (tmp / "COMPLETE").write_text(str(step))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def file_sha256(path: str | Path) -> str:
    """A file's sha256 (hex), read in chunks: what checkpoint manifests, an export's
    omgrpo_export.json and eval's per-benchmark entries record, and `check_sha256s` checks."""
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def check_sha256s(
    folder: str | Path,
    sums: Any,
    listing: str | Path,
    *,
    error: type[InputError] = InputError,
    again: str = "",
) -> None:
    """Every file `sums` lists (a mapping of a path inside `folder` to its sha256 in hex, as
    `listing` holds it: a checkpoint's manifest.json, an export's omgrpo_export.json) present
    in `folder` with that sha256. The listing is checked whole before any file is read; raises
    `error` (an InputError) naming `listing` and the key when it is not such a mapping (not a
    mapping, a digest that is not 64 hex digits, a name that is empty, absolute or leaves
    `folder`), and naming the file when it is missing or damaged (`again`: what to do then).
    The one check of checkpoints (`verify_checkpoint`) and exports (`verify_export`)."""
    folder, listing = Path(folder), Path(listing)
    if not isinstance(sums, dict):
        raise error(
            "not a mapping of file to sha256",
            file=listing,
            key="sha256",
            found=type(sums).__name__,
            expected="{file: sha256 hex digest}",
        )
    for name, digest in sums.items():
        parts = Path(name).parts if isinstance(name, str) else ()
        if not parts or Path(name).is_absolute() or ".." in parts or "\0" in name:
            raise error(
                file=listing,
                key="sha256",
                found=name,
                expected=f"a path of a file inside {folder} (no '..', not absolute)",
            )
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            raise error(
                file=listing,
                key=f"sha256.{name}",
                found=digest,
                expected="a sha256 digest (64 hex digits)",
            )
    for name, digest in sums.items():
        file = folder / name
        if not file.is_file():
            raise error(f"missing (listed in {listing})", file=file)
        if file_sha256(file) != digest.lower():
            tail = f": {again}" if again else ""
            raise error(f"sha256 does not match {listing} (damaged or truncated){tail}", file=file)


def verify_checkpoint(path: str | Path) -> None:
    """Check a checkpoint's files against its manifest (`check_sha256s`); a manifest that
    does not parse or is not a manifest, a missing or damaged file: CheckpointError (an
    InputError) naming it. Checkpoints written before manifests existed have none and are only
    read."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.exists():
        return
    try:
        data = read_json(manifest, "a checkpoint manifest (JSON)")
    except InputError as e:
        raise CheckpointError(
            f"unreadable checkpoint manifest: {e.message}", file=manifest, row=e.row
        ) from e
    if not isinstance(data, dict) or "sha256" not in data:
        raise CheckpointError(
            "not a checkpoint manifest",
            file=manifest,
            found=sorted(data)[:8] if isinstance(data, dict) else type(data).__name__,
            expected='{"sha256": {file: digest}}',
        )
    check_sha256s(path, data["sha256"], manifest, error=CheckpointError)


def load_latest_intact_checkpoint(
    store: RunStore, current_config: dict[str, Any]
) -> tuple[Path, dict[str, Any]] | None:
    """(folder, state) of the newest checkpoint of `store` that passes its checksum and loads, or
    None if there is none. Each damaged newer one is named in a CheckpointWarning. Raises if
    every checkpoint is damaged (rather than silently starting over), or if the checkpoint was
    written under a config that differs in a setting that matters."""
    damaged = []
    for path in store.complete_checkpoints():
        try:
            verify_checkpoint(path)
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        except Exception as e:  # a checksum mismatch, or torch cannot read the file
            warnings.warn(
                f"skipping checkpoint {path / STATE_FILE}: {e}; trying an older one",
                CheckpointWarning,
                stacklevel=2,
            )
            damaged.append(str(path / STATE_FILE))
            continue
        check_resumable(path, state["config"], current_config)
        return path, state
    if damaged:
        raise ValueError(
            f"no intact checkpoint to resume from; damaged: {', '.join(damaged)}. Delete "
            f"{store.checkpoints_dir} to start the run over."
        )
    return None


def check_resumable(path: Path, saved_config: dict, current_config: dict) -> None:
    """Refuse a checkpoint written under a config that differs in a setting that matters."""
    diff = config_diff(saved_config, current_config)
    if diff:
        raise ValueError(
            f"refusing to resume from {path}: it was written under another config.\n  "
            + "\n  ".join(diff)
            + "\nStart a new run (another run.name) or restore these settings."
        )
