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
