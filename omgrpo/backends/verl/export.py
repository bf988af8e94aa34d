"""A verl run's checkpoint as a Hugging Face model directory, through verl's own model merger.

verl saves the actor as FSDP shards (`checkpoints/global_step_N/actor/model_world_size_W_rank_R.pt`
+ `fsdp_config.json` + `huggingface/` with the model config and tokenizer). verl ships the tool
that turns them into a HF directory, `python -m verl.model_merger merge --backend fsdp
--local_dir <actor> --target_dir <out>` (verl/model_merger/, in 0.9.1): omgrpo runs that
command, in its own process, and adds `omgrpo_export.json` (the same metadata as a native
export), so `transformers`, vLLM and `omgrpo eval` read the directory.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd

from omgrpo.backends.native.export import check_export_target, write_export_meta
from omgrpo.errors import CheckpointError
from omgrpo.staging import staged_dir
from omgrpo.tracking.store import RunStore

__all__ = ["export_verl_run", "verl_checkpoints"]

_STEP = re.compile(r"global_step_(\d+)")


def verl_checkpoints(run_dir: Path) -> dict[int, Path]:
    """Step -> actor folder of every verl checkpoint in the run's `checkpoints/`, oldest first
    (the folder verl points `latest_checkpointed_iteration.txt` into is the last one)."""
    found = {}
    for path in (Path(run_dir) / "checkpoints").glob("global_step_*"):
        match = _STEP.fullmatch(path.name)
        if match and (path / "actor" / "fsdp_config.json").is_file():
            found[int(match.group(1))] = path / "actor"
    return dict(sorted(found.items()))


def _choose(run_dir: Path, checkpoint: str, select_metric: str) -> tuple[int, Path, str]:
    steps = verl_checkpoints(run_dir)
    have = ", ".join(f"step_{s}" for s in steps) or "none"
    if not steps:
        raise FileNotFoundError(
            f"{run_dir / 'checkpoints'}: no verl checkpoint (global_step_N/actor); verl saves "
            "every trainer.save_freq steps"
        )
    if checkpoint == "last":
        step = max(steps)
        return step, steps[step], "the newest checkpoint"
    if checkpoint == "best":
        metrics = RunStore(run_dir).read_metrics()
        if select_metric not in metrics.columns:
            raise CheckpointError(f"--checkpoint best: the run never logged {select_metric}")
        values = pd.to_numeric(metrics.set_index("train/step")[select_metric], errors="coerce")
        scored = {s: float(values[s]) for s in steps if s in values and pd.notna(values[s])}
        if not scored:
            raise CheckpointError(f"--checkpoint best: no checkpoint step logged {select_metric}")
        step = max(scored, key=lambda s: (scored[s], s))
        return step, steps[step], f"highest {select_metric} ({scored[step]:.4g})"
    match = re.fullmatch(r"step_(\d+)", checkpoint)
    if match is None or int(match.group(1)) not in steps:
        raise CheckpointError(f"--checkpoint {checkpoint}: the run has {have} (or last / best)")
    step = int(match.group(1))
    return step, steps[step], "as asked"


def export_verl_run(
    run_dir: str | Path, out: str | Path, checkpoint: str = "last", select_metric: str = "val/acc"
) -> Path:
    """Merge the run's `checkpoint` (last, best or step_N) into the HF directory `out` with
    verl's model merger; refuses an `out` that exists and is not empty."""
    run_dir, out = Path(run_dir), Path(out)
    check_export_target(out)
    step, actor, why = _choose(run_dir, checkpoint, select_metric)
    from transformers import AutoConfig

    config = RunStore(run_dir).read_config()
    with staged_dir(out) as tmp:  # renamed into place: no half directory at `out`
        cmd = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
        cmd += ["--local_dir", str(actor), "--target_dir", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"verl's model merger failed on {actor} (exit {done.returncode}):\n"
                + (done.stderr or done.stdout)[-3000:]
            )
        write_export_meta(
            tmp,
            run_dir=run_dir,
            checkpoint_dir=actor.parent,
            label=checkpoint if checkpoint != "last" else f"step_{step}",
            why=why,
            step=step,
            config=config,
            base=(config.get("model") or {}).get("path"),
            dtype=str(AutoConfig.from_pretrained(tmp).dtype).removeprefix("torch."),
        )
    return out
