"""Pre-registered predictions marked from runs (omgrpo.analysis.study), on hand-built runs."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from omgrpo.analysis.study import judge_predictions, prediction_texts, read_preregistration

PREREG = Path(__file__).resolve().parents[2] / "reports/collapse-study/PREREGISTRATION.md"
SPEC = {"start_step": 0, "final_steps": [20, 30], "train_window": 2}


def _run(experiment, method, seed, acc, kl=None):
    """A run whose val/acc is acc[0] at step 0, acc[1] at 20 and acc[2] at 30."""
    rows = []
    for step in range(31):
        row = {
            "run": f"{experiment}__{method}__s{seed}",
            "experiment": experiment,
            "method": method,
            "seed": seed,
            "step": step,
        }
        if step in (0, 20, 30):
            row["val/acc"] = acc[(0, 20, 30).index(step)]
        if kl is not None and step > 0:
            row["kl/answer"] = kl * step
        rows.append(row)
    return pd.DataFrame(rows)


def _pred(**kw):
    return {"id": "P", "world": "w", **kw}


def test_change_over_seeds_with_a_t_interval():
    df = pd.concat(
        [_run("w", "gt", s, [0.5, 0.55 + d, 0.55 + d]) for s, d in enumerate([0.0, 0.02, 0.04])]
    )
    (v,) = judge_predictions(
        df,
        {
            **SPEC,
            "predictions": [_pred(measure="change", metric="val/acc", a="gt", expect=[">", 0.03])],
        },
    )
    assert v.values == {"w/s0": 0.05, "w/s1": 0.07, "w/s2": 0.09}
    # mean 0.07, sd 0.02, t(2) = 4.303: half-width 0.0497
    assert v.mean == pytest.approx(0.07)
    assert v.ci95 == pytest.approx((0.07 - 0.0497, 0.07 + 0.0497), abs=1e-4)
    assert v.verdict == "inconclusive"  # 0.0203 < 0.03
    (v,) = judge_predictions(
        df,
        {
            **SPEC,
            "predictions": [_pred(measure="change", metric="val/acc", a="gt", expect=[">", 0.0])],
        },
    )
    assert v.verdict == "confirmed"
    (v,) = judge_predictions(
        df,
        {
            **SPEC,
            "predictions": [_pred(measure="change", metric="val/acc", a="gt", expect=["<", 0.0])],
        },
    )
    assert v.verdict == "refuted"


def test_paired_diff_includes_further_bases_and_abs_threshold():
    df = pd.concat(
        [
            _run("w", "a", 0, [0.5, 0.6, 0.6]),
            _run("w", "b", 0, [0.5, 0.59, 0.59]),
            _run("w_base1", "a", 0, [0.4, 0.5, 0.5]),
            _run("w_base1", "b", 0, [0.4, 0.51, 0.51]),
            _run("other", "a", 0, [0.0, 1.0, 1.0]),  # another world: never a unit of w
        ]
    )
    (v,) = judge_predictions(
        df,
        {
            **SPEC,
            "predictions": [
                _pred(measure="diff", metric="val/acc", a="a", b="b", expect=["abs<", 0.03])
            ],
        },
    )
    assert v.values == {"w/s0": pytest.approx(0.01), "w_base1/s0": pytest.approx(-0.01)}
    # mean 0, sd 0.01414, t(1) = 12.71: half-width 0.127 -> not within +-0.03, not outside
    assert v.verdict == "inconclusive"
    (v,) = judge_predictions(
        df,
        {
            **SPEC,
            "predictions": [
                _pred(
                    measure="diff", metric="val/acc", a="a", b="b", seeds=[0], expect=["abs<", 0.03]
                )
            ],
        },
    )
    assert list(v.values) == ["w/s0"] and v.verdict == "confirmed, 1 seed, no CI"


def test_training_metric_window_spearman_and_missing_runs():
    df = pd.concat([_run("w", m, 0, [0.5, 0.5, 0.5], kl=k) for m, k in (("w0", 1.0), ("w1", 2.0))])
    (v,) = judge_predictions(
        df,
        {
            **SPEC,
            "predictions": [
                _pred(measure="diff", metric="kl/answer", a="w0", b="w1", expect=["<", 0.0])
            ],
        },
    )
    # window: steps 29 and 30 -> means 29.5 vs 59
    assert v.values["w/s0"] == pytest.approx(29.5 - 59.0)
    df2 = pd.concat(
        [
            _run("w", f"m{i}", 0, [0.5, 0.5 + c, 0.5 + c])
            for i, c in enumerate([0.0, 0.1, 0.05, 0.2])
        ]
    )
    (v,) = judge_predictions(
        df2,
        {
            **SPEC,
            "predictions": [
                _pred(
                    measure="spearman",
                    metric="val/acc",
                    methods=["m0", "m1", "m2", "m3"],
                    x=[0, 1, 2, 3],
                    expect=[">", 0.5],
                )
            ],
        },
    )
    assert v.values["w/s0"] == pytest.approx(0.8)  # ranks 1, 3, 2, 4
    (v,) = judge_predictions(
        df,
        {
            **SPEC,
            "predictions": [
                _pred(measure="change", metric="val/acc", a="absent", expect=[">", 0.0])
            ],
        },
    )
    assert v.verdict == "not run" and math.isnan(v.values["w/s0"])
    unfinished = _run("w", "gt", 0, [0.5, 0.6, 0.6])
    unfinished = unfinished[unfinished["step"] < 25]  # has not reached its last validation
    (v,) = judge_predictions(
        unfinished,
        {
            **SPEC,
            "predictions": [_pred(measure="change", metric="val/acc", a="gt", expect=[">", 0.0])],
        },
    )
    assert v.verdict == "not run"


def test_the_committed_preregistration_parses():
    spec = read_preregistration(PREREG)
    ids = [p["id"] for p in spec["predictions"]]
    assert ids == [f"P{i}" for i in range(len(ids))]
    assert set(prediction_texts(PREREG)) == set(ids)
    assert spec["stop_unless_confirmed"] == "P0"


def test_a_malformed_prediction_is_named(tmp_path):
    bad = tmp_path / "p.md"
    bad.write_text(
        "```yaml\nstart_step: 0\nfinal_steps: [1]\npredictions:\n  - {id: Q1, world: w, measure: change, metric: m, expect: ['>=', 0]}\n```\n"
    )
    with pytest.raises(ValueError, match="Q1: expect"):
        read_preregistration(bad)


@pytest.mark.slow
def test_study_report_cli_on_fixture_runs(tmp_path, capsys):
    from omgrpo.cli import main

    runs = Path(__file__).resolve().parents[1] / "fixtures" / "runs"
    prereg = tmp_path / "PREREGISTRATION.md"
    prereg.write_text(
        "| P0 | toy | GT-free runs: OM-GRPO ends above MV |\n\n```yaml\nversion: 1\n"
        "date: 2026-11-23\nstart_step: 0\nfinal_steps: [8]\nstop_unless_confirmed: P0\n"
        "predictions:\n  - {id: P0, world: toy, measure: diff, metric: val/acc, a: om_grpo, "
        "b: mv, expect: ['>', 0.0]}\n```\n"
    )
    out = tmp_path / "report"
    assert (
        main(
            [
                "study-report",
                str(runs),
                "--prereg",
                str(prereg),
                "--out",
                str(out),
                "--command",
                "make study",
                "--seconds",
                "90",
            ]
        )
        == 0
    )
    text = (out / "report.md").read_text()
    assert "OM-GRPO ends above MV" in text and "`make study`" in text and "1.5 min" in text
    summary = __import__("json").loads((out / "summary.json").read_text())
    (v,) = summary["verdicts"]
    assert set(v["values"]) == {"toy/s0", "toy/s1"}
    assert (out / "figures" / "toy__training_dynamics.png").stat().st_size > 0
    assert "Interim report" not in text and summary["interim"] is False
    assert (
        main(["study-report", str(runs), "--prereg", str(prereg), "--out", str(out), "--interim"])
        == 0
    )
    text = (out / "report.md").read_text()
    assert "**Interim report: the grid is not complete (" in text
    assert __import__("json").loads((out / "summary.json").read_text())["interim"] is True
    assert not (out / "figures" / "toy__collapse_route.png").exists()  # no difficulty metrics
    assert (
        main(["study-report", str(runs), "--prereg", str(tmp_path / "none.md"), "--out", str(out)])
        == 2
    )


@pytest.mark.slow
def test_reports_print_the_bases_checks(tmp_path):
    """`omgrpo report` and the study report show the stored checks of the base a run used."""
    import json
    import shutil

    from omegaconf import OmegaConf

    from omgrpo.analysis.report import base_checks, write_report
    from omgrpo.config import Config
    from omgrpo.models.toy import toy_base_key

    run = tmp_path / "runs" / "toy__mv__s0"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "runs" / "toy__mv__s0", run)
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.model.cache_dir = str(tmp_path / "cache")
    OmegaConf.save(cfg, run / "config.yaml")
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    base = tmp_path / "cache" / f"toy-base-{toy_base_key(merged.model, merged.task)}"
    base.mkdir(parents=True)
    checks = {"passed": True, "checks": [], "by_difficulty": [], "answer_entropy": None}
    (base / "checks.json").write_text(json.dumps(checks))
    assert list(base_checks([run]).values()) == [checks]
    text = write_report([run], tmp_path / "report").read_text()
    assert "## Base checks" in text and "base checks: PASSED" in text


def test_opened_is_a_share_of_units_with_an_exact_interval():
    """Route opened: 1 per unit whose change exceeds `above`; 3 of 4 units here. Clopper-Pearson
    for 3/4: (0.1941, 0.9937) by hand from the beta quantiles."""
    changes = [0.40, 0.35, 0.10, 0.50]
    df = pd.concat([_run("w", "mv", s, [0.2, 0.2 + d, 0.2 + d]) for s, d in enumerate(changes)])
    pred = _pred(measure="opened", metric="val/acc", a="mv", above=0.3, expect=[">", 0.1])
    (v,) = judge_predictions(df, {**SPEC, "predictions": [pred]})
    assert v.values == {"w/s0": 1.0, "w/s1": 1.0, "w/s2": 0.0, "w/s3": 1.0}
    assert v.mean == pytest.approx(0.75)
    assert v.ci95 == pytest.approx((0.1941, 0.9937), abs=1e-4)
    assert v.verdict == "confirmed"  # 0.194 > 0.1
    (v,) = judge_predictions(df, {**SPEC, "predictions": [{**pred, "expect": [">", 0.5]}]})
    assert v.verdict == "inconclusive"
    (v,) = judge_predictions(df, {**SPEC, "predictions": [{**pred, "expect": ["<", 0.1]}]})
    assert v.verdict == "refuted"


def test_a_prediction_may_start_at_its_own_step():
    """`start_step` per prediction (the mech/* metrics start at step 1): change from step 1."""
    df = _run("w", "gt", 0, [0.5, 0.7, 0.7])
    df.loc[df["step"] == 1, "val/acc"] = 0.6
    base = _pred(measure="change", metric="val/acc", a="gt", expect=[">", 0.0])
    (v0, v1) = judge_predictions(
        df, {**SPEC, "predictions": [base, {**base, "id": "Q", "start_step": 1}]}
    )
    assert v0.mean == pytest.approx(0.2) and v1.mean == pytest.approx(0.1)


def test_several_gates_and_unknown_gates(tmp_path):
    prereg = tmp_path / "p.md"
    block = (
        "| C1 | w | GT rises |\n| C2 | w | the null stays |\n\n```yaml\nstart_step: 0\n"
        "final_steps: [1]\nstop_unless_confirmed: {gates}\npredictions:\n"
        "  - {{id: C1, world: w, measure: change, metric: m, a: gt, expect: ['>', 0]}}\n"
        "  - {{id: C2, world: w, measure: change, metric: m, a: null, expect: ['abs<', 0.03]}}\n```\n"
    )
    prereg.write_text(block.format(gates="[C1, C2]"))
    assert read_preregistration(prereg)["stop_unless_confirmed"] == ["C1", "C2"]
    assert prediction_texts(prereg) == {"C1": "GT rises", "C2": "the null stays"}
    prereg.write_text(block.format(gates="[C1, C3]"))
    with pytest.raises(ValueError, match=r"names no prediction: \['C3'\]"):
        read_preregistration(prereg)


@pytest.mark.slow
def test_a_shipped_bases_checks_are_found_without_the_cache(tmp_path):
    """A fresh clone has no model cache yet: the report reads the checks of the copy shipped with
    omgrpo (the shortcut world's base is shipped), and says "not on this machine" (None) only
    for a base that is neither cached nor shipped."""
    from omegaconf import OmegaConf

    from omgrpo.analysis.report import base_checks
    from omgrpo.config import compose
    from omgrpo.models.basecheck import read_base_checks
    from omgrpo.models.bases import SHIPPED_DIR
    from omgrpo.models.toy import toy_base_key

    def run_with(*overrides: str):
        cfg = compose(["experiment=toy_shortcut", "method=mv", *overrides])
        cfg.model.cache_dir = str(tmp_path / "empty-cache")
        run = tmp_path / "runs" / f"run{len(list(tmp_path.glob('runs/*')))}"
        run.mkdir(parents=True)
        OmegaConf.save(cfg, run / "config.yaml")
        return run, toy_base_key(cfg.model, cfg.task)

    shipped_run, key = run_with()
    assert (SHIPPED_DIR / f"toy-base-{key}" / "checks.json").exists()
    other_run, other_key = run_with("model.warm_start.seed=99")  # a base nobody shipped
    assert not (SHIPPED_DIR / f"toy-base-{other_key}").exists()
    found = list(base_checks([shipped_run, other_run]).values())
    assert found == [read_base_checks(SHIPPED_DIR / f"toy-base-{key}"), None]
    assert found[0]["passed"] is True
