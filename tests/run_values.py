"""Test helper shared across test folders (tests/ is on sys.path through the rootdir conftest)."""

import json
from pathlib import Path

VOLATILE = ("time/", "mem/", "perf/")
"""Metric prefixes that differ between two runs of the same computation."""


def logged_values(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> non-timing numeric metrics of a run store (each step must appear once)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        step = row.pop("train/step")
        assert step not in out, f"step {step} twice in {run_dir}"
        out[step] = {
            k: float(v)
            for k, v in row.items()
            if not k.startswith(VOLATILE) and isinstance(v, int | float) and v == v
        }
    return out
