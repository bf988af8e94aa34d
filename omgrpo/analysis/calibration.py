"""The collapse study v2's calibration verdict (reports/collapse-study-v2/
CALIBRATION-PREREGISTRATION.md): per candidate setting, the controls' figures and the
pre-registered rule, from the runs' metrics only.

    python -m omgrpo.analysis.calibration RUNS --headroom HEADROOM_RUNS --checks CHECKS_JSON \
        --out reports/collapse-study-v2/calibration.md

RUNS holds the calibration runs (`calib_v2_<x>__{gt,mv_shuffled}__s<seed>`, full run directories
or their compact copies); HEADROOM_RUNS the step-0 replays that log `val/consistent_acc_hard`
(the same base and seed: validation has its own RNG stream, so the replay is exact; checked
against each run's own step 0). Only the controls are read: the rule never looks at another arm.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from omgrpo.analysis.load import load_runs, t_critical

NULL, GT = "mv_shuffled", "gt"
FINAL_STEPS = (120, 135, 150)
NULL_TOL = {"val/acc": 0.03, "val/acc_easy": 0.02}


def mean_ci(values: Sequence[float]) -> tuple[float, tuple[float, float] | None]:
    """Mean and 95% t-interval over seeds (None with fewer than 2 values)."""
    xs = np.asarray(values, dtype=float)
    if len(xs) < 2:
        return float(xs.mean()) if len(xs) else math.nan, None
    half = t_critical(len(xs) - 1) * xs.std(ddof=1) / math.sqrt(len(xs))
    return float(xs.mean()), (float(xs.mean() - half), float(xs.mean() + half))


def change(run: pd.DataFrame, metric: str) -> float:
    """final (mean of the validations at `FINAL_STEPS`) - start (step 0) of one run."""
    val = run.dropna(subset=[metric]).set_index("step")[metric]
    return float(val.reindex(FINAL_STEPS).mean() - val.loc[0])


def smoothed_drift(runs: Sequence[pd.DataFrame], metric: str) -> pd.Series:
    """Per validation step: the seed mean of metric(t) - metric(0), as a running mean over 3
    consecutive validations (the ends over the neighbours they have)."""
    drifts = []
    for run in runs:
        val = run.dropna(subset=[metric]).set_index("step")[metric]
        drifts.append(val - val.loc[0])
    mean = pd.concat(drifts, axis=1).mean(axis=1).sort_index()
    return mean.rolling(3, center=True, min_periods=2).mean()


@dataclass
class Candidate:
    name: str
    lr: float
    kl: float
    seeds: list[int]
    null_change: dict[str, tuple[float, tuple | None]] = field(default_factory=dict)
    null_worst: dict[str, float] = field(default_factory=dict)
    null_pass: bool | None = None
    gt_values: list[float] = field(default_factory=list)
    gt_change: tuple[float, tuple | None] = (math.nan, None)
    gt_pass: bool | None = None
    passed: bool | None = None
    note: str = ""


def judge(
    df: pd.DataFrame,
    names: Sequence[str],
    headroom: float,
    base_passed: bool,
    min_seeds: int = 2,
) -> list[Candidate]:
    """Each candidate's (`names`) figures and verdict under the rule (see the pre-registration).
    Only seeds whose GT and null runs both finished count, the same for every candidate (the
    seeds every candidate has); with fewer than `min_seeds` of them no criterion is decided
    (the figures are shown as one-seed observations)."""
    finished = df[df["status"] == "finished"]
    by = {
        name: {(m, int(s)): g.sort_values("step") for (m, s), g in part.groupby(["method", "seed"])}
        for name, part in finished.groupby("experiment")
    }
    common = None
    for name in names:
        runs = by.get(name, {})
        seeds = {s for m, s in runs if m == GT} & {s for m, s in runs if m == NULL}
        common = seeds if common is None else common & seeds
    common = sorted(common or [])
    out = []
    decided = len(common) >= min_seeds
    for name in names:
        rows = df[df["experiment"] == name]
        lr = float(rows["cfg.optim.lr"].iloc[0]) if len(rows) else math.nan
        kl = float(rows["cfg.algorithm.kl_coef"].iloc[0]) if len(rows) else math.nan
        c = Candidate(name, lr, kl, common)
        runs = by.get(name, {})
        if len(common) < min_seeds:
            c.note = f"seeds finished by every candidate: {common or 'none'} (< {min_seeds})"
        # undecided: every finished run is shown, as an observation
        use = common if decided else sorted({s for _, s in runs})
        nulls = [runs[(NULL, s)] for s in use if (NULL, s) in runs]
        gts = [runs[(GT, s)] for s in use if (GT, s) in runs]
        if nulls:
            for metric in NULL_TOL:
                c.null_change[metric] = mean_ci([change(r, metric) for r in nulls])
                c.null_worst[metric] = float(smoothed_drift(nulls, metric).abs().max())
            ok = all(c.null_worst[m] <= tol for m, tol in NULL_TOL.items())
            c.null_pass = ok if decided else None
        if gts:
            c.gt_values = [change(r, "val/acc_hard") for r in gts]
            c.gt_change = mean_ci(c.gt_values)
            ci = c.gt_change[1]
            ok = c.gt_change[0] >= headroom / 2 and ci is not None and ci[0] > 0
            c.gt_pass = ok if decided else None
        if decided:
            c.passed = bool(c.null_pass and c.gt_pass and base_passed)
        out.append(c)
    return out


def choose(candidates: Sequence[Candidate]) -> Candidate | None:
    """The passing candidate with the largest lr; ties: the larger GT change."""
    passing = [c for c in candidates if c.passed]
    return max(passing, key=lambda c: (c.lr, c.gt_change[0])) if passing else None


def headroom_of(replays: pd.DataFrame, runs: pd.DataFrame) -> tuple[float, list[dict]]:
    """h = hard guess rate x reasoned (consistent) accuracy on hard problems at step 0, per
    seed, and their mean; each replay's step 0 is checked against the runs' own step 0."""
    rows = []
    for seed, rep in replays[replays["step"] == 0].groupby("seed"):
        rep = rep.iloc[0]
        own = runs[(runs["seed"] == seed) & (runs["step"] == 0)]
        same = None  # no run of that seed to compare with
        if len(own):
            same = all(
                np.allclose(own[m].astype(float), float(rep[m]))
                for m in ("val/acc", "val/guess_rate_hard")
            )
        g, r = float(rep["val/guess_rate_hard"]), float(rep["val/consistent_acc_hard"])
        rows.append(
            {
                "seed": int(seed),
                "guess_rate_hard": g,
                "consistent_acc_hard": r,
                "acc_hard": float(rep["val/acc_hard"]),
                "chain_acc_hard": float(rep["val/chain_acc_hard"]),
                "headroom": g * r,
                "replay_matches_runs": same,
            }
        )
    return float(np.mean([r["headroom"] for r in rows])), rows


def _fmt(x: float, ci: tuple | None = None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:+.3f}" + (f" ({ci[0]:+.3f} to {ci[1]:+.3f})" if ci else "")


def run_table(df: pd.DataFrame) -> list[str]:
    """One line per run: status, last step, wall time, start → final of the controls' metrics."""
    lines = [
        "| run | status | steps | wall min | val/acc | val/acc_easy | val/acc_hard | "
        "hard guess rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run, r in df.groupby("run", sort=True):
        r = r.sort_values("step")
        wall = r["perf/step_wall_s"].sum() / 60 if "perf/step_wall_s" in r else math.nan
        cells = []
        for m in ("val/acc", "val/acc_easy", "val/acc_hard", "val/guess_rate_hard"):
            val = r.dropna(subset=[m]).set_index("step")[m]
            final = val.reindex(FINAL_STEPS).mean()
            if not len(val):
                cells.append("–")
            elif math.isnan(final):  # not there yet: the latest validation
                cells.append(f"{val.iloc[0]:.3f} → {val.iloc[-1]:.3f} (step {val.index[-1]})")
            else:
                cells.append(f"{val.iloc[0]:.3f} → {final:.3f}")
        lines.append(
            f"| `{run}` | {r['status'].iloc[0]} | {int(r['step'].max())} | {wall:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def candidate_table(cands: Sequence[Candidate], headroom: float) -> list[str]:
    lines = [
        "| candidate | lr | KL β | seeds | null Δ val/acc (95% CI) | null max smoothed drift "
        "val/acc / easy (tol 0.03 / 0.02) | null | GT Δ val/acc_hard per seed | GT Δ mean "
        f"(95% CI), needs ≥ {headroom / 2:.3f} and CI > 0 | GT | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    yes = {True: "pass", False: "fail", None: "–"}
    for c in cands:
        acc = c.null_change.get("val/acc", (math.nan, None))
        worst = " / ".join(f"{c.null_worst[m]:.3f}" for m in NULL_TOL) if c.null_worst else "–"
        per_seed = ", ".join(f"{v:+.3f}" for v in c.gt_values) or "–"
        verdict = yes[c.passed] if c.passed is not None else f"no verdict ({c.note})"
        lines.append(
            f"| {c.name} | {c.lr:g} | {c.kl:g} | {c.seeds} | {_fmt(*acc)} | {worst} | "
            f"{yes[c.null_pass]} | {per_seed} | {_fmt(*c.gt_change)} | {yes[c.gt_pass]} | {verdict} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories or folders of them")
    ap.add_argument("--candidates", nargs="+", default=["calib_v2_a", "calib_v2_b", "calib_v2_c"])
    ap.add_argument("--headroom", required=True, help="the step-0 replays' run folder")
    ap.add_argument("--checks", required=True, help="the base's checks.json")
    ap.add_argument("--out", required=True, help="a JSON summary is written beside it")
    args = ap.parse_args(argv)
    df = load_runs(*args.runs)
    checks = json.loads(Path(args.checks).read_text())
    replays = load_runs(args.headroom)
    # the verdict's seeds; undecided: the seeds of the finished GT runs
    seeds = judge(df, args.candidates, math.nan, True)[0].seeds or sorted(
        set(df[(df["method"] == GT) & (df["status"] == "finished")]["seed"])
    )
    h, rows = headroom_of(replays[replays["seed"].isin(seeds)], df)
    cands = judge(df, args.candidates, h, bool(checks["passed"]))
    chosen = choose(cands)
    summary = {
        "headroom": h,
        "headroom_by_seed": rows,
        "base_checks_passed": bool(checks["passed"]),
        "candidates": [c.__dict__ for c in cands],
        "chosen": chosen.name if chosen else None,
    }
    Path(args.out).with_suffix(".json").write_text(json.dumps(summary, indent=2, default=str))
    text = "\n".join(
        [
            *candidate_table(cands, h),
            "",
            *run_table(df),
        ]
    )
    Path(args.out).with_suffix(".tables.md").write_text(text + "\n")
    print(text)
    print(json.dumps({"headroom": h, "by_seed": rows, "chosen": summary["chosen"]}, indent=1))


if __name__ == "__main__":
    main()
