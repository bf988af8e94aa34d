"""Compacted metrics: `RunStore.compact_metrics` / `omgrpo compact` replace a finished run's
metrics.jsonl by metrics.jsonl.xz (the same bytes, xz-compressed), the form the committed
studies under reports/ keep. Every reader takes either form; training that continues the run
expands it back first."""

from __future__ import annotations

import json
import lzma

import pytest

from omgrpo.analysis.load import find_run_dirs, is_run_dir, load_runs
from omgrpo.cli import main as cli_main
from omgrpo.tracking.store import RunStore


def _run(path, steps=3, state="finished"):
    store = RunStore(path)
    store.write_config({"run": {"name": path.name, "experiment": "toy"}, "seed": 0})
    for step in range(steps):
        row = {"val/acc": step / 3, "answers/batch_mode": str(step)} if step % 2 else {}
        store.log_metrics(step, {"reward/total": 0.1 * step, "train/epoch": step, **row})
    store.write_status(state=state, step=steps - 1)
    return store


def test_a_compacted_run_reads_as_before(tmp_path):
    store = _run(tmp_path / "r")
    plain = store.metrics_path.read_bytes()
    rows, frame = store.metric_rows(), load_runs(tmp_path)
    assert store.compact_metrics() is True
    assert not store.metrics_path.exists()
    assert lzma.decompress(store.compact_metrics_path.read_bytes()) == plain  # `xz -d` restores
    assert len(store.compact_metrics_path.read_bytes()) < len(plain)
    assert store.metric_rows() == rows  # values, types and each row's keys, as written
    assert store.metric_rows(up_to=1) == rows[:2]
    assert is_run_dir(store.dir) and find_run_dirs(tmp_path) == [store.dir]
    assert load_runs(tmp_path).drop(columns="run_dir").equals(frame.drop(columns="run_dir"))


def test_compaction_is_deterministic_and_idempotent(tmp_path):
    store = _run(tmp_path / "r")
    plain = store.metrics_path.read_bytes()
    store.compact_metrics()
    packed = store.compact_metrics_path.read_bytes()
    assert store.compact_metrics() is False  # nothing left to compact
    store.metrics_path.write_bytes(plain)  # e.g. a study's copy step brings the file again
    assert store.compact_metrics() is True
    assert store.compact_metrics_path.read_bytes() == packed
    assert not store.metrics_path.exists()


def test_plain_metrics_win_over_a_stale_compact_file(tmp_path):
    """Both present (a compaction cut short): metrics.jsonl is read and kept."""
    store = _run(tmp_path / "r")
    store.compact_metrics()
    store.metrics_path.write_text(json.dumps({"train/step": 0, "reward/total": 9.0}) + "\n")
    assert store.metric_rows() == [(0, {"reward/total": 9.0})]
    store.log_metrics(1, {"reward/total": 8.0})
    assert not store.compact_metrics_path.exists()
    assert [s for s, _ in store.metric_rows()] == [0, 1]


def test_training_on_a_compacted_run_expands_it_first(tmp_path):
    store = _run(tmp_path / "r", steps=4)
    rows = store.metric_rows()
    store.compact_metrics()
    store.truncate_metrics(1)  # a resume from step 1
    assert store.metrics_path.exists() and not store.compact_metrics_path.exists()
    assert store.metric_rows() == rows[:2]
    store.compact_metrics()
    store.log_metrics(4, {"reward/total": 0.4})
    assert store.metric_rows() == [*rows[:2], (4, {"reward/total": 0.4})]


def test_a_compacted_finished_run_is_skipped_by_resume_auto(tmp_path):
    store = _run(tmp_path / "r")
    store.compact_metrics()
    assert store.has_progress() and store.start_mode("auto") == "skip"


def test_invalid_compacted_metrics_name_the_compact_file(tmp_path):
    store = _run(tmp_path / "r")
    store.metrics_path.write_text("{not json\n" + store.metrics_path.read_text())
    store.compact_metrics()
    with pytest.raises(ValueError, match=r"metrics\.jsonl\.xz, line 1"):
        store.metric_rows()


def test_cli_compacts_finished_runs_and_leaves_running_ones(tmp_path, capsys):
    done = _run(tmp_path / "runs" / "a")
    live = _run(tmp_path / "runs" / "b", state="running")
    assert cli_main(["compact", str(tmp_path / "runs")]) == 0
    assert done.compact_metrics_path.exists() and not done.metrics_path.exists()
    assert live.metrics_path.exists() and not live.compact_metrics_path.exists()
    out = capsys.readouterr().out
    assert "compacted 1 of 2 runs" in out and "still running: b" in out
    assert cli_main(["compact", str(tmp_path / "runs" / "a")]) == 0
    assert "compacted 0 of 1 runs; 1 were compact already" in capsys.readouterr().out
    assert cli_main(["compact", str(tmp_path / "nothing")]) == 2  # bad input: exit 2, named
    assert "omgrpo compact: error: " in capsys.readouterr().err
