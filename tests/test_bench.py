"""`omgrpo bench step` end to end on the tiny config (the figures themselves are not asserted:
speed targets are benchmarks, not unit tests)."""

import json
from pathlib import Path

import pytest

from omgrpo.bench import main

pytestmark = pytest.mark.slow


def test_bench_step_reports_stages_per_shape_and_speedups_over_a_baseline_tree(
    tiny_overrides, tmp_path, capsys
):
    here = Path(__file__).resolve().parent.parent  # this tree as its own "baseline"
    out = tmp_path / "step.json"
    args = ["step", "--steps", "2", "--json", "--out", str(out), "--baseline", str(here)]
    assert main([*args, *tiny_overrides, "eval.every=0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out.read_text())
    for tree in ("new", "old"):
        for shape in ("16x8", "64x8"):
            figures = result[tree][shape]
            assert figures["time/step"] >= figures["time/gen"] > 0
            assert figures["perf/tokens_per_s"] > 0 and figures["mem/peak_gb"] > 0
    assert set(result["speedup"]["64x8"]) == {"time/step", "time/gen"}


def test_bench_step_vs_trl_runs_trls_trainer_on_the_same_model_and_batch(
    tiny_overrides, tmp_path, capsys
):
    pytest.importorskip("trl", reason="the peer comparison needs the `bench` extra")
    args = ["step", "--steps", "2", "--json", "--vs-trl"]
    assert main([*args, *tiny_overrides, "eval.every=0"]) == 0
    result = json.loads(capsys.readouterr().out)
    for shape in ("16x8", "64x8"):
        assert result["trl"][shape]["steps"] == 2 and result["trl"][shape]["time/step"] > 0
        ratio = result["trl"][shape]["time/step"] / result["new"][shape]["perf/step_wall_s"]
        assert result["trl_over_omgrpo"][shape] == pytest.approx(ratio)
