"""Pre-registered predictions marked from runs (omgrpo.analysis.study), on hand-built runs."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

from omgrpo.analysis.study import judge_predictions, prediction_texts, read_preregistration
from omgrpo.analysis.study_events import (
    EventTime,
    detector_time,
    event_summary,
    occurred_by,
    route_open_time,
)
from omgrpo.analysis.study_stats import (
    binomial_p,
    clopper_pearson,
    holm,
    median_interval,
    order_statistic_rank,
    stratified,
    t_p,
)
from omgrpo.errors import InputError

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
    from omgrpo.models.base_key import toy_base_key

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
    from omgrpo.models.base_key import toy_base_key
    from omgrpo.models.basecheck import read_base_checks
    from omgrpo.models.bases import SHIPPED_DIR

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


# -- study v4's extensions: statistics checked by hand -------------------------------------------

V4 = Path(__file__).resolve().parents[2] / "reports/collapse-study-v4/PREREGISTRATION-v4.md"
V3_RUNS = Path(__file__).resolve().parents[2] / "reports/collapse-study-v3/runs"


def _t2_sf(t):
    """Student t with 2 df in closed form: P(T >= t) = 1/2 - t / (2 sqrt(2 + t^2))."""
    return 0.5 - t / (2 * math.sqrt(2 + t * t))


def test_holm_on_a_hand_made_family():
    # sorted: D .005 <= .05/4 yes; A .01 <= .05/3 yes; C .03 <= .05/2 no -> stop (B not either)
    out = holm({"A": 0.01, "B": 0.04, "C": 0.03, "D": 0.005}, 0.05)
    assert {k: r for k, (r, _) in out.items()} == {"A": True, "B": False, "C": False, "D": True}
    # adjusted: D 4 x .005 = .02; A max(.02, 3 x .01) = .03; C max(.03, 2 x .03) = .06; B .06
    assert {k: p for k, (_, p) in out.items()} == pytest.approx(
        {"A": 0.03, "B": 0.06, "C": 0.06, "D": 0.02}
    )
    # v4's K2 (1/64) survives at 0.025 only as the family's largest p ...
    small = {"K1": 0.001, "K3": 0.002, "K4": 0.003, "K5": 0.004}
    assert holm({**small, "K2": 1 / 64}, 0.025)["K2"][0] is True
    # ... not when another p is larger (then it needs <= 0.025 / 2)
    assert holm({**small, "K5": 0.02, "K2": 1 / 64}, 0.025)["K2"][0] is False
    # a missing p (not run) counts as 1 and blocks nothing before it
    out = holm({"A": 0.001, "B": math.nan}, 0.025)
    assert out["A"][0] is True and out["B"] == (False, 1.0)


def test_clopper_pearson_and_the_binomial_test_against_known_values():
    # 0 of 6: upper end 1 - 0.025^(1/6) = 0.4593; 6 of 6 mirrors it; 3 of 4: (0.1941, 0.9937)
    assert clopper_pearson(0, 6) == pytest.approx((0.0, 1 - 0.025 ** (1 / 6)), abs=1e-9)
    assert clopper_pearson(0, 6)[1] == pytest.approx(0.4593, abs=1e-4)
    assert clopper_pearson(6, 6) == pytest.approx((0.025 ** (1 / 6), 1.0), abs=1e-9)
    assert clopper_pearson(3, 4) == pytest.approx((0.1941, 0.9937), abs=1e-4)
    # K2: no unit of 6 fires, "share < 0.5": p = P(X <= 0) = 1/64; the opposite side P(X >= 0) = 1
    assert binomial_p(0, 6, 0.5, "<") == pytest.approx((1 / 64, 1.0))
    # 5 of 6, "share > 0.5": P(X >= 5) = 7/64; opposite P(X <= 5) = 63/64
    assert binomial_p(5, 6, 0.5, ">") == pytest.approx((7 / 64, 63 / 64))


def test_t_and_tost_p_values_by_the_closed_form_of_t_with_2_df():
    values = [0.01, 0.02, 0.0]  # mean 0.01, sd 0.01, se 0.01 / sqrt(3)
    se = 0.01 / math.sqrt(3)
    up, down = _t2_sf((0.01 + 0.03) / se), _t2_sf((0.03 - 0.01) / se)  # 0.0101, 0.0371
    assert (up, down) == pytest.approx((0.010102, 0.037090), abs=1e-6)
    # TOST: the larger of "mean > -0.03" and "mean < +0.03"; opposite: the smaller of the two
    # tests of lying outside (mean > +0.03: 1 - 0.0371; mean < -0.03: 1 - 0.0101)
    assert t_p(values, "abs<", 0.03) == pytest.approx((down, 1 - down), abs=1e-9)
    # TOST p < 0.025 exactly when the 95% interval lies within +-threshold: not here
    (v,) = judge_predictions(
        pd.concat([_run("w", "a", s, [0.5, 0.5 + d, 0.5 + d]) for s, d in enumerate(values)]),
        {**SPEC, "predictions": [_pred(measure="change", metric="val/acc", a="a",
                                       expect=["abs<", 0.03])]},
    )  # fmt: skip
    assert v.verdict == "inconclusive" and v.ci95[1] > 0.03
    # one-sided t: "> 0" has t = 0.01 / se = sqrt(3): p = 1/2 - sqrt(3) / (2 sqrt(5))
    assert t_p(values, ">", 0.0) == pytest.approx((_t2_sf(math.sqrt(3)), 1 - _t2_sf(math.sqrt(3))))
    assert t_p(values, "<", 0.0)[0] == pytest.approx(1 - _t2_sf(math.sqrt(3)))
    assert math.isnan(t_p([0.1], ">", 0.0)[0])


def test_the_order_statistic_median_interval_with_censoring():
    assert order_statistic_rank(6) == (1, pytest.approx(1 - 2 / 64))  # 96.9%
    assert order_statistic_rank(5) == (1, pytest.approx(1 - 2 / 32))  # 93.8%, below 95%
    # n = 10: r = 2 covers 1 - 2 (1 + 10) / 1024 = 97.9%; r = 3 only 89.1%
    assert order_statistic_rank(10) == (2, pytest.approx(1 - 22 / 1024))
    m = median_interval([195, 210, None, 300, 180, None], censor=450)
    assert (m.median, m.low, m.high) == ("255", "180", "> 450")  # (210 + 300) / 2
    assert m.coverage == pytest.approx(0.96875)
    # the upper middle value censored: the median is only known to exceed (300 + 450) / 2
    assert median_interval([100, 200, 300, None, None, None], 450).median == "> 375"
    assert median_interval([100, None, None, None, None, None], 450).median == "> 450"
    assert median_interval([30, 60, 90], 450).median == "60"


def test_the_base_stratified_estimate_by_hand():
    out = stratified({"b0": [0.1, 0.2, 0.3], "b1": [0.4, 0.5, 0.6]})
    half = 4.302653 * 0.1 / math.sqrt(3)  # t(2) within a base
    assert out["bases"]["b0"]["mean"] == pytest.approx(0.2)
    assert out["bases"]["b0"]["ci95"] == pytest.approx((0.2 - half, 0.2 + half), abs=1e-6)
    # mean of base means 0.35; pooled SD sqrt((0.02 + 0.02) / 4) = 0.1 on 4 df;
    # se = 0.1 sqrt(1/3 + 1/3) / 2; t(4) = 2.776445
    se = 0.1 * math.sqrt(2 / 3) / 2
    assert out["estimate"] == pytest.approx(0.35) and out["dof"] == 4
    assert out["ci95"] == pytest.approx((0.35 - 2.776445 * se, 0.35 + 2.776445 * se), abs=1e-6)


def _val_run(experiment, method, seed, values, metric="val/acc", **extra):
    """A run with `metric` at the validation steps `values` (step -> value) and `extra`
    columns (name -> {step: value}) at training steps."""
    steps = sorted(set(values) | {s for col in extra.values() for s in col})
    rows = []
    for step in steps:
        row = {"run": f"{experiment}__{method}__s{seed}", "experiment": experiment,
               "method": method, "seed": seed, "step": step}  # fmt: skip
        if step in values:
            row[metric] = values[step]
        for name, col in extra.items():
            if step in col:
                row[name] = col[step]
        rows.append(row)
    return pd.DataFrame(rows)


def test_at_every_validation_confirms_only_if_every_validation_does():
    spec = {"start_step": 0, "final_steps": [20, 30], "train_window": 2}
    pred = _pred(measure="change", metric="val/acc", a="null", at_every_validation=True,
                 expect=["abs<", 0.03])  # fmt: skip

    def judge(at10):
        base = [(0.00, 0.01, 0.00), (0.01, 0.00, 0.01), (0.00, 0.01, 0.00)]
        df = pd.concat(
            [_val_run("w", "null", s, {0: 0.5, 10: 0.5 + at10[s], 20: 0.5 + b[1], 30: 0.5 + b[2]})
             for s, b in enumerate(base)]
        )  # fmt: skip
        (v,) = judge_predictions(df, {**spec, "predictions": [pred]})
        return v

    v = judge([0.0, 0.01, 0.0])
    assert [r["step"] for r in v.per_validation] == [10, 20, 30]
    assert v.verdict == "confirmed, at every validation (3 of 3 confirmed, 0 refuted)"
    v = judge([0.10, 0.11, 0.10])  # far outside +-0.03 at step 10: refuted though the end holds
    assert v.verdict.startswith("refuted") and v.per_validation[0]["verdict"] == "refuted"
    assert v.ci95[1] < 0.03  # the final window alone would have confirmed it
    v = judge([0.0, 0.05, 0.0])  # mean 0.017, half-width 0.072 at step 10: inconclusive there
    assert v.verdict == "inconclusive, at every validation (2 of 3 confirmed, 0 refuted)"


def test_at_every_validation_is_not_confirmed_before_the_runs_are_complete():
    """An unfinished grid: confirmed at every validation so far is "not run", never
    "confirmed"; a validation missing from `validation_every`'s steps too; a refutation
    counts at once."""
    spec = {"start_step": 0, "final_steps": [20, 30], "train_window": 2}
    pred = _pred(measure="change", metric="val/acc", a="null", at_every_validation=True,
                 expect=["abs<", 0.03])  # fmt: skip
    near = {0: 0.5, 10: 0.5, 20: 0.51}
    df = pd.concat([_val_run("w", "null", s, near | {10: 0.5 + 0.005 * s}) for s in range(3)])
    (v,) = judge_predictions(df, {**spec, "predictions": [pred]})  # no step-30 validation
    assert (
        v.verdict
        == "not run, at every validation (2 of 2 validations there; 2 of 2 confirmed, 0 refuted)"
    )
    full = pd.concat([_val_run("w", "null", s, near | {30: 0.5}) for s in range(3)])
    (v,) = judge_predictions(full, {**spec, "validation_every": 5, "predictions": [pred]})
    assert v.verdict.startswith("not run, at every validation (3 of 6 validations there")
    far = pd.concat([_val_run("w", "null", s, {0: 0.5, 10: 0.6 + 0.01 * s}) for s in range(3)])
    (v,) = judge_predictions(far, {**spec, "predictions": [pred]})
    assert v.verdict == "refuted, at every validation (0 of 1 confirmed, 1 refuted)"


def test_route_open_needs_the_next_validation_except_at_the_censor_step():
    rule = {"metric": "val/guess_rate_hard", "rise_above": 0.3, "from_step": 0}

    def run(values):
        steps = [0, 15, 30, 45, 60, 75][: len(values)]
        return _val_run("w", "mv", 0, dict(zip(steps, values)), metric="val/guess_rate_hard")

    # 30 exceeds (+0.35) but 45 does not (+0.25): not yet; 60 and 75 both exceed: opens at 60
    t = route_open_time(run([0.2, 0.25, 0.55, 0.45, 0.55, 0.6]), rule, censor=75)
    assert t == EventTime(60, 75)
    # exceeding only at the censor step: one validation suffices there
    assert route_open_time(run([0.2, 0.2, 0.2, 0.2, 0.2, 0.55]), rule, 75) == EventTime(75, 75)
    # exceeding at 60 but not at 75: censored at 75 ("> 75"); exactly +0.3 is not "more than"
    t = route_open_time(run([0.2, 0.2, 0.2, 0.2, 0.55, 0.5]), rule, 75)
    assert t == EventTime(None, 75) and occurred_by(t, 75) == 0.0
    # a run that stopped at 45 without the event: not known by 75
    t = route_open_time(run([0.2, 0.2, 0.2, 0.2]), rule, 75)
    assert t == EventTime(None, 45) and math.isnan(occurred_by(t, 75))
    summary = event_summary({"b0/s1": EventTime(60, 75), "b0/s2": t}, 75)
    assert summary["units"] == {"b0/s1": "60", "b0/s2": "> 45 (stopped)"}
    assert (summary["k"], summary["n"]) == (1, 1)  # the stopped run is left out


def test_the_detector_is_read_where_logged_and_replayed_with_the_given_thresholds():
    unique = {s: 3.0 for s in range(1, 21)} | {s: 1.2 for s in range(10, 21)}
    share = {s: 0.2 for s in range(1, 21)} | {s: 0.6 for s in range(10, 21)}
    run = _val_run("w", "mv", 0, {0: 0.5}, **{"answers/unique_per_prompt": unique,
                                              "answers/batch_mode_share": share})  # fmt: skip
    rule = {"max_unique_per_prompt": 1.5, "min_mode_share": 0.5, "patience": 3}
    assert detector_time(run, rule, censor=20) == EventTime(12, 20)  # steps 10, 11, 12
    assert detector_time(run, {**rule, "patience": 5}, 20) == EventTime(14, 20)
    assert detector_time(run, {**rule, "min_mode_share": 0.7}, 20) == EventTime(None, 20)
    assert detector_time(run, rule, censor=11) == EventTime(None, 11)  # after the censor step
    logged = run.assign(**{"collapse/detected_step": [None] * 5 + [5.0] + [None] * 15})
    assert detector_time(logged, rule, 20) == EventTime(5, 20)


def _v4_spec(**over):
    spec = {
        "start_step": 0, "final_steps": [20, 30], "train_window": 2,
        "predictions": [_pred(id="K1", measure="change", metric="val/acc", a="mv",
                              expect=[">", 0.05])],
        "events": {"censor_at": 30, "arms": ["mv"],
                   "route_open": {"metric": "val/acc", "rise_above": 0.3},
                   "detector": {"max_unique_per_prompt": 1.5, "min_mode_share": 0.5,
                                "patience": 3}},
        "event_predictions": [{"id": "K2", "world": "w", "event": "detector", "a": "mv",
                               "by_step": 30, "expect": ["<", 0.5]}],
        "holm_family": ["K1", "K2"], "holm_alpha_one_sided": 0.025, "sensitivity": "by_base",
    }  # fmt: skip
    return {**spec, **over}


def _six_units():
    """2 bases x 3 seeds of MV; base 0 gains 0.10-0.12, base 1 0.20-0.22 (no detector data:
    the runs log no answers, so the replay never fires)."""
    runs = []
    for world, gain in (("w", 0.10), ("w_base1", 0.20)):
        for seed, extra in enumerate([0.0, 0.01, 0.02]):
            g = gain + extra
            runs.append(_run(world, "mv", seed, [0.5, 0.5 + g, 0.5 + g]))
    return pd.concat(runs)


def test_event_predictions_holm_and_the_per_base_rows():
    verdicts = judge_predictions(_six_units(), _v4_spec())
    k1, k2 = verdicts
    assert (k2.measure, k2.metric, k2.mean, k2.verdict) == ("event", "detector", 0.0, "confirmed")
    assert k2.ci95 == pytest.approx((0.0, 0.4593), abs=1e-4)
    assert k2.p_one_sided == pytest.approx((1 / 64, 1.0))
    # K1's six changes (mean 0.16, SD 0.0555): t-test p far below K2's 1/64, so Holm at 0.025
    # rejects K1 at 0.025 / 2 and then K2 at 0.025 / 1
    assert k1.p_one_sided[0] < 0.0125 and k1.holm == "confirmed" and k2.holm == "confirmed"
    assert k2.holm_p == pytest.approx((1 / 64, 1.0))
    base = k1.by_base
    assert base["bases"]["w"]["mean"] == pytest.approx(0.11)
    assert base["bases"]["w_base1"]["mean"] == pytest.approx(0.21)
    assert base["estimate"] == pytest.approx(0.16) and base["dof"] == 4
    assert base["sides_differ"] is False  # both above 0.05
    (k1,) = judge_predictions(
        _six_units(), {**_v4_spec(), "predictions": [{**_v4_spec()["predictions"][0],
                                                      "expect": [">", 0.15]}]}
    )[:1]  # fmt: skip
    assert k1.by_base["sides_differ"] is True  # 0.11 below 0.15, 0.21 above
    # outside the family: no p, no Holm, no per-base rows
    (k1, _) = judge_predictions(_six_units(), _v4_spec(holm_family=["K2"]))
    assert (k1.p_one_sided, k1.holm, k1.by_base) == (None, None, None)


def _prereg_file(tmp_path, block):
    path = tmp_path / "PREREGISTRATION.md"
    path.write_text(f"```yaml\n{block}```\n")
    return path


@pytest.mark.parametrize(
    ("block", "named"),
    [
        ("holm_familly: [P]\n", "'holm_familly'"),
        ("predictions:\n  - {id: P, world: w, measure: change, metric: val/acc, a: x, "
         "expect: ['>', 0], at_every_validaton: true}\n", "prediction P: unknown key"),
        ("events: {censor_at: 9, arms: [], detector: {patiense: 3}}\n", "events.detector"),
        ("events: {censor_at: 9, arms: [], route_open: {metric: m, rise_above: 0.3, "
         "confirm: twice}}\n", "confirm must be next_validation"),
        ("events: {censor_at: 9, arms: []}\nevent_predictions:\n  - {id: E, world: w, "
         "event: detector, a: mv, by_step: 9, expect: ['<', 0.5], when: 3}\n",
         "event prediction E: unknown key 'when'"),
        ("events: {censor_at: 9, arms: []}\nevent_predictions:\n  - {id: E, world: w, "
         "event: detector, a: mv, by_step: 10, expect: ['<', 0.5]}\n", "by_step"),
        ("sensitivity: by_seed\n", "sensitivity"),
        ("holm_family: [Q]\n", "holm_family names no prediction: ['Q']"),
    ],
)  # fmt: skip
def test_unknown_or_malformed_keys_are_refused_by_name(tmp_path, block, named):
    base = "start_step: 0\nfinal_steps: [1]\n"
    if "predictions:" not in block.replace("event_predictions:", ""):
        base += ("predictions:\n  - {id: P, world: w, measure: change, metric: val/acc, a: x, "
                 "expect: ['>', 0]}\n")  # fmt: skip
    with pytest.raises(InputError, match=re.escape(named)):
        read_preregistration(_prereg_file(tmp_path, base + block))


def test_the_v4_block_parses_and_names_only_metrics_v3_runs_logged():
    """Open before the first run, item 7: v4's block parses with the extended reader, and
    every metric it names was logged by a committed v3 run (read through the loaders). The
    detector's `logged` column is logged only by a run that collapsed, which no v3 run did: its
    replay's inputs must exist instead."""
    from omgrpo.analysis.load import load_runs

    spec = read_preregistration(V4)
    ids = [p["id"] for p in [*spec["predictions"], *spec["event_predictions"]]]
    assert set(spec["holm_family"]) == {"K1", "K2", "K3", "K4", "K5"} <= set(ids)
    assert [p["id"] for p in spec["predictions"] if p.get("at_every_validation")] == ["C2"]
    assert set(ids) <= set(prediction_texts(V4))
    columns = set(load_runs(V3_RUNS / "toy_shortcut__mv__s7").columns)
    named = {p["metric"] for p in spec["predictions"]} | {spec["events"]["route_open"]["metric"]}
    assert named <= columns, named - columns
    assert spec["events"]["detector"]["logged"] == "collapse/detected_step"
    assert {"answers/unique_per_prompt", "answers/batch_mode_share"} <= columns
    arms = {p["a"] for p in spec["event_predictions"]} | set(spec["events"]["arms"])
    assert arms <= {r.name.split("__")[1] for r in V3_RUNS.iterdir()}  # v3's arms


