"""omgrpo.analysis: loading runs (store, MLflow), seed statistics, verdicts, every figure and
table, and the `omgrpo figures` / `omgrpo report` commands.

Figures are drawn from a synthetic frame built here (CAR metrics do not come from real runs
yet); loading and the report use the committed fixture `tests/fixtures/runs` (4 tiny real
runs: method=mv and method=om_grpo, seeds 0 and 1, made with `omgrpo train`).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from omgrpo.analysis import (
    FIGURES,
    MissingRunsError,
    NoRunsError,
    aggregate_seeds,
    all_figures,
    collapse_step,
    degradation,
    find_run_dirs,
    load_rollouts,
    load_runs,
    verdict,
)
from omgrpo.analysis import figures as F
from omgrpo.analysis import tables as T
from omgrpo.analysis.cli import figures_main
from omgrpo.analysis.load import run_roots, t_critical, unsanitize_metric_name
from omgrpo.cli import main as omgrpo_main
from omgrpo.tracking.store import RunStore

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "runs"
FIXTURE_RUNS = ["toy__mv__s0", "toy__mv__s1", "toy__om_grpo__s0", "toy__om_grpo__s1"]


# -- a synthetic frame with every column a figure or table reads -------------------------------
def with_prm_runs(df: pd.DataFrame) -> pd.DataFrame:
    """`df` and, for the PRM figure, a copy of its `w0.5` runs as method=prm runs logging the
    PRM's scores."""
    prm = df[df["variant"] == "w0.5"].copy()
    prm["variant"], prm["method"] = "prm", "prm"
    prm["run"] = prm["run"].str.replace("w0.5", "prm")
    prm["run_dir"] = prm["run_dir"].str.replace("w0.5", "prm")
    trained = prm["step"] > 0
    prm.loc[trained, "prm/aggregate_mean"] = 0.5 + 0.05 * prm.loc[trained, "step"]
    prm.loc[trained, "prm/step_score_mean"] = 0.7 + 0.03 * prm.loc[trained, "step"]
    prm["val/acc"] = 0.4 - 0.05 * prm["step"]
    return pd.concat([df, prm], ignore_index=True)


def synthetic_runs(steps: int = 5, seeds: tuple[int, ...] = (0, 1)) -> pd.DataFrame:
    """2 variants x `seeds` x `steps` steps: `om_grpo` (w = 0, CAR on, n = 8, strong toy base)
    and `w0.5` (w = 0.5, no CAR, n = 16, weak toy base); both method=om_grpo."""
    variants = {
        "om_grpo": {"w": 0.0, "car": True, "n": 8, "base": 600, "level": 0.5},
        "w0.5": {"w": 0.5, "car": False, "n": 16, "base": 150, "level": 0.3},
    }
    rng = np.random.default_rng(0)
    rows = []
    for variant, v in variants.items():
        for seed in seeds:
            for step in range(steps + 1):
                noise = lambda: float(rng.normal(0, 0.02))  # noqa: E731
                row = {
                    "run": f"syn__{variant}__s{seed}",
                    "run_dir": f"/nowhere/syn__{variant}__s{seed}",
                    "experiment": "syn",
                    "variant": variant,
                    "method": "om_grpo",
                    "seed": seed,
                    "scale": "toy",
                    "status": "finished",
                    "source": "store",
                    "cfg.algorithm.answer_weight": v["w"],
                    "cfg.algorithm.format_only": False,
                    "cfg.algorithm.kl_coef": 0.005,
                    "cfg.car.enable": v["car"],
                    "cfg.rollout.n": v["n"],
                    "cfg.model.warm_start.steps": v["base"],
                    "step": step,
                    "val/acc": v["level"] + 0.02 * step + noise(),
                    "recovery/zero_pass_prompts": 10.0,
                    "recovery/cum_pass": 0.1 * step + abs(noise()),
                    "recovery/cum_avg": 0.05 * step + abs(noise()),
                    "val/acc_easy": v["level"] + 0.2 + noise(),
                    "val/acc_hard": v["level"] - 0.2 + noise(),
                    "val/guess_rate_hard": 0.3 + 0.02 * step + abs(noise()),
                    "val/peak_share": 0.1 + 0.01 * step + abs(noise()),
                }
                if step > 0:
                    row |= {
                        "answers/unique_per_batch": 40 - 2 * step + noise(),
                        "answers/unique_per_prompt": 3 - 0.1 * step + noise(),
                        "answers/batch_mode_share": 0.1 + 0.01 * step + noise(),
                        "answers/top_vote_acc": 0.6 + noise(),
                        "acc/train": v["level"] + noise(),
                        "reward/total": 1.3 + 0.05 * step + noise(),
                        "loss/kl": 0.1 * step + abs(noise()),
                        "kl/answer": 0.001 * step + abs(noise()),
                        "kl/reasoning": 0.002 * step + abs(noise()),
                        "entropy/answer": 0.1 + noise(),
                        "entropy/reasoning": 0.3 + noise(),
                        "kl/result": 0.003 * step + abs(noise()),
                        "kl/format": 0.0005 * step + abs(noise()),
                        "kl/other": 0.002 * step + abs(noise()),
                        "answers/consistency": 0.9 - 0.01 * step + noise(),
                        "answers/wrong_majority": 0.3 + noise(),
                        # no noise(): the other columns keep their draws
                        "reward_quality/reward_acc": 0.7 - 0.01 * step + 0.01 * seed,
                        "reward_quality/majority_ratio": 0.5 + 0.02 * step,
                        "reward_quality/reward_correct_corr": 0.4 - 0.01 * seed,
                        "reward_quality/zero_spread_groups": 0.1 + 0.02 * step,
                        "time/gen": 1.0 + abs(noise()),
                        "time/reward": 0.1,
                        "time/update": 0.5,
                        "time/step": 1.6 + abs(noise()) + (0.5 if v["car"] else 0.0),
                        "mem/peak_gb": 1.0 + 0.01 * seed,
                    }
                    if v["car"]:
                        row |= {
                            "time/car": 0.5,
                            "car/top_vote_acc": 0.5 + noise(),
                            "car/position_bias": 0.6 - 0.02 * step + noise(),
                            "car/select_correct": 0.8 + noise(),
                            "car/incorrect_pair_first": 0.5 + noise(),
                            "car/anchor_entropy_correct": 0.1 + abs(noise()),
                            "car/anchor_entropy_incorrect": 0.9 + noise(),
                        }
                rows.append(row)
    return pd.DataFrame(rows)


