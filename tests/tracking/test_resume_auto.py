"""`run.resume=auto`, the default: what a W&B sweep agent's rerun of a run does. A run directory
that does not exist starts a new run; an unfinished run (killed, failed, or `running` after a
kill -9) continues from its checkpoint with the same identity, bit-exact; a finished or
collapse-stopped run is skipped without a file touched. Real training (the tiny toy config)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_values import logged_values

from omgrpo.backends.native.trainer import train
from omgrpo.config import compose
from omgrpo.tracking.store import RunStore

# Self-Certainty beside OM-GRPO's vote and format parts: a continuous reward, so every group
# has reward spread and every step updates the weights and the optimizer state a resume must
# restore (the 5-step tiny base earns the vote and format parts 0 everywhere on some machines:
# nothing trains, and a resume that lost the weights or the optimizer state still matched)
SPREAD = "reward.parts=[soft_vote,format,self_certainty]"


def _snapshot(run_dir: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of a run directory: (mtime in ns, content)."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def _set_state(run_dir: Path, state: str) -> None:
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps({**status, "state": state}))


@pytest.mark.parametrize(
    ("state", "resume", "expected"),
    [
        ("finished", "auto", "skip"),
        ("collapsed", "auto", "skip"),
        ("killed", "auto", "resume"),
        ("failed", "auto", "resume"),
        ("running", "auto", "resume"),
        ("finished", True, "resume"),
    ],
)
def test_start_mode_of_a_run_directory(tmp_path, state, resume, expected):
    store = RunStore(tmp_path / "run")
    assert store.start_mode(resume) == "new"
    store.log_metrics(0, {"x": 1.0})
    store.write_status(state=state, step=0)
    assert store.start_mode(resume) == expected


def test_start_mode_refuses_false_and_unknown_values(tmp_path):
    store = RunStore(tmp_path / "run")
    assert store.start_mode(False) == "new"
    store.log_metrics(0, {"x": 1.0})
    with pytest.raises(FileExistsError, match=r"run\.resume=auto"):
        store.start_mode(False)
    with pytest.raises(ValueError, match=r"run\.resume='sometimes': use auto, true or false"):
        store.start_mode("sometimes")


@pytest.mark.slow
@pytest.mark.parametrize("state", ["running", "killed", "failed"])
def test_auto_resumes_an_unfinished_run_bit_exact_with_its_identity(tiny_overrides, state):
    common = [*tiny_overrides, "trainer.steps=4", "trainer.save_every=2", SPREAD]
    assert compose(common).run.resume == "auto"  # the default
    reference = train(compose([*common, "run.name=reference"]))
    assert all(logged_values(reference)[s]["grad/norm"] > 0 for s in (1, 2, 3, 4))  # it trained
    run_dir = train(compose([*common, "run.name=cut"]), stop_after=3)  # checkpoint at 2
    if state != "running":  # stop_after leaves `running`, as a kill -9 does
        _set_state(run_dir, state)
    identity = (run_dir / "identity.json").read_text()
    assert train(compose([*common, "run.name=cut"])) == run_dir
    assert (run_dir / "identity.json").read_text() == identity
    assert logged_values(run_dir) == logged_values(reference)  # resumed from step 2, exactly
    assert RunStore(run_dir).read_status()["state"] == "finished"
    # run.resume=true does the same
    again = train(compose([*common, "run.name=cut_true"]), stop_after=3)
    train(compose([*common, "run.name=cut_true", "run.resume=true"]))
    assert logged_values(again) == logged_values(run_dir)


@pytest.mark.slow
@pytest.mark.e2e
def test_auto_skips_a_finished_run_without_touching_it(tiny_overrides, tmp_path):
    common = [*tiny_overrides, "trainer.steps=2", "run.name=done"]
    run_dir = tmp_path / "runs" / "done"
    assert not run_dir.exists()
    assert train(compose(common)) == run_dir  # a new run: the directory did not exist
    assert RunStore(run_dir).read_status()["state"] == "finished"
    assert sorted(logged_values(run_dir)) == [0, 1, 2]
    before = _snapshot(run_dir)
    assert "identity.json" in before and "checkpoints/step_000002/state.pt" in before

    # the real command line, as a W&B agent reruns it: exit 0 and a message
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("WANDB_SERVICE", None)
    cmd = [sys.executable, "-m", "omgrpo", "train", *common]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"skipping {run_dir}: it already finished at step 2 (run.resume=auto)" in done.stdout
    assert _snapshot(run_dir) == before

    _set_state(run_dir, "collapsed")
    before = _snapshot(run_dir)
    assert train(compose(common)) == run_dir
    assert _snapshot(run_dir) == before
    # another config under the same name is refused, not passed off as this finished run
    with pytest.raises(ValueError, match=r"finished run of another config:\n  optim\.lr"):
        train(compose([*common, "optim.lr=0.5"]))
    assert _snapshot(run_dir) == before