def _write_run(root, world, method, seed, guess, acc, collapse_from=None):
    """A run folder (config.yaml + metrics.jsonl) with validations at 0, 10, 20, 30: `guess`
    and `acc` give val/guess_rate_hard and val/acc there; 30 training steps of 1.5 s each, whose
    answers collapse (1 answer per prompt, mode share 0.8) from `collapse_from` on."""
    import json

    import yaml

    name = f"{world}__{method}__s{seed}"
    run = root / name
    run.mkdir(parents=True)
    config = {"run": {"experiment": world, "variant": method, "name": name}, "seed": seed,
              "method": method}  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    rows = []
    for step in range(31):
        row = {"train/step": step}
        if step % 10 == 0:
            i = step // 10
            row |= {"val/guess_rate_hard": guess[i], "val/acc": acc[i]}
        if step:
            gone = collapse_from is not None and step >= collapse_from
            row |= {"answers/unique_per_prompt": 1.0 if gone else 3.0,
                    "answers/batch_mode_share": 0.8 if gone else 0.2, "perf/step_wall_s": 1.5}  # fmt: skip
        rows.append(json.dumps(row))
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 30}))


V4_LIKE = """| C2 | w | the null stays within 0.03 at every validation |
| K2 | w | the detector fires in fewer than half of the units |
| K1 | w | MV's guess rate rises by more than 0.3 |
| E1 | w | the route opens in more than half of the units |

```yaml
version: 4
date: 2026-11-27
start_step: 0
final_steps: [30]
train_window: 2
horizon: 30
validation_every: 10
stop_unless_confirmed: [C2]
holm_family: [K1, K2]
holm_alpha_one_sided: 0.025
sensitivity: by_base
predictions:
  - {id: C2, world: w, measure: change, metric: val/acc, a: null_arm, at_every_validation: true, expect: ["abs<", 0.03]}
  - {id: K1, world: w, measure: change, metric: val/guess_rate_hard, a: mv, expect: [">", 0.3]}
events:
  route_open: {metric: val/guess_rate_hard, rise_above: 0.3, from_step: 0, confirm: next_validation}
  detector: {logged: collapse/detected_step, replay: omgrpo.analysis.load.collapse_step, max_unique_per_prompt: 1.5, min_mode_share: 0.5, patience: 3}
  censor_at: 30
  arms: [mv, null_arm]
event_predictions:
  - {id: K2, world: w, event: detector, a: mv, by_step: 30, expect: ["<", 0.5]}
  - {id: E1, world: w, event: route_open, a: mv, by_step: 30, expect: [">", 0.5]}
```
"""


