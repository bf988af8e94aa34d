"""The early warning (`omgrpo.analysis.warning`): falls, alarms, lead times and false alarms on
hand-built histories whose answers are known by construction, and the CLI on committed runs."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from omgrpo.analysis import warning
from omgrpo.analysis.load import collapse_step, load_runs
from omgrpo.core.diagnostics import CollapseDetector

REPO = Path(__file__).resolve().parents[2]
V2_RUNS = REPO / "reports/collapse-study-v2/runs"
FLIP = "answers/label_flip_rate"


# -- one run ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("acc", "expected"),
    [
        ([0.8, 0.8, 0.7, 0.7, 0.7], 20),  # below 0.75 at 20 and at 30
        ([0.8, 0.7, 0.8, 0.8, 0.8], None),  # one dip, not confirmed by the next validation
        ([0.8, 0.8, 0.8, 0.8, 0.74], 40),  # at the last validation: no confirmation needed
        ([0.8, 0.76, 0.76, 0.76, 0.76], None),  # within the margin
        ([0.8, math.nan, 0.7, 0.7, 0.8], 20),  # a missing validation is skipped
        ([0.8], None),
    ],
)
def test_fall_step(acc, expected):
    steps = [0, 10, 20, 30, 40][: len(acc)]
    assert warning.fall_step(steps, acc, margin=0.05) == expected


def test_deviation_floor_and_first_alarm():
    # baseline: median of the first 5 logged values (0.1, nan skipped); up by >= 0.3 for 3 steps
    values = [0.1, 0.1, math.nan, 0.2, 0.0, 0.1, 0.5, 0.5, 0.1, 0.5, 0.5, 0.5, 0.5]
    steps = np.arange(1, len(values) + 1)
    floor = warning.deviation_floor(values, +1, baseline_steps=5, patience=3)
    assert np.isnan(floor[:8]).all()  # baseline (6 steps, one nan) + 2 more before a window
    np.testing.assert_allclose(floor[8:], [0.0, 0.0, 0.0, 0.4, 0.4])
    alarms = warning.first_alarms(steps, floor, np.array([0.5, 0.4, 0.3, 0.0]))
    np.testing.assert_array_equal(alarms, [np.nan, 12, 12, 9])
    down = warning.deviation_floor([1.0] * 5 + [0.5] * 3, -1, baseline_steps=5, patience=3)
    assert down[-1] == pytest.approx(0.5)  # falling signals alarm on the way down


def test_detector_alarm_is_collapse_detectors_rule():
    rng = np.random.default_rng(0)
    for _ in range(50):
        unique = rng.choice([1.0, 1.5, 2.0, 3.0], size=30)
        share = rng.choice([0.3, 0.5, 0.8], size=30)
        setting = (1.5, 0.5, int(rng.integers(1, 4)))
        detector = CollapseDetector(*setting)
        fired = [s for s in range(1, 31) if detector.update(s, {
            "answers/unique_per_prompt": unique[s - 1],
            "answers/batch_mode_share": share[s - 1]})]  # fmt: skip
        got = warning.detector_alarm(range(1, 31), unique, share, setting)
        assert got == (fired[0] if fired else None)
    assert (
        warning.detector_alarm([1, 2, 3], [1.0, math.nan, 1.0], [0.9, 0.9, 0.9], (1.5, 0.5, 2)) == 3
    )


def test_outcome_and_choose():
    falls = np.array([30.0, 20.0, np.nan, np.nan])
    # column 0 warns on both falls and alarms on one clean run; column 1 warns on one, no false
    # alarm; column 2 alarms late on both falls
    alarms = np.array([[17, 25, 40], [12, np.nan, 25], [np.nan, np.nan, np.nan], [32, np.nan, 5]])
    assert warning.outcome(alarms[:, 0], falls) == (1.0, 0.5, 10.5)
    assert warning.outcome(alarms[:, 1], falls) == (0.5, 0.0, 5.0)
    assert warning.outcome(alarms[:, 2], falls) == (0.0, 0.5, -math.inf)
    assert warning.choose(alarms, falls) in (0, 1)  # both score 0.5: ...
    assert warning.choose(alarms, falls) == 0  # ... the longer median lead wins
    assert warning.choose(alarms[:, [1, 1]], falls) == 0  # a full tie: the earlier candidate


# -- a set of runs ----------------------------------------------------------------------------
def _run(name, seed, acc, jump_at):
    """41 steps, validation every 10; the flip rate is 0.1 until `jump_at`, 0.5 from it on."""
    rows = []
    for step in range(41):
        row = {"run": name, "run_dir": f"/study/runs/{name}", "seed": seed, "step": step}
        if step % 10 == 0:
            row["val/acc"] = acc[step // 10]
        if step >= 1:
            row[FLIP] = 0.5 if jump_at is not None and step >= jump_at else 0.1
        rows.append(row)
    return rows


def _study():
    """a (seed 0) falls at 30, warned at 17 (lead 13); b (seed 1) falls at 20, warned at 12
    (lead 8); c (seed 0) dips once and never alarms; d (seed 1) never falls, alarms at 32."""
    rows = [
        *_run("a", 0, [0.8, 0.8, 0.8, 0.6, 0.6], 15),
        *_run("b", 1, [0.8, 0.8, 0.6, 0.6, 0.6], 10),
        *_run("c", 0, [0.8, 0.8, 0.7, 0.8, 0.8], None),
        *_run("d", 1, [0.8, 0.8, 0.8, 0.8, 0.8], 30),
    ]
    return warning.histories(pd.DataFrame(rows))


def test_lead_times_and_false_alarms_by_construction():
    runs = _study()
    assert [h.label for h in runs] == ["study/a", "study/b", "study/c", "study/d"]
    np.testing.assert_array_equal(warning.falls_of(runs), [30, 20, np.nan, np.nan])
    result = warning.early_warning(runs, calibrate=["study/a", "study/c"])
    flip = result["signals"][FLIP]
    assert flip["threshold"] == pytest.approx(0.4)
    assert flip["calibration"]["fell"] == [
        {"run": "study/a", "fall": 30, "alarm": 17, "lead": 13.0}
    ]
    assert flip["calibration"]["false_alarm_rate"] == 0.0
    judged = flip["judged"]
    assert judged["fell"] == [{"run": "study/b", "fall": 20, "alarm": 12, "lead": 8.0}]
    assert judged["false_alarms"] == {"study/d": 32}
    assert judged["false_alarm_rate"] == 1.0
    loso = flip["leave_one_seed_out"]
    assert [(r["run"], r["lead"]) for r in loso["fell"]] == [("study/a", 13.0), ("study/b", 8.0)]
    assert loso["warned"] == 2 and loso["median_lead"] == 10.5
    assert loso["false_alarms"] == {"study/d": 32} and loso["false_alarm_rate"] == 0.5
    # no run logs the detector's inputs: it never fires, and its default stands
    assert result["signals"][warning.DETECTOR]["judged"]["warned"] == 0
    assert result["detector_decision"]["change"] is False
    assert result["warns_first"]["judged"] == {"any": None, "label_free": None}  # FA rate 100%
    assert result["warns_first"]["leave_one_seed_out"]["any"] is None  # 50% > 20%
    text = warning.render(result)
    assert "study/b +8" in text and "1/1 (100%): study/d @32" in text


def test_detector_decision_follows_the_stated_rule():
    def results(default, chosen, setting):
        return {
            warning.detector_name(warning.DEFAULT_DETECTOR): {"judged": default},
            warning.DETECTOR: {"threshold": list(setting), "judged": chosen},
        }

    def s(warned, rate):
        return {"warned": warned, "false_alarm_rate": rate, "n_fell": 4}

    other = (3.0, 0.3, 1)
    assert (
        warning.detector_decision(results(s(0, 0.0), s(4, 0.1), other), "judged")["change"] is False
    )
    assert warning.detector_decision(results(s(1, 0.2), s(1, 0.1), other), "judged")["change"]
    assert warning.detector_decision(results(s(1, 0.1), s(3, 0.1), other), "judged")["change"]
    same = warning.DEFAULT_DETECTOR
    assert (
        warning.detector_decision(results(s(1, 0.2), s(3, 0.1), same), "judged")["change"] is False
    )


def test_first_warning_takes_the_longest_lead_within_the_false_alarm_limit():
    def s(warned, rate, lead):
        return {
            "judged": {"warned": warned, "n_fell": 4, "false_alarm_rate": rate, "median_lead": lead}
        }

    results = {"x": s(4, 0.5, 90), "y": s(3, 0.1, 20), "z": s(1, 0.0, 80), "w": s(2, 0.2, 30)}
    assert warning.first_warning(results, "judged") == "w"
    results["w"]["uses_labels"] = True
    assert warning.first_warning(results, "judged", label_free=True) == "y"


# -- committed runs ---------------------------------------------------------------------------
def test_the_cli_on_committed_runs_names_them(tmp_path):
    fell, stable = V2_RUNS / "toy_shortcut__om_grpo__s4", V2_RUNS / "toy_shortcut__gt__s3"
    assert (
        warning.main([str(fell), str(stable), "--calibrate", str(stable), "--out", str(tmp_path)])
        == 0
    )
    text = (tmp_path / "warning.md").read_text()
    assert "collapse-study-v2/toy_shortcut__om_grpo__s4 | judged | 0.691 | 45 |" in text
    result = json.loads((tmp_path / "warning.json").read_text())
    assert [r["run"] for r in result["runs"]] == [
        "collapse-study-v2/toy_shortcut__gt__s3",
        "collapse-study-v2/toy_shortcut__om_grpo__s4",
    ]
    assert [r["set"] for r in result["runs"]] == ["calibration", "judged"]
    judged = result["signals"][FLIP]["judged"]
    assert judged["fell"][0]["run"] == "collapse-study-v2/toy_shortcut__om_grpo__s4"
    assert len(judged["alarms"]) == 1  # the judged runs' alarm steps, in the order of `runs`
    # the replayed default detector is the verdict's (`collapse_step`)
    df = load_runs(fell, stable)
    for h in warning.histories(df):
        run = df[df["run"] == h.label.split("/")[-1]]
        step = warning.detector_alarm(
            h.steps, h.signals["answers/unique_per_prompt"], h.signals["answers/batch_mode_share"]
        )
        assert step == collapse_step(run)


@pytest.mark.e2e
def test_the_committed_early_warning_regenerates(tmp_path, monkeypatch):
    """reports/early-warning/ from the committed v2 and v3 runs (about a minute)."""
    committed = REPO / "reports/early-warning"
    monkeypatch.chdir(REPO)
    warning.main([
        "reports/collapse-study-v2/runs", "reports/collapse-study-v3/runs",
        "--calibrate", "reports/collapse-study-v2/runs", "--out", str(tmp_path),
    ])  # fmt: skip
    new, old = (json.loads((d / "warning.json").read_text()) for d in (tmp_path, committed))
    new.pop("command"), old.pop("command")
    assert new == old
