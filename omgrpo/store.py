"""The local run store: `runs/<name>/`, the source of truth that trackers and analysis read.

config.yaml            resolved config of the run
metrics.jsonl          one JSON object per step (`train/step` plus every metric)
rollouts/step_*.parquet sampled rollouts (prompt id, text, answer, rewards, advantage, ...)
checkpoints/step_*/    model, optimizer, scheduler and RNG state (for resume)
status.json            running / finished / failed, last step, and why it stopped
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import yaml


class RunStore:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.rollouts_dir = self.dir / "rollouts"
        self.checkpoints_dir = self.dir / "checkpoints"

    # -- config ---------------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    def read_config(self) -> dict[str, Any]:
        path = self.dir / "config.yaml"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: is {self.dir} a run directory?")
        return yaml.safe_load(path.read_text())

    def has_progress(self) -> bool:
        return self.metrics_path.exists() or self.checkpoints_dir.exists()

    # -- metrics --------------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"train/step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.dir.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def read_metrics(self) -> pd.DataFrame:
        """All metric rows as a DataFrame indexed by nothing, one row per step."""
        rows = []
        lines = self.metrics_path.read_text().splitlines() if self.metrics_path.exists() else []
        for lineno, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                # A run killed mid-write leaves at most one partial last line.
                if lineno != len(lines) - 1:
                    raise ValueError(f"{self.metrics_path}, line {lineno + 1}: invalid JSON") from e
        return pd.DataFrame(rows)

    def truncate_metrics(self, last_step: int) -> None:
        """Drop rows after `last_step` (a resumed run recomputes them)."""
        if not self.metrics_path.exists():
            return
        keep = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("train/step", 0) <= last_step:
                keep.append(line)
        self.metrics_path.write_text("".join(x + "\n" for x in keep))
        for path in self.rollouts_dir.glob("step_*.parquet"):
            if int(path.stem.split("_")[1]) > last_step:
                path.unlink()

    # -- rollouts -------------------------------------------------------------------------
    def log_rollouts(self, step: int, table: pd.DataFrame) -> Path:
        self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        path = self.rollouts_dir / f"step_{step:06d}.parquet"
        table.to_parquet(path, index=False)
        return path

    def read_rollouts(self) -> pd.DataFrame:
        files = sorted(self.rollouts_dir.glob("step_*.parquet"))
        return (
            pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
            if files
            else (pd.DataFrame())
        )

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_dir / f"step_{step:06d}"

    def latest_checkpoint(self) -> Path | None:
        done = [p for p in self.checkpoints_dir.glob("step_*") if (p / "COMPLETE").exists()]
        return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None

    def complete_checkpoints(self) -> dict[int, Path]:
        """Step -> directory of every completely written checkpoint."""
        done = [p for p in self.checkpoints_dir.glob("step_*") if (p / "COMPLETE").exists()]
        return {int(p.name.split("_")[1]): p for p in sorted(done)}

    def best_checkpoint(self, metric: str) -> tuple[int, float, dict[int, float]] | None:
        """The complete checkpoint whose step logged the highest `metric` (ties: the later
        step): (step, value, every candidate step -> value), or None if none logged it."""
        df = self.read_metrics()
        if metric not in df.columns:
            return None
        values = pd.to_numeric(df.set_index("train/step")[metric], errors="coerce").dropna()
        candidates = {s: float(values[s]) for s in self.complete_checkpoints() if s in values}
        if not candidates:
            return None
        step = max(candidates, key=lambda s: (candidates[s], s))
        return step, candidates[step], candidates

    def prune_checkpoints(self, keep: int, keep_best: str | None = None) -> None:
        """Keep the newest `keep` checkpoints, and with `keep_best` also the best one by that
        metric (so `omgrpo eval --checkpoint best` finds it after later ones are written)."""
        done = sorted(self.checkpoints_dir.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        best = self.best_checkpoint(keep_best) if keep_best else None
        protect = self.checkpoint_dir(best[0]) if best else None
        for path in done[: max(0, len(done) - keep)]:
            if path != protect:
                shutil.rmtree(path, ignore_errors=True)

    # -- status ---------------------------------------------------------------------------
    def write_status(self, **status: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "status.json").write_text(json.dumps(status, indent=2, default=str))

    def read_status(self) -> dict[str, Any]:
        path = self.dir / "status.json"
        return json.loads(path.read_text()) if path.exists() else {}


def _plain(value: Any) -> Any:
    """Tensors / numpy scalars to Python (non-finite floats are written as NaN / Infinity)."""
    return value.item() if hasattr(value, "item") else value
