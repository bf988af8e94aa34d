"""Checkpoints and run status without training: checksums, fall back, resume-relevant keys,
failures recorded in status.json."""

from __future__ import annotations

import json

import pytest
import torch

from omgrpo.backends.native.checkpoint import (
    CheckpointWarning,
    config_diff,
    load_latest_intact_checkpoint,
    save_checkpoint,
)
from omgrpo.tracking.store import RunStore

CONFIG = {
    "run": {"root": "runs", "name": "r", "resume": False, "experiment": "toy", "tags": []},
    "optim": {"lr": 1e-3},
    "eval": {"every": 10},
    "tracking": {"wandb": True, "mlflow": True, "mlflow_uri": None},
    "trainer": {"progress": True, "threads": None, "save_every": 20},
}


def _save(store: RunStore, step: int) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    save_checkpoint(
        store.checkpoint_dir(step),
        step=step,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loop_state={"skipped": 0},
        config=CONFIG,
    )


def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_used(tmp_path):
    store = RunStore(tmp_path)
    for step in (2, 4):
        _save(store, step)
    manifest = json.loads((store.checkpoint_dir(4) / "manifest.json").read_text())
    assert len(manifest["sha256"]["state.pt"]) == 64
    assert not list(store.checkpoints_dir.glob("*.tmp"))  # written aside, renamed into place

    latest = store.checkpoint_dir(4) / "state.pt"
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit: torch would still load it
    latest.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match=f"{latest}.*sha256 does not match"):
        path, state = load_latest_intact_checkpoint(store, CONFIG)
    assert path == store.checkpoint_dir(2) and state["step"] == 2

    latest.write_bytes(b"")  # truncated to nothing
    with pytest.warns(CheckpointWarning, match=str(latest)):
        path, _ = load_latest_intact_checkpoint(store, CONFIG)
    assert path == store.checkpoint_dir(2)


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    store = RunStore(tmp_path)
    _save(store, 2)
    (store.checkpoint_dir(2) / "state.pt").write_bytes(b"PK")
    with pytest.warns(CheckpointWarning), pytest.raises(ValueError, match="no intact checkpoint"):
        load_latest_intact_checkpoint(store, CONFIG)
    assert load_latest_intact_checkpoint(RunStore(tmp_path / "empty"), CONFIG) is None


def test_only_settings_that_change_training_block_a_resume():
    moved = json.loads(json.dumps(CONFIG))
    moved["run"].update(root="/elsewhere", resume=True, experiment="sweep", tags=["x"])
    moved["tracking"].update(wandb=False, mlflow_uri="sqlite:///x.db")
    moved["trainer"].update(progress=False, threads=2, save_every=5)
    assert config_diff(CONFIG, moved) == []
    moved["optim"]["lr"] = 0.5
    moved["eval"]["every"] = 5
    assert config_diff(CONFIG, moved) == ["eval.every: 10 -> 5", "optim.lr: 0.001 -> 0.5"]


def test_a_key_absent_on_one_side_and_null_on_the_other_is_the_same_setting():
    """A run written before `algorithm.top_entropy_quantile` / `random_mask` existed has neither
    key; today's config has both, null (off): the same setting, so the run still resumes (and,
    finished, is skipped rather than refused). A value on one side is a change, either way."""
    old = {"algorithm": {"answer_weight": 0.0}, "optim": {"lr": 1e-3}}
    new = {
        "algorithm": {"answer_weight": 0.0, "top_entropy_quantile": None, "random_mask": None},
        "optim": {"lr": 1e-3},
    }
    assert config_diff(old, new) == [] and config_diff(new, old) == []
    new["algorithm"]["random_mask"] = "boxed"
    assert config_diff(old, new) == ["algorithm.random_mask: '<absent>' -> 'boxed'"]
    assert config_diff(new, old) == ["algorithm.random_mask: 'boxed' -> '<absent>'"]
    # a value that is not null is never the absent key's: 0 and False are settings
    assert config_diff({"a": 1}, {"a": 1, "b": 0}) == ["b: '<absent>' -> 0"]
    assert config_diff({"a": 1, "b": False}, {"a": 1}) == ["b: False -> '<absent>'"]


def test_an_exception_marks_the_run_failed_but_a_refusal_does_not(tmp_path):
    store = RunStore(tmp_path)
    with pytest.raises(KeyError), store.recording_failures():
        store.write_status(state="running", step=3, total_steps=10)
        raise KeyError("answer")
    status = store.read_status()
    assert status["state"] == "failed" and status["step"] == 3
    assert status["error"]["type"] == "KeyError" and status["error"]["message"] == "'answer'"
    assert status["error"]["step"] == 3 and "KeyError" in status["error"]["traceback"][-1]

    # A killed run (status `running`, written by an earlier attempt, even in this process)
    # whose resume is refused keeps its status: it is still resumable.
    with store.recording_failures():
        store.write_status(state="running", step=3)
    before = store.read_status()
    with pytest.raises(ValueError), store.recording_failures():
        raise ValueError("refusing to resume")
    assert store.read_status() == before

    with pytest.raises(KeyboardInterrupt), store.recording_failures():
        store.write_status(state="running", step=4)
        raise KeyboardInterrupt
    assert store.read_status()["state"] == "killed"