@pytest.mark.slow
def test_study_report_end_to_end_on_a_small_v4_like_study(tmp_path, capsys):
    """Two bases x 3 seeds of MV and a null: the report's Holm column, every-validation rows,
    time-to-event table, per-base rows, errata and run time; summary.json's wall time; an
    unknown key is refused with exit 2."""
    import json

    from omgrpo.cli import main

    runs = tmp_path / "runs"
    # MV: the route opens at 10 (b0/s0: +0.35, +0.40, ...), at 20 (s1) or only at the censor
    # step 30 (s2); base 1 rises less and never opens. One unit's detector fires at 22.
    guesses = {0: [0.2, 0.55, 0.6, 0.7], 1: [0.2, 0.3, 0.55, 0.6], 2: [0.2, 0.3, 0.4, 0.55]}
    for seed, guess in guesses.items():
        _write_run(runs, "w", "mv", seed, guess, [0.6] * 4, 20 if seed == 0 else None)
        _write_run(runs, "w_base1", "mv", seed, [0.2, 0.25, 0.3, 0.35 + 0.01 * seed], [0.6] * 4)
        for world in ("w", "w_base1"):
            acc = [0.6, 0.6 + 0.005 * seed, 0.6, 0.6 - 0.005 * seed]
            _write_run(runs, world, "null_arm", seed, [0.2] * 4, acc)
    prereg = tmp_path / "study" / "PREREGISTRATION.md"
    prereg.parent.mkdir()
    prereg.write_text(V4_LIKE)
    (prereg.parent / "ERRATA.md").write_text("# Errata\n\n## Wording\n\nA note.\n")
    out = tmp_path / "study"
    assert main(["study-report", str(runs), "--prereg", str(prereg), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| one-sided p (predicted / opposite) | Holm |" in text
    assert "| C2 | the null stays within 0.03 at every validation |" in text
    assert "confirmed, at every validation (3 of 3 confirmed, 0 refuted) | – | – |" in text
    k2 = next(line for line in text.splitlines() if line.startswith("| K2 |"))
    assert text.index("| K2 |") < text.index("| K1 |")  # the pre-registration's table order
    # 1 of 6 fired: CP (0.004, 0.641); p = P(X <= 1) = 7/64 and P(X >= 1) = 63/64; Holm over
    # {K1, K2}: K2's is the smaller predicted-side p, adjusted 2 x 7/64
    assert "| +0.167 | +0.004 to +0.641 | 6 | inconclusive | 0.109 / 0.984 |" in k2
    assert "| inconclusive (adjusted 0.219 / 0.984) |" in k2
    assert "### C2 at every validation" in text
    mv_route = next(line for line in text.splitlines() if line.startswith("| w | mv | route_open"))
    assert "b0/s0 10, b0/s1 20, b0/s2 30, b1/s0 > 30" in mv_route
    assert "| 3/6 | 0.12 to 0.88 | > 30 | 10 to > 30 (96.9%) |" in mv_route
    mv_detector = next(line for line in text.splitlines() if line.startswith("| w | mv | detector"))
    assert "b0/s0 22," in mv_detector and "| 1/6 |" in mv_detector
    assert "## Units nested in bases" in text and "3 RL seeds (0, 1, 2) on each of 2 bases" in text
    k1_base = next(line for line in text.splitlines() if line.startswith("| K1 | > 0.3 |"))
    assert "**bases differ**" in k1_base  # base 0 rises +0.38, base 1 +0.16
    assert "## Errata and reading notes" in text and "### Wording" in text
    assert "6 of 12 runs" not in text and "12 of 12 runs logged their per-step wall time" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["wall_time"]["total_s"] == pytest.approx(12 * 30 * 1.5)
    assert summary["wall_time"]["per_run"]["w__mv__s0"]["steps_wall_s"] == 45.0
    e1 = next(v for v in summary["verdicts"] if v["id"] == "E1")
    assert (e1["mean"], e1["verdict"]) == (0.5, "inconclusive")
    assert "p_one_sided" not in e1 and "holm" not in e1  # outside the family
    assert {r["event"] for r in summary["time_to_event"]} == {"route_open", "detector"}
    prereg.write_text(V4_LIKE.replace("sensitivity: by_base", "sensitivity: by_base\nholm: x"))
    capsys.readouterr()
    assert main(["study-report", str(runs), "--prereg", str(prereg), "--out", str(out)]) == 2
    assert "unknown key 'holm'" in capsys.readouterr().err


def test_a_runs_rows_are_the_plain_filters_rows_in_every_frame():
    """`_run` splits a frame into its runs once: each lookup gives exactly the rows the plain
    filter gives, a run not in the frame none, and a new frame its own rows (not the last)."""
    from omgrpo.analysis.study import _run

    def plain(df, e, s, m):
        return df[(df["experiment"] == e) & (df["seed"] == s) & (df["method"] == m)]

    one = pd.DataFrame({
        "experiment": ["w", "w", "w", "w_base1", "w"], "seed": [0, 0, 1, 0, 0],
        "method": ["mv", "mv", "mv", "mv", "gt"], "step": [0, 1, 0, 0, 0],
        "val/acc": [0.1, 0.2, 0.3, 0.4, 0.5],
    })  # fmt: skip
    two = one.assign(**{"val/acc": one["val/acc"] + 1})
    for df in (one, two, one):
        for e, s, m in [("w", 0, "mv"), ("w", 1, "mv"), ("w_base1", 0, "mv"), ("w", 0, "gt")]:
            pd.testing.assert_frame_equal(_run(df, e, s, m), plain(df, e, s, m))
        assert _run(df, "w", 2, "mv").empty and list(_run(df, "w", 2, "mv").columns) == list(df)
