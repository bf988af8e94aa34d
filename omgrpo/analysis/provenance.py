"""What produced the runs a report or a table compares: one provenance line per group of runs
(commit, dirty checkouts, package versions, torch build, devices, from each run's
`provenance.json`), and a warning when the runs compared come from different commits."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omgrpo.tracking.store import RunStore


class ProvenanceWarning(UserWarning):
    """Runs compared in one table were produced by different code."""


def read_provenance(run_dir: str | Path) -> dict[str, Any]:
    """The run's provenance record; {} for a run from before provenance was recorded."""
    try:
        return RunStore(run_dir).read_provenance()
    except (OSError, ValueError):
        return {}


def _values(records: list[dict[str, Any]], get) -> str:
    seen = [v for v in dict.fromkeys(str(get(r)) for r in records) if v != "None"]
    return ", ".join(seen) if seen else "–"


def provenance_line(group: str, records: list[dict[str, Any]]) -> str:
    """`group: 3 runs · commit 1a2b3c4 (1 dirty) · omgrpo 0.1.0 · torch 2.13.0+cpu (cpu) ...`."""
    known = [r for r in records if r]
    parts = [f"{group}: {len(records)} run(s)"]
    if len(known) < len(records):
        parts.append(f"{len(records) - len(known)} without provenance")
    if known:
        commits = _values(known, lambda r: (r.get("git_commit") or "None")[:10])
        dirty = sum(bool(r.get("git_dirty")) for r in known)
        parts.append(f"commit {commits}" + (f" ({dirty} dirty)" if dirty else ""))
        for name in ("omgrpo", "torch", "transformers", "verl", "vllm"):
            version = _values(known, lambda r, name=name: (r.get("versions") or {}).get(name))
            parts.append(f"{name} {version}")
        parts.append(f"build {_values(known, lambda r: r.get('torch_build'))}")
        parts.append(f"devices {_values(known, _devices)}")
    return " · ".join(parts)


def _devices(record: Mapping[str, Any]) -> str:
    names = record.get("device_names") or []
    label = ", ".join(dict.fromkeys(map(str, names))) or str(record.get("device_type"))
    return f"{record.get('device_count')}× {label}"


def provenance_lines(groups: Mapping[str, Iterable[str | Path]]) -> list[str]:
    """One line per group (group name -> its run directories), and a last line saying so when
    the runs come from more than one commit (also warned as a `ProvenanceWarning`)."""
    lines, commits = [], {}
    for group, run_dirs in groups.items():
        records = [read_provenance(d) for d in dict.fromkeys(map(str, run_dirs))]
        lines.append(provenance_line(group, records))
        for run_dir, r in zip(dict.fromkeys(map(str, run_dirs)), records):
            if r.get("git_commit"):
                commits.setdefault(r["git_commit"], []).append(run_dir)
    if len(commits) > 1:
        listed = "; ".join(f"{c[:10]}: {len(d)} run(s)" for c, d in commits.items())
        message = f"the runs compared come from {len(commits)} different commits ({listed})"
        warnings.warn(message, ProvenanceWarning, stacklevel=2)
        lines.append(f"WARNING: {message}")
    return lines
