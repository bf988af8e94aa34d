"""Checkpoints that make `run.resume=true` continue a killed run exactly (on CPU, bit for bit).

A checkpoint holds the policy, optimizer and scheduler state, every RNG the loop consumes, the
loop's counters and the resolved config it was written under. It is written to a temporary
directory and marked COMPLETE last, so a kill during saving never leaves a half checkpoint
that resume would pick.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omgrpo.tracking import flatten

# Keys allowed to differ between the checkpoint's config and the resuming one.
RESUME_IGNORED = {"run.resume", "trainer.progress", "trainer.log_every", "trainer.threads"}


def config_diff(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ (or exist on one side only), ignoring RESUME_IGNORED."""
    a, b = flatten(saved), flatten(current)
    keys = sorted((set(a) | set(b)) - RESUME_IGNORED)
    return [
        f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
        for k in keys
        if a.get(k, "<absent>") != b.get(k, "<absent>")
    ]


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


def save_checkpoint(
    path: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    loop_state: dict[str, Any],
    config: dict[str, Any],
) -> None:
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(
        {
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "loop": loop_state,
            "config": config,
        },
        tmp / "state.pt",
    )
    (tmp / "COMPLETE").write_text(str(step))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def load_checkpoint(path: Path, current_config: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint, refusing one written under a different config."""
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    diff = config_diff(state["config"], current_config)
    if diff:
        raise ValueError(
            f"refusing to resume from {path}: it was written under another config.\n  "
            + "\n  ".join(diff)
            + "\nStart a new run (another run.name) or restore these settings."
        )
    return state
