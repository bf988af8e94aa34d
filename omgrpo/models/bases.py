"""Toy bases shipped with omgrpo (`omgrpo/bases/toy-base-<key>/`), so a demo or a study on a
fresh clone starts from the committed weights instead of waiting minutes for the SFT warm start.

A shipped base is an ordinary cached base (`omgrpo.models.toy.ensure_toy_base`) plus
`shipped.json`: its key, the recipe the key hashes, the command that produced it, and a sha256
per file. `ensure_toy_base` copies it into the cache when the key asked for has one and every
file's hash matches; otherwise it trains, as before. `omgrpo base ... --ship` writes one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "bases"
MANIFEST = "shipped.json"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_base(
    key: str, shipped_dir: Path = SHIPPED_DIR, prefix: str = "toy-base"
) -> Path | None:
    """The shipped directory `<prefix>-<key>` (a base; `toy-prm`: a toy PRM) if there is one
    whose files match its manifest; a damaged one is reported (a warning naming the file) and
    ignored."""
    src = shipped_dir / f"{prefix}-{key}"
    manifest_path = src / MANIFEST
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("key") != key:
        warnings.warn(
            f"{manifest_path}: key {manifest.get('key')!r}, expected {key!r}; ignored", stacklevel=2
        )
        return None
    for name, digest in manifest["files"].items():
        path = src / name
        if not path.exists() or _sha256(path) != digest:
            warnings.warn(
                f"shipped base {src}: {name} is missing or its sha256 differs from {MANIFEST} "
                "(a Git LFS pointer or a partial checkout?); training the base instead",
                stacklevel=2,
            )
            return None
    return src


def install_shipped(
    key: str, out: Path, shipped_dir: Path = SHIPPED_DIR, prefix: str = "toy-base"
) -> bool:
    """Copy shipped base (or `prefix`: toy PRM) `key` to the cache directory `out` (atomically:
    parallel runs never see half a base). False if there is no intact shipped one with this key."""
    src = shipped_base(key, shipped_dir, prefix)
    if src is None:
        return False
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process installed it first
        shutil.rmtree(tmp, ignore_errors=True)
    manifest = json.loads((src / MANIFEST).read_text())
    base = prefix == "toy-base"
    switch = "model.warm_start.shipped" if base else "reward.prm.toy.shipped"
    print(
        f"{'warm start: ' if base else ''}using the shipped {'base ' if base else ''}{src.name} "
        f"(made by `{manifest['command']}`); "
        f"{switch}=false trains it instead",
        flush=True,
    )
    return True


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=SHIPPED_DIR.parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def ship_base(
    base_dir: Path,
    recipe: dict[str, Any],
    command: str,
    shipped_dir: Path = SHIPPED_DIR,
    note: str | None = None,
) -> Path:
    """Copy a trained, checked base into `shipped_dir` with its manifest. Refuses a base that
    failed (or never ran) its acceptance checks: shipped bases are the ones studies trust."""
    from omgrpo.models.basecheck import read_base_checks

    key = base_dir.name.removeprefix("toy-base-")
    checks = read_base_checks(base_dir)
    if checks is None or not checks["passed"]:
        state = "has no checks.json" if checks is None else "failed its checks"
        raise ValueError(f"{base_dir} {state}; only a base that passed them is shipped")
    return write_shipped(base_dir, key, recipe, command, shipped_dir, note)


def write_shipped(
    src: Path,
    key: str,
    recipe: dict[str, Any],
    command: str,
    shipped_dir: Path = SHIPPED_DIR,
    note: str | None = None,
) -> Path:
    """Copy a checked model directory `src` into `shipped_dir` under its own name, with the
    manifest: key, recipe, command, commit and a sha256 per file."""
    dest = shipped_dir / src.name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    files = sorted(p.name for p in dest.iterdir() if p.name != MANIFEST)
    manifest = {
        "key": key,
        "recipe": recipe,
        "command": command,
        "shipped_from_commit": _git_commit(),
        "files": {name: _sha256(dest / name) for name in files},
        **({"note": note} if note else {}),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return dest
