"""What produced a run: the git commit (and whether the checkout had uncommitted changes), the
versions of the packages that shape its numbers, the torch build and the devices.

`collect_provenance()` is written to `<run_dir>/provenance.json` by the trainer; the trackers
read it from there (MLflow tags `provenance.*`, W&B config `provenance`), so `omgrpo sync`
sends the same record. Versions come from `importlib.metadata` (a package that is not
installed is None; nothing is imported for a version).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("omgrpo", "torch", "transformers", "verl", "vllm")
SOURCE = Path(__file__).resolve().parents[2]  # the checkout omgrpo runs from, if it is one


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(path: Path = SOURCE) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout holding `path`; (None, None) outside one (an
    installed wheel) or without git. Dirty: tracked files differ from the commit."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, dirty


def torch_build() -> dict[str, Any]:
    """The torch build (`cpu`, `cuda <version>` or `rocm <version>`) and the devices it sees;
    torch is only inspected if the process imported it already (training always has)."""
    torch = sys.modules.get("torch")
    cpu = {"device_type": "cpu", "device_count": os.cpu_count() or 1}
    cpu["device_names"] = [platform.processor() or platform.machine()]
    if torch is None:
        return {"torch_build": None, **cpu}
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    build = f"cuda {cuda}" if cuda else f"rocm {hip}" if hip else "cpu"
    if not torch.cuda.is_available():
        return {"torch_build": build, **cpu}
    count = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    return {
        "torch_build": build,
        "device_type": "cuda",
        "device_count": count,
        "device_names": names,
    }


def collect_provenance(path: Path = SOURCE) -> dict[str, Any]:
    """The provenance record of a run started now (flat JSON values, `versions` a dict)."""
    commit, dirty = git_state(path)
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "versions": {name: package_version(name) for name in PACKAGES}
        | {"python": platform.python_version()},
        **torch_build(),
        "hostname": socket.gethostname(),
    }


def provenance_tags(provenance: dict[str, Any]) -> dict[str, str]:
    """The record as flat MLflow tags: `provenance.git_commit`, `provenance.versions.torch`,
    ... (None as "none"; the `earlier` records of a resumed run are left in the run store)."""
    out: dict[str, str] = {}
    for key, value in provenance.items():
        if key == "earlier":
            continue
        if isinstance(value, dict):
            for sub, v in value.items():
                out[f"provenance.{key}.{sub}"] = _tag_value(v)
        elif isinstance(value, list):
            out[f"provenance.{key}"] = ", ".join(map(str, value))
        else:
            out[f"provenance.{key}"] = _tag_value(value)
    return out


def _tag_value(value: Any) -> str:
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)
