"""Each problem's fate (`omgrpo.analysis.problems`): the classification on a hand-built history,
a tiny native run writing problems.parquet, and `omgrpo report` reading it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from omgrpo.analysis.figures import draw_problem_fates
from omgrpo.analysis.problems import (
    FATES,
    FATES_FILE,
    PROBLEMS_FILE,
    classify_problems,
    fate_counts,
    load_problems,
)
from omgrpo.analysis.report import write_report
from omgrpo.tracking.artifacts import report_files

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "runs"


def history(rows: list[tuple[str, str, int, float, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["run", "problem_id", "step", "accuracy", "modal_share"])


# (run, problem, step, accuracy, modal share); right = accuracy >= 0.5; the middle row of each
# problem never decides its fate
HAND = history(
    [
        ("r", "learned", 0, 0.25, 0.5),
        ("r", "learned", 5, 0.0, 0.5),
        ("r", "learned", 10, 0.5, 0.5),  # exactly 0.5 is right
        ("r", "forgotten", 0, 0.75, 0.75),
        ("r", "forgotten", 5, 1.0, 1.0),
        ("r", "forgotten", 10, 0.25, 1.0),  # wrong, however much it agrees
        ("r", "sharpened", 0, 0.5, 0.5),
        ("r", "sharpened", 5, 0.0, 0.25),  # a dip between: the ends decide
        ("r", "sharpened", 10, 0.75, 0.75),
        ("r", "always", 10, 1.0, 1.0),  # rows out of order: sorted by step
        ("r", "always", 0, 1.0, 1.0),  # same share: not sharpened
        ("r", "never", 0, 0.0, 0.25),
        ("r", "never", 10, 0.25, 1.0),
        ("s", "learned", 4, 1.0, 0.5),  # another run, validated once: right -> always
    ]
)


def test_the_classification_on_a_hand_built_history():
    fates = classify_problems(HAND)
    got = dict(zip(zip(fates["run"], fates["problem_id"]), fates["fate"]))
    assert got == {
        ("r", "always"): "always",
        ("r", "forgotten"): "forgotten",
        ("r", "learned"): "learned",
        ("r", "never"): "never",
        ("r", "sharpened"): "sharpened",
        ("s", "learned"): "always",
    }
    row = fates.set_index(["run", "problem_id"]).loc[("r", "sharpened")]
    assert (row["first_step"], row["last_step"]) == (0, 10)
    assert (row["first_share"], row["last_share"]) == (0.5, 0.75)
    # a stricter "right" moves the borderline problems: 0.5 at the end or the start is wrong
    strict = classify_problems(HAND, right=0.6).set_index(["run", "problem_id"])["fate"]
    assert strict[("r", "learned")] == "never" and strict[("r", "sharpened")] == "learned"
    counts = fate_counts(fates).set_index("run")
    assert list(counts.columns) == [*FATES, "problems"]
    assert counts.loc["r"].tolist() == [1, 1, 1, 1, 1, 5]
    assert counts.loc["s"].tolist() == [0, 0, 0, 1, 0, 1]
    single = fate_counts(classify_problems(HAND[HAND["run"] == "r"].drop(columns="run")))
    assert single["run"].tolist() == ["all"] and single["problems"].tolist() == [5]


def test_the_fate_figure_draws_one_bar_per_run():
    counts = fate_counts(classify_problems(HAND))
    fig = draw_problem_fates(counts)
    (ax,) = fig.axes
    assert len(ax.patches) == len(FATES) * 2  # a segment per fate and run (0-wide included)


@pytest.mark.slow
def test_report_reads_the_fixture_problem_tables(tmp_path):
    out = tmp_path / "report"
    text = write_report([FIXTURE], out).read_text()
    assert "## Problems" in text and "toy__om_grpo__s1" in text
    counts = pd.read_csv(out / FATES_FILE).set_index("run")
    assert counts.loc["toy__om_grpo__s1", "learned"] == 3
    assert counts["problems"].tolist() == [4, 4, 4, 4]
    assert len(pd.read_csv(out / PROBLEMS_FILE)) == 16
    assert (out / "figures" / "problem_fates.png").stat().st_size > 1000
    assert "![problem_fates]" in text and "![reward_quality]" not in text  # fixture: no metrics
    logged = {p.name for p, _ in report_files(out)}  # the MLflow artifacts' "problems tables"
    assert {PROBLEMS_FILE, FATES_FILE, "problem_fates.png"} <= logged


@pytest.mark.slow
def test_a_tiny_native_run_writes_problems_parquet_at_each_validation(tiny_overrides, tmp_path):
    from omgrpo.backends.native.trainer import train
    from omgrpo.config import compose
    from omgrpo.tracking.store import RunStore

    run = train(compose([*tiny_overrides, "trainer.steps=2", "run.name=p"]))
    table = RunStore(run).read_problems()
    assert list(table.columns) == ["problem_id", "step", "accuracy", "modal_answer", "modal_share"]
    assert table["step"].tolist() == [0] * 4 + [2] * 4  # eval.num_prompts=4, eval.every=2
    assert table["problem_id"].nunique() == 4
    assert table["accuracy"].between(0, 1).all() and table["modal_share"].between(0, 1).all()
    metrics = RunStore(run).read_metrics()
    by_step = table.groupby("step")["accuracy"].mean()
    assert by_step.tolist() == pytest.approx(metrics["val/acc"].dropna().tolist())  # avg@k
    assert {"reward_quality/reward_acc", "reward_quality/zero_spread_groups"} <= set(metrics)
    report = write_report([run], tmp_path / "report")
    assert len(load_problems(run)) == 8 and "## Problems" in report.read_text()
