"""`omgrpo bench step` end to end on the tiny config (the figures themselves are not asserted:
speed targets are benchmarks, not unit tests)."""

import json
from pathlib import Path

import pytest

from omgrpo.tools import bench
from omgrpo.tools.bench import main


@pytest.mark.slow
def test_bench_step_reports_stages_per_shape_and_speedups_over_a_baseline_tree(
    tiny_overrides, tmp_path, capsys
):
    here = Path(__file__).resolve().parents[2]  # this tree as its own "baseline"
    out = tmp_path / "step.json"
    args = ["step", "--steps", "2", "--json", "--out", str(out), "--baseline", str(here)]
    # one shape (both shapes take the same path: the scripted test below runs both)
    assert main([*args, "--shapes", "16x8", *tiny_overrides, "eval.every=0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out.read_text())
    for tree in ("new", "old"):
        assert list(result[tree]) == ["16x8"]
        figures = result[tree]["16x8"]
        assert figures["time/step"] >= figures["time/gen"] > 0
        assert figures["perf/tokens_per_s"] > 0 and figures["mem/peak_gb"] > 0
    assert set(result["speedup"]["16x8"]) == {"time/step", "time/gen"}


@pytest.mark.slow
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


def test_vs_trl_without_trl_fails_before_any_run_and_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_trl_installed", lambda: False)
    monkeypatch.setattr(bench, "_measure", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["step", "--vs-trl"])
    assert exit_info.value.code == 2
    assert "make bench-env" in capsys.readouterr().err


def test_bench_step_repeats_interleave_the_sides_and_report_median_ratios(monkeypatch, tmp_path):
    """Three rounds per shape, scripted seconds: round 2 of the new tree hit a slow patch. The
    ratios are the medians of the rounds' ratios, the figures per-key medians."""
    calls = []
    new_wall = iter([1.0, 3.0, 1.2] * 2)  # per shape: rounds 1, 2, 3
    trl_step = iter([3.3, 3.3, 3.0] * 2)
    old_step = iter([5.0, 4.8, 6.0] * 2)

    def measure(overrides, steps, source=None):
        calls.append("old" if source else "new")
        if source:
            return {"time/step": next(old_step), "time/gen": 2.0}
        wall = next(new_wall)
        return {"time/step": wall, "time/gen": 0.5, "perf/step_wall_s": wall, "threads": 2}

    def measure_trl(overrides, steps):
        calls.append("trl")
        return {"time/step": next(trl_step), "trl": "x"}

    monkeypatch.setattr(bench, "_measure", measure)
    monkeypatch.setattr(bench, "_measure_trl", measure_trl)
    partial = tmp_path / "partial.json"
    result = bench.bench_step(steps=2, partial=partial, baseline=tmp_path, vs_trl=True, repeats=3)
    assert calls == ["new", "old", "trl"] * 6  # interleaved, round by round
    # rounds' TRL ratios 3.3, 1.1, 2.5 -> 2.5; speed-ups 5.0, 1.6, 5.0 -> 5.0
    assert result["ratio_rounds"]["16x8"]["trl_over_omgrpo"] == pytest.approx([3.3, 1.1, 2.5])
    assert result["trl_over_omgrpo"]["16x8"] == pytest.approx(2.5)
    assert result["speedup"]["64x8"]["time/step"] == pytest.approx(5.0)
    assert result["speedup"]["64x8"]["time/gen"] == pytest.approx(4.0)
    assert result["new"]["16x8"]["perf/step_wall_s"] == pytest.approx(1.2)  # median of 1, 3, 1.2
    assert result["new"]["16x8"]["threads"] == 2
    assert result["trl"]["64x8"] == {"time/step": 3.3, "trl": "x"}
    assert json.loads(partial.read_text())["partial"] is True
    with pytest.raises(ValueError, match="--repeats"):
        bench.bench_step(repeats=0)


def test_bench_step_shapes_selects_a_subset_and_refuses_unknown_names(monkeypatch, capsys):
    from omgrpo import cli

    shapes_run = []

    def measure(overrides, steps, source=None):
        shapes_run.append(next(o for o in overrides if o.startswith("trainer.prompts_per_step")))
        return {"time/step": 1.0, "time/gen": 0.5}

    monkeypatch.setattr(bench, "_measure", measure)
    assert list(bench.bench_step(steps=2)["new"]) == ["16x8", "64x8"]  # the default: all
    assert list(bench.bench_step(steps=2, shapes=["64x8"])["new"]) == ["64x8"]
    assert shapes_run[-1] == "trainer.prompts_per_step=64" and len(shapes_run) == 3
    for bad in ("32x8", "16x8,", ""):
        assert cli.main(["bench", "step", "--shapes", bad]) == 2
        err = capsys.readouterr().err
        assert "--shapes" in err and "subset of 16x8, 64x8" in err and "Traceback" not in err
    assert len(shapes_run) == 3  # nothing measured after a refusal


def test_every_benchmark_result_records_its_provenance(monkeypatch, capsys, tmp_path):
    """A figure without the commit, torch build and device it came from cannot be compared with
    another: the JSON (stdout and --out) carries the same record a training run logs."""
    import torch

    monkeypatch.setitem(bench.BENCHMARKS, "car", lambda **kwargs: {"benchmark": "car"})
    out = tmp_path / "car.json"
    assert main(["car", "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out.read_text())
    record = result["provenance"]
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["omgrpo"] and record["device_type"] in ("cpu", "cuda")
    assert record["torch_build"] and "git_commit" in record and record["hostname"]
