"""The tracked tree stays light: a GPU machine receives at most 64 MiB of the working tree, so
the files git tracks must leave room for what a check builds. Committed studies keep their
runs' metrics compact (`omgrpo compact`: metrics.jsonl.xz), which took the tree from 83 MiB
to under 30."""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_TRACKED_MIB = 48


def tracked_bytes(repo: Path = REPO) -> dict[str, int]:
    """Path -> size in bytes of every file git tracks in `repo` that is on disk."""
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=repo, capture_output=True, text=True, check=False
    )
    if listing.returncode != 0:
        pytest.skip(f"not a git checkout: {listing.stderr.strip()}")
    paths = [name for name in listing.stdout.split("\0") if name]
    return {name: (repo / name).stat().st_size for name in paths if (repo / name).is_file()}


def test_the_tracked_tree_stays_under_48_mib():
    sizes = tracked_bytes()
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:10]
    assert total <= MAX_TRACKED_MIB * 2**20, (
        f"the tracked tree is {total / 2**20:.1f} MiB, over {MAX_TRACKED_MIB} MiB (a GPU machine "
        "receives at most 64 MiB); compact committed runs with `omgrpo compact reports/...`. "
        f"Largest files: {largest}"
    )


def test_committed_runs_keep_their_metrics_compact():
    """A run committed under reports/ holds metrics.jsonl.xz, not metrics.jsonl (7x larger)."""
    plain = [name for name in tracked_bytes() if name.startswith("reports/")
             and name.endswith("/metrics.jsonl")]  # fmt: skip
    assert not plain, f"run `omgrpo compact` on these runs' folders: {plain[:5]}"