def synthetic_rollouts(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for run, g in df.groupby("run"):
        first = g.iloc[0]
        for step in (1, 3):
            for p in range(2):
                for i in range(4):
                    rows.append(
                        {
                            "run": run,
                            "experiment": first["experiment"],
                            "variant": first["variant"],
                            "method": first["method"],
                            "seed": first["seed"],
                            "step": step,
                            "prompt_id": f"p{p}",
                            "rollout": i,
                            "answer": str(i % 2) if i < 3 else None,
                            "label": "0",
                            "correct": i % 2 == 0,
                        }
                    )
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def synth() -> pd.DataFrame:
    return synthetic_runs()


@pytest.fixture(scope="module")
def fixture_df() -> pd.DataFrame:
    return load_runs(FIXTURE)


# -- figures -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FIGURES))
@pytest.mark.slow
def test_every_figure_writes_png_and_pdf(name, synth, tmp_path):
    frame = with_prm_runs(synth) if name == "prm_baselines" else synth
    paths = FIGURES[name](frame, tmp_path, rollouts=synthetic_rollouts(frame))
    assert sorted(p.suffix for p in paths) == [".pdf", ".png"]
    for path in paths:
        assert path.parent == tmp_path and path.stem == name
        assert path.stat().st_size > 1000
    assert paths[0].read_bytes()[:4] in (b"\x89PNG", b"%PDF")


def test_save_png_keeps_the_pixels_in_a_palette(tmp_path):
    """The 256-colour PNG has matplotlib's pixel size and, for a plot of a few colours, exactly
    its pixels (a line plot has far fewer than 256 colours after anti-aliasing is quantised)."""
    from PIL import Image

    fig = F.Figure(figsize=(2, 1))
    fig.add_subplot().plot([0, 1], [0, 1], color="red")
    F.save_png(fig, tmp_path / "q.png", dpi=50)
    fig.savefig(tmp_path / "rgba.png", dpi=50)
    quantised, original = Image.open(tmp_path / "q.png"), Image.open(tmp_path / "rgba.png")
    assert quantised.mode == "P" and quantised.size == original.size == (100, 50)
    colours = original.convert("RGB").getcolors(maxcolors=256)
    assert colours is not None  # <= 256 colours: the palette can hold them all
    assert list(quantised.convert("RGB").getdata()) == list(original.convert("RGB").getdata())


@pytest.mark.slow
def test_rollout_bias_without_rollouts(synth):
    assert len(F.DRAW["rollout_bias"](synth).axes) == 3  # the per-prompt panel needs rollouts
    assert len(F.DRAW["rollout_bias"](synth, synthetic_rollouts(synth)).axes) == 4


@pytest.mark.parametrize(
    ("name", "drop", "preset"),
    [
        ("training_dynamics", ["val/acc"], "method=mv"),
        ("ten_epoch_dynamics", ["entropy/answer"], "trainer.epochs=10"),
        ("kl_answer_reasoning", ["kl/answer"], "method=om_grpo"),
        ("unique_answers", ["answers/unique_per_prompt"], "method=gt"),
        ("rollout_bias", ["acc/train"], "method=mv"),
        ("car_top_vote", ["car/top_vote_acc"], "car.enable=true"),
        ("car_mechanics", ["car/select_correct"], "car.enable=true"),
        ("failure_recovery", ["recovery/cum_pass"], "eval.every"),
        ("collapse_route", ["val/guess_rate_hard"], "experiment=toy_shortcut"),
        ("token_roles", ["kl/result"], "experiment=toy_shortcut"),
    ],
)
def test_missing_metrics_name_the_preset(name, drop, preset, synth, tmp_path):
    with pytest.raises(MissingRunsError, match=preset) as err:
        FIGURES[name](synth.drop(columns=drop), tmp_path)
    assert drop[0] in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_prm_figure_names_the_prm_presets(synth, tmp_path):
    with pytest.raises(MissingRunsError, match=r"prm/aggregate_mean.*method=prm"):
        FIGURES["prm_baselines"](synth, tmp_path)
    assert len(F.DRAW["prm_baselines"](with_prm_runs(synth)).axes) == 2


@pytest.mark.slow
def test_missing_runs_on_the_fixture(fixture_df, tmp_path):
    """The fixture has mv and om_grpo at w = 0 on one base, no CAR: these figures refuse."""
    with pytest.raises(MissingRunsError, match=r"algorithm\.answer_weight=0\.25"):
        F.answer_weight(fixture_df, tmp_path)
    with pytest.raises(MissingRunsError, match=r"model\.warm_start\.steps="):
        F.base_strength(fixture_df, tmp_path)
    with pytest.raises(MissingRunsError, match=r"method=om_grpo car\.enable=true"):
        F.car_mechanics(fixture_df, tmp_path)
    with pytest.raises(MissingRunsError, match="no runs loaded"):
        F.training_dynamics(fixture_df.iloc[0:0], tmp_path)
    only = ["training_dynamics", "car_mechanics"]
    out = all_figures(fixture_df, tmp_path / "figs", rollouts=load_rollouts(FIXTURE), only=only)
    assert list(out) == only
    assert isinstance(out["training_dynamics"], list)
    assert isinstance(out["car_mechanics"], str) and "car.enable=true" in out["car_mechanics"]
    drawn = {p.name for p in (tmp_path / "figs").iterdir()}
    assert "training_dynamics.png" in drawn and "car_mechanics.png" not in drawn


# -- tables ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tables(synth):
    main = T.val_acc_table(synth)
    assert list(main.frame["variant"]) == ["om_grpo", "w0.5"]
    assert (main.frame["seeds"] == 2).all()
    final = synth[synth["step"] == 5].groupby("variant")["val/acc"].mean()
    assert main.frame.set_index("variant")["final_mean"].to_dict() == pytest.approx(final.to_dict())
    assert "| om_grpo |" in main.markdown
    for row in main.markdown.splitlines()[2:4]:  # 2 seeds: mean and the seeds' range, no ±
        assert re.search(r"\| 2 \| \d+\.\d\d \(\d+\.\d\d–\d+\.\d\d\) \|", row), row
        assert "±" not in row

    car = T.car_vs_n_val_table(synth)
    assert list(car.frame["config"]) == ["OM-GRPO (n=8)", "w/o CAR (n=16)"]
    assert car.frame["time_per_step_s"].iloc[0] > car.frame["time_per_step_s"].iloc[1]
    assert "total time" in car.markdown

    over = T.overhead_table(synth)
    assert list(over.frame.columns) == ["om_grpo", "w0.5"]
    assert over.frame.loc["CAR pair answers (s)", "om_grpo"] == pytest.approx(0.5)
    assert math.isnan(over.frame.loc["CAR pair answers (s)", "w0.5"])
    assert over.frame.loc["Max peak memory (GB)", "om_grpo"] == pytest.approx(1.01)

    with pytest.raises(MissingRunsError, match=r"rollout\.n=16"):
        T.car_vs_n_val_table(synth[synth["variant"] == "om_grpo"])
    assert isinstance(T.all_tables(synth)["overhead"], T.Table)


# -- honest seed statistics (intervals over seeds) ------------------------------------------
def _spread(df: pd.DataFrame, metric: str, by_seed: dict[int, float]) -> pd.DataFrame:
    """`metric` of every row set to a per-seed constant, for bands of a known width."""
    out = df.copy()
    mask = out[metric].notna()
    out.loc[mask, metric] = out.loc[mask, "seed"].map(by_seed)
    return out


def _bands(ax) -> list:
    return [
        c
        for c in ax.collections
        if type(c).__name__ in ("PolyCollection", "FillBetweenPolyCollection")
    ]


def _legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_two_seeds_draw_each_seed_not_a_t_band():
    df = _spread(synthetic_runs(seeds=(0, 1)), "val/acc", {0: 0.1, 1: 0.9})
    df = _spread(df, "answers/unique_per_batch", {0: 0.0, 1: 1.0})
    acc, unique = F.draw_training_dynamics(df).axes
    # before: a 95% t-band (t = 12.7) from -4.6 to 5.6 around 0.5, y-limits unclipped
    assert not _bands(acc) and not _bands(unique)
    assert len(acc.lines) == 2 * 3  # per variant: the mean and one thin line per seed
    assert sorted({round(float(y), 6) for line in acc.lines for y in line.get_ydata()}) == [
        0.1,
        0.5,
        0.9,
    ]
    assert all(t.endswith("(mean of n=2; thin lines: seeds)") for t in _legend_texts(acc))
    lo, hi = acc.get_ylim()
    assert 0.0 <= lo < 0.1 and 0.9 < hi <= 1.0
    assert unique.get_ylim()[0] >= 0.0  # a count never goes below 0


def test_three_seeds_band_is_labelled_and_clipped_to_the_range():
    df = _spread(synthetic_runs(seeds=(0, 1, 2)), "val/acc", {0: 0.7, 1: 0.95, 2: 1.0})
    acc = F.draw_training_dynamics(df).axes[0]
    (band, _) = _bands(acc)  # one per variant
    ys = band.get_paths()[0].vertices[:, 1]
    # mean 0.883, 95% CI ± 0.401 (t = 4.30): the band would reach 1.28, clipped to 1
    std = float(np.std([0.7, 0.95, 1.0], ddof=1))
    assert 0.8833 - 4.302653 * std / math.sqrt(3) == pytest.approx(ys.min(), abs=1e-3)
    assert ys.max() == pytest.approx(1.0)
    assert all(t.endswith("(mean ± 95% CI, n=3)") for t in _legend_texts(acc))
    assert acc.get_ylim()[1] <= 1.0 and acc.get_ylim()[0] >= 0.0


def test_metric_ranges():
    assert F.metric_range("val/acc") == (0.0, 1.0)
    assert F.metric_range("val/pass@4") == (0.0, 1.0)
    assert F.metric_range("answers/batch_mode_share") == (0.0, 1.0)
    assert F.metric_range("answers/unique_per_batch") == (0.0, math.inf)
    assert F.metric_range("kl/answer") == (0.0, math.inf)
    assert F.metric_range("reward/total") == (-math.inf, math.inf)


def test_tables_print_n_and_a_ci_only_from_three_seeds():
    two = synthetic_runs(seeds=(0, 1))
    two = two.assign(**{"val/acc": two["seed"].map({0: 0.0, 1: 0.25})})
    main = T.val_acc_table(two)
    # before: "12.50 ± 158.83" (a 2-seed t-interval, t = 12.7)
    assert "| 2 | 12.50 (0.00–25.00) | 12.50 (0.00–25.00) |" in main.markdown
    assert "with 2 seeds the mean and, in parentheses, the range" in main.markdown
    three = synthetic_runs(seeds=(0, 1, 2))
    three = three.assign(**{"val/acc": three["seed"].map({0: 0.0, 1: 0.25, 2: 0.5})})
    # mean 25, std 25, t(2) = 4.303: 25 ± 62.10 (the CI is as wide as 3 seeds make it)
    assert "| 3 | 25.00 ± 62.10 | 25.00 ± 62.10 |" in T.val_acc_table(three).markdown
    over = T.overhead_table(two)
    assert "om_grpo (n=2)" in over.markdown and "w0.5 (n=2)" in over.markdown


# -- loading -----------------------------------------------------------------------------------
def test_load_runs_round_trips_the_store(fixture_df):
    assert sorted(fixture_df["run"].unique()) == FIXTURE_RUNS
    run_dir = FIXTURE / "toy__om_grpo__s1"
    part = fixture_df[fixture_df["run"] == "toy__om_grpo__s1"].reset_index(drop=True)
    store = RunStore(run_dir).read_metrics()
    assert part["step"].tolist() == store["train/step"].tolist()
    for col in store.columns.drop("train/step"):
        left, right = part[col], store[col]
        if pd.api.types.is_numeric_dtype(right):
            np.testing.assert_allclose(left.to_numpy(float), right.to_numpy(float), equal_nan=True)
        else:
            assert left.fillna("").astype(str).tolist() == right.fillna("").astype(str).tolist()
    first = part.iloc[0]
    config = RunStore(run_dir).read_config()
    assert first["method"] == "om_grpo" and first["variant"] == "om_grpo"
    assert first["seed"] == 1 and first["scale"] == "toy" and first["experiment"] == "toy"
    assert first["status"] == "finished" and first["run_dir"] == str(run_dir)
    assert first["cfg.algorithm.answer_weight"] == config["algorithm"]["answer_weight"] == 0.0
    assert first["cfg.reward.parts"] == '["soft_vote", "format"]'
    assert first["cfg.rollout.n"] == 4


def test_find_runs_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_runs(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoRunsError, match=str(tmp_path / "empty")):
        load_runs(tmp_path / "empty")
    assert find_run_dirs(FIXTURE / "toy__mv__s0", FIXTURE) == sorted(FIXTURE.iterdir())


def test_reruns_in_two_roots_are_not_averaged_as_seeds(tmp_path):
    for root in ("a", "b"):
        shutil.copytree(FIXTURE / "toy__mv__s0", tmp_path / root / "toy__mv__s0")
    df = load_runs(tmp_path)
    assert df["run"].nunique() == 2  # same name, two directories: kept apart
    assert sorted(run_roots(df).unique()) == ["a", "b"]
    table = T.val_acc_table(df).frame
    assert sorted(table["root"]) == ["a", "b"] and (table["seeds"] == 1).all()
    assert run_roots(load_runs(FIXTURE)).eq("").all()


def test_load_rollouts(fixture_df):
    rollouts = load_rollouts(FIXTURE)
    files = sorted(FIXTURE.glob("*/rollouts/step_*.parquet"))
    assert len(rollouts) == sum(len(pd.read_parquet(f)) for f in files)
    assert {"run", "variant", "method", "seed", "step", "answer", "correct"} <= set(rollouts)
    assert set(rollouts["run"]) == set(FIXTURE_RUNS)


@pytest.mark.slow
def test_load_runs_from_mlflow(tmp_path, monkeypatch):
    from omgrpo.tracking import MLflowTracker

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is relative to the cwd
    run_dir = tmp_path / "toy__mv__s0"
    shutil.copytree(FIXTURE / "toy__mv__s0", run_dir)
    store = RunStore(run_dir)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = MLflowTracker(uri=uri, background=False)
    tracker.start(run_dir, store.read_config(), name="toy__mv__s0", group="analysis", tags=[])
    metrics = store.read_metrics()
    for row in metrics.to_dict("records"):
        tracker.log_metrics(int(row["train/step"]), row)
    tracker.finish("finished")

    df = load_runs(mlflow_experiment="analysis", mlflow_uri=uri)
    assert df["run"].unique().tolist() == ["toy__mv__s0"]
    first = df.iloc[0]
    assert (first["method"], first["seed"], first["scale"], first["source"]) == (
        "mv",
        0,
        "toy",
        "mlflow",
    )
    assert first["status"] == "finished" and first["run_dir"] == str(run_dir.resolve())
    assert first["cfg.algorithm.answer_weight"] == 1.0
    assert first["cfg.reward.parts"] == '["majority_vote"]'
    assert "val/pass@2" in df.columns and "val/pass_at_2" not in df.columns
    assert df["step"].tolist() == metrics["train/step"].tolist()
    compared = 0
    for col in metrics.columns.drop("train/step"):
        if not pd.api.types.is_numeric_dtype(metrics[col]):
            continue  # strings (answers/batch_mode) are not MLflow metrics
        expect = metrics[col].to_numpy(float)
        got = df[col].to_numpy(float) if col in df else np.full(len(df), np.nan)
        np.testing.assert_allclose(got, expect, equal_nan=True, err_msg=col)
        compared += 1
    assert compared > 30
    # both sources together: the same run name is kept apart
    both = load_runs(run_dir, mlflow_experiment="analysis", mlflow_uri=uri)
    assert both["run"].nunique() == 2 and set(both["source"]) == {"store", "mlflow"}

    with pytest.raises(NoRunsError, match="'nope' not found"):
        load_runs(mlflow_experiment="nope", mlflow_uri=uri)


def _doc_fractions() -> set[str]:
    """The metric names of docs/metrics.md's rows whose unit is "fraction"."""
    names = set()
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 4 and cells[-2] == "fraction":
            names.update(re.findall(r"`([^`]+)`", cells[0]))
    return names


def test_the_fractions_checked_are_the_docs_fraction_rows():
    """`check_fractions` refuses a value out of [0, 1] in exactly the metrics docs/metrics.md
    calls fractions (a new fraction in the docs must be added to FRACTION_METRICS)."""
    from omgrpo.analysis.load import FRACTION_METRICS, LEGACY_TOP_VOTE_WITHOUT_CAR

    assert set(FRACTION_METRICS) - {LEGACY_TOP_VOTE_WITHOUT_CAR} == _doc_fractions()


def test_fractions_out_of_range_are_refused_and_other_metrics_are_not_checked(tmp_path):
    from omgrpo.analysis.load import fraction_kind
    from omgrpo.errors import InputError

    assert [fraction_kind(n) for n in ("val/acc", "val/acc_hard", "val/pass@16")] == [
        "accuracy"
    ] * 3
    assert fraction_kind("answers/guess_copy_error_easy") == "fraction"
    for name in ("loss/pg", "kl/answer", "answers/unique_per_prompt", "car/truncated", "val/"):
        assert fraction_kind(name) is None, name
    run = tmp_path / "r"
    store = RunStore(run)
    store.write_config({"run": {"name": "r"}})
    fine = {
        "answers/label_flip_rate": float("nan"),  # a share over no revisited prompt
        "acc/train": float("nan"),  # no labelled rollout
        "answer/frac": 1 + 1e-7,  # float32 rounding of a share
        "loss/pg": 1e308,
        "kl/answer": -3e-9,
        "answers/unique_per_prompt": 5.0,
        "val/acc": 1.0,
        "val/pass@4": 0,
    }
    store.log_metrics(1, fine)
    assert load_runs(run)["loss/pg"].iloc[0] == 1e308
    store.log_metrics(2, {"val/acc": float("nan")})
    with pytest.raises(InputError) as caught:
        load_runs(run)
    assert caught.value.file == str(run / "metrics.jsonl") and caught.value.key == "val/acc"
    assert str(caught.value).endswith("val/acc: step 2 (found nan; expected a fraction in [0, 1], "
                                      "never nan (an accuracy))")  # fmt: skip


def test_load_runs_from_wandb_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    from omgrpo.errors import InputError

    with pytest.raises(InputError, match="online W&B API") as caught:
        load_runs(wandb_project="someone/omgrpo")
    assert caught.value.key == "--wandb-project" and "'someone/omgrpo'" in str(caught.value)


def test_unsanitize_metric_name():
    assert unsanitize_metric_name("val/pass_at_4") == "val/pass@4"
    assert unsanitize_metric_name("val/pass_at_k") == "val/pass@k"
    assert unsanitize_metric_name("answers/batch_mode_share") == "answers/batch_mode_share"
    assert unsanitize_metric_name("custom/thing") == "custom/thing"


# -- statistics and verdicts -------------------------------------------------------------------
def test_aggregate_seeds_ci_by_hand():
    df = pd.DataFrame(
        {
            "experiment": ["e"] * 4,
            "variant": ["a", "a", "a", "b"],
            "step": [1, 1, 1, 1],
            "val/acc": [0.2, 0.4, 0.9, 0.7],
        }
    )
    out = aggregate_seeds(df, "val/acc").set_index("variant")
    # mean 0.5; std = sqrt((0.09 + 0.01 + 0.16) / 2); t_{0.975, 2} = 4.302653
    std = math.sqrt(0.13)
    assert out.loc["a", "mean"] == pytest.approx(0.5)
    assert out.loc["a", "std"] == pytest.approx(std)
    assert out.loc["a", "n"] == 3
    assert out.loc["a", "ci95"] == pytest.approx(4.302653 * std / math.sqrt(3), rel=1e-5)
    assert out.loc["b", "n"] == 1 and math.isnan(out.loc["b", "ci95"])
    assert math.isnan(out.loc["b", "std"])
    with pytest.raises(KeyError, match="nope"):
        aggregate_seeds(df, "nope")


def test_t_critical_is_scipys_student_t():
    # reference values of t_{0.975, df} from printed tables
    assert t_critical(2) == pytest.approx(4.303, abs=1e-3)
    assert t_critical(30) == pytest.approx(2.042, abs=1e-3)
    assert t_critical(60) == pytest.approx(2.000, abs=1e-3)
    assert t_critical(4, confidence=0.9) == pytest.approx(2.132, abs=1e-3)
    assert math.isnan(t_critical(0))


def run_frame(unique, share, **extra) -> pd.DataFrame:
    steps = range(1, len(unique) + 1)
    return pd.DataFrame(
        {
            "step": [0, *steps],
            "answers/unique_per_prompt": [np.nan, *unique],
            "answers/batch_mode_share": [np.nan, *share],
            **{k: [np.nan, *v] for k, v in extra.items()},
        }
    )


def test_verdict():
    collapsed = run_frame([3, 2, 1, 1.5, 1, 1], [0.2, 0.3, 0.6, 0.5, 0.8, 0.9])
    assert verdict(collapsed, {"state": "finished"}) == "collapsed at step 5"
    assert collapse_step(collapsed) == 5
    # one step out of the collapsed region resets the streak (patience 3)
    flicker = run_frame([1, 1, 3, 1, 1], [0.9, 0.9, 0.9, 0.9, 0.9])
    assert verdict(flicker, "finished") == "stable"
    stable = run_frame([3, 2.5, 3, 2.8], [0.1, 0.2, 0.1, 0.15])
    assert verdict(stable, {"state": "finished"}) == "stable"
    # the trainer's own detection wins
    logged = run_frame(
        [3, 1, 1, 1],
        [0.2, 0.9, 0.9, 0.9],
        **{"collapse/detected_step": [np.nan, 2, np.nan, np.nan]},
    )
    assert verdict(logged, None) == "collapsed at step 2"
    # the run's own thresholds
    strict = collapsed.assign(**{"cfg.collapse.patience": 2})
    assert verdict(strict) == "collapsed at step 4"
    failed = {"state": "failed", "step": 2, "failed_step": 3, "reason": "non-finite loss"}
    assert verdict(stable, failed) == "failed at step 3 (non-finite loss)"
    # without `failed_step`, `step` is the last step that completed, not the one that failed
    assert verdict(stable, {"state": "failed", "step": 2}) == "failed after step 2"
    assert verdict(pd.DataFrame({"step": [0, 1]}), None) == "stable"


def hack_frame(acc, reward) -> pd.DataFrame:
    """A run that never collapses (4 answers per prompt): `val/acc` at step 0 and every 2 steps
    (`acc`), `reward/total` at each training step (`reward`)."""
    n = len(reward)
    frame = run_frame([4.0] * n, [0.2] * n, **{"reward/total": reward})
    frame["val/acc"] = np.nan
    frame.loc[[2 * i for i in range(len(acc))], "val/acc"] = acc
    return frame


def test_reward_hacked_and_degraded_verdicts():
    # the PRM sweep's prm_mean: val/acc 0.715 -> 0.066; reward first 3 steps mean 0.55,
    # last 3 mean (0.6 + 0.61 + 0.59) / 3 = 0.6
    hacked = hack_frame([0.715, 0.703, 0.516, 0.066], [0.54, 0.56, 0.55, 0.58, 0.6, 0.61, 0.59])
    assert degradation(hacked) == (
        "reward hacked (val/acc 0.715 → 0.066 while reward/total 0.550 → 0.600)"
    )
    assert verdict(hacked, {"state": "finished"}) == degradation(hacked)
    # the same fall with a reward that fell: degraded, not hacked (first 3: 0.6, last 3: 0.5)
    fell = hack_frame([0.7, 0.5], [0.6, 0.6, 0.6, 0.5, 0.5, 0.5])
    assert verdict(fell) == "degraded (val/acc 0.700 → 0.500; reward/total 0.600 → 0.500)"
    # a flat reward did not rise: degraded
    flat = hack_frame([0.7, 0.5], [0.4, 0.4])
    assert verdict(flat) == "degraded (val/acc 0.700 → 0.500; reward/total 0.400 → 0.400)"
    # the threshold is strict: 0.70 -> 0.61 (0.09) and 0.70 -> 0.60 (0.10, not more) are stable
    assert verdict(hack_frame([0.7, 0.61], [0.1, 0.9])) == "stable"
    assert verdict(hack_frame([0.7, 0.6], [0.1, 0.9]), "finished") == "stable"
    assert degradation(hack_frame([0.7, 0.6], [0.1, 0.9]), drop=0.05).startswith("reward hacked")
    # accuracy that rose, or a single evaluation, is no degradation
    assert verdict(hack_frame([0.3, 0.9], [0.1, 0.9])) == "stable"
    assert verdict(hack_frame([0.7], [0.1, 0.9])) == "stable"
    # no reward logged: degraded, saying so
    no_reward = hack_frame([0.7, 0.2], [0.1, 0.9]).drop(columns="reward/total")
    assert verdict(no_reward) == "degraded (val/acc 0.700 → 0.200; reward/total not logged)"
    # a collapse or a failure wins over it
    collapsed = hack_frame([0.7, 0.2], [0.1, 0.9]).assign(
        **{"collapse/detected_step": [np.nan, 1, np.nan]}
    )
    assert verdict(collapsed) == "collapsed at step 1"
    assert verdict(hacked, {"state": "failed", "step": 6}) == "failed after step 6"


def test_verdict_on_the_fixture(fixture_df):
    for run, part in fixture_df.groupby("run"):
        text = verdict(part, RunStore(FIXTURE / run).read_status())
        if run.endswith("s0"):  # val/acc 0.25 -> 0.0 on 8 prompts, reward/total fell
            assert text.startswith("degraded (val/acc 0.250 → 0.000; reward/total "), text
        else:
            assert text == "stable" or text.startswith("collapsed at step "), text


# -- command line ------------------------------------------------------------------------------
@pytest.mark.slow
def test_figures_cli(tmp_path, capsys):
    out = tmp_path / "figs"
    assert figures_main([str(FIXTURE), "--out", str(out), "--only", "training_dynamics"]) == 0
    assert (out / "training_dynamics.png").stat().st_size > 1000
    assert (out / "training_dynamics.pdf").is_file()
    assert str(out) in capsys.readouterr().out

    # bad input: raised to `omgrpo.cli.main`, which prints it and exits 2
    assert omgrpo_main(["figures", str(tmp_path / "missing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "omgrpo figures: error:" in err and str(tmp_path / "missing") in err
    assert omgrpo_main(["figures", "--out", str(out)]) == 2
    assert figures_main([str(FIXTURE)]) == 2  # --out is required (argparse)
    assert omgrpo_main(["report", str(tmp_path / "missing"), "--out", str(out)]) == 2


@pytest.mark.slow
@pytest.mark.e2e
def test_report_command_names_every_run(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "omgrpo", "report", str(FIXTURE), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert str(out / "report.md") in proc.stdout
    # the fixture runs predate provenance records: the line says so
    assert f"{len(FIXTURE_RUNS)} run(s) · {len(FIXTURE_RUNS)} without provenance" in proc.stdout
    text = (out / "report.md").read_text()
    assert "## Provenance" in text
    for run in FIXTURE_RUNS:
        assert f"`{run}`" in text and f"<code>{run}</code>" in text
    assert "](figures/training_dynamics.png)" in text
    assert (out / "figures" / "training_dynamics.png").is_file()
    assert "Figures not drawn" in text and "car.enable=true" in text
    assert "Per-stage overhead" in text and "```yaml" in text
    assert text.count("stable") >= 4 or "collapsed at step" in text

    # summary.json: per-run numbers equal a plain read of each run's metrics.jsonl
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(r["run"] for r in summary["runs"]) == sorted(FIXTURE_RUNS)
    for entry in summary["runs"]:
        rows = [json.loads(line) for line in (FIXTURE / entry["run"] / "metrics.jsonl").open()]
        acc = [r["val/acc"] for r in rows if "val/acc" in r]
        train = [r for r in rows if "answers/unique_per_prompt" in r]
        assert entry["peak_val_acc"] == pytest.approx(max(acc), abs=1e-4)
        assert entry["final_val_acc"] == pytest.approx(acc[-1], abs=1e-4)
        last = train[-1]
        assert entry["final_unique_per_prompt"] == pytest.approx(
            last["answers/unique_per_prompt"], abs=1e-4
        )
        assert entry["final_batch_mode_share"] == pytest.approx(
            last["answers/batch_mode_share"], abs=1e-4
        )
        assert "collapse_step" in entry
        method = summary["methods"][entry["variant"]]
        assert entry["run"] in method["runs"] and entry["seed"] in method["seeds"]


def test_what_happened_says_how_each_run_moved():
    """One sentence per run, first → last validation value, best run first, with its verdict."""
    from omgrpo.analysis.report import trajectories, what_happened

    def run(name, method, acc, guess, unique, share):
        frame = run_frame(unique, share)
        frame.loc[[0, len(frame) - 1], "val/acc"] = acc
        frame.loc[[0, len(frame) - 1], "val/guess_rate_hard"] = guess
        ident = {"run": name, "experiment": "w", "variant": method, "method": method}
        return frame.assign(**ident, seed=0, scale="toy")

    df = pd.concat(
        [
            run("w__mv__s0", "mv", [0.68, 0.33], [0.22, 0.97], [3, 1, 1, 1], [0.2, 0.7, 0.8, 0.9]),
            run("w__gt__s0", "gt", [0.68, 0.69], [0.22, 0.0], [3, 3, 3, 3], [0.2, 0.2, 0.2, 0.2]),
        ],
        ignore_index=True,
    )
    assert trajectories(df[df["run"] == "w__mv__s0"]) == {
        "val/acc": {"start": 0.68, "final": 0.33},
        "val/guess_rate_hard": {"start": 0.22, "final": 0.97},
    }
    lines = [line for line in what_happened(df) if line.startswith("- ")]
    assert lines == [
        "- `w__gt__s0` (gt, seed 0, validation at step 0 → 4): accuracy 0.68 → 0.69; "
        "hard-problem guess rate 0.22 → 0.00; stable.",
        "- `w__mv__s0` (mv, seed 0, validation at step 0 → 4): accuracy 0.68 → 0.33; "
        "hard-problem guess rate 0.22 → 0.97; collapsed at step 4.",
    ]


def test_what_happened_and_the_summary_name_a_hacked_run():
    from omgrpo.analysis.report import report_summary, what_happened

    frame = hack_frame([0.715, 0.461], [0.3, 0.4])
    ident = {"run": "w__prm__s0", "experiment": "w", "variant": "prm", "method": "prm"}
    df = frame.assign(**ident, seed=0, scale="toy")
    (line,) = [line for line in what_happened(df) if line.startswith("- ")]
    assert line == (
        "- `w__prm__s0` (prm, seed 0, validation at step 0 → 2): accuracy 0.71 → 0.46; "
        "reward hacked (val/acc 0.715 → 0.461 while reward/total 0.300 → 0.400)."
    )
    (entry,) = report_summary(df)["runs"]
    assert entry["verdict"].startswith("reward hacked") and entry["collapse_step"] is None


@pytest.mark.parametrize(
    ("config", "column"),
    [
        ({"actor_rollout_ref": {"rollout": {"val_kwargs": {"n": 4}}}}, "val/pass@4"),
        ({"eval": {"k": 8}}, "val/pass@8"),
        ({}, "val/pass@k"),  # no k in the config: the old name stays
    ],
)
def test_old_runs_literal_pass_at_k_is_read_as_pass_at_their_k(tmp_path, config, column):
    """Older verl runs logged `val/pass@k` literally; both backends now log `val/pass@<k>`."""
    store = RunStore(tmp_path / "old_verl_run")
    store.write_config({"run": {"name": "old", "experiment": "paper"}, "seed": 0, **config})
    store.log_metrics(0, {"train/step": 0, "val/acc": 0.5, "val/pass@k": 0.75})
    store.log_metrics(1, {"train/step": 1, "reward/total": 1.0})
    df = load_runs(tmp_path)
    assert df[column].tolist()[0] == 0.75 and math.isnan(df[column].tolist()[1])
    assert [c for c in df.columns if c.startswith("val/pass")] == [column]


def test_old_car_runs_top_vote_columns_get_todays_names(tmp_path):
    """Older CAR runs logged the pool's vote as `answers/top_vote_acc` and the
    rollouts' as `car/top_vote_acc_without_car`; a step without CAR keeps its value."""
    store = RunStore(tmp_path / "old_car_run")
    store.write_config({"run": {"name": "old", "experiment": "toy"}, "seed": 0})
    old = {"answers/top_vote_acc": 0.25, "car/top_vote_acc_without_car": 0.75}
    store.log_metrics(1, {"train/step": 1, **old})
    store.log_metrics(2, {"train/step": 2, "answers/top_vote_acc": 0.5})
    df = load_runs(tmp_path)
    assert df["answers/top_vote_acc"].tolist() == [0.75, 0.5]
    assert df["car/top_vote_acc"].tolist()[0] == 0.25 and math.isnan(df["car/top_vote_acc"][1])
    assert "car/top_vote_acc_without_car" not in df.columns


def test_report_provenance_line_per_group_and_a_warning_on_mixed_commits(tmp_path):
    from omgrpo.analysis.provenance import ProvenanceWarning
    from omgrpo.analysis.report import provenance_section

    dirs = []
    for name, experiment, commit in [
        ("a", "e1", "1" * 40),
        ("b", "e1", "1" * 40),
        ("c", "e2", "2" * 40),
    ]:
        store = RunStore(tmp_path / name)
        store.write_config({"run": {"name": name, "experiment": experiment}})
        store.write_provenance(
            {"git_commit": commit, "git_dirty": name == "b", "versions": {"torch": "2.13.0"},
             "torch_build": "cpu", "device_type": "cpu", "device_count": 2, "device_names": ["x"]}
        )  # fmt: skip
        dirs.append(store.dir)
    with pytest.warns(ProvenanceWarning, match="2 different commits"):
        lines = provenance_section(dirs)
    e1 = next(x for x in lines if x.startswith("- e1:"))
    assert "2 run(s)" in e1 and "commit 1111111111 (1 dirty)" in e1 and "torch 2.13.0" in e1
    assert next(x for x in lines if x.startswith("- e2:")).count("2222222222") == 1
    assert any("WARNING: the runs compared come from 2 different commits" in x for x in lines)
