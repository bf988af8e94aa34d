"""Outputs written all or nothing: into a temporary folder or file of their own next to the
target (same file system), renamed into place only when everything was written. A failure or
a kill before the rename leaves the target as it was and removes the temporary; nothing that
this process did not create is ever overwritten or deleted on the way (the temporary's name is
made by `tempfile`, never reused)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_file(out: str | Path) -> Iterator[Path]:
    """A temporary path next to `out`; the body writes it, and it replaces `out` (os.replace,
    atomic) when the body returns. Its mode is what open() would have given a new file."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)  # ours: removed if the rename did not happen


@contextlib.contextmanager
def staged_dir(out: str | Path) -> Iterator[Path]:
    """A new temporary folder next to `out`; renamed to `out` when the body returns. `out` must
    not exist or be an empty folder (FileExistsError otherwise, checked before and after)."""
    out = Path(out)
    _check_empty(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700
    try:
        yield tmp
        _check_empty(out)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: gone if the rename did not happen


@contextlib.contextmanager
def staged_files(out_dir: str | Path) -> Iterator[Path]:
    """A new temporary folder next to `out_dir` that the body fills; when it returns, each
    file written there replaces its namesake in `out_dir` (made if missing; other files there
    are left alone). A body that raises leaves `out_dir` untouched."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir}: not a folder (an output folder was expected)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        for path in sorted(tmp.rglob("*")):
            target = out_dir / path.relative_to(tmp)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty: write into a new folder")
