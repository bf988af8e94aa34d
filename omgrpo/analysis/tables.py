"""The paper's tables from a `load_runs` frame: each function returns a `Table` (a DataFrame
`frame` with the numbers, and `markdown` for reports; notebooks render it as markdown).

- `val_acc_table`: final and peak validation accuracy per variant over seeds (the main results
  and ablation tables): mean ± 95% CI with >= 3 seeds, mean (min–max) with 2 (`SEEDS_NOTE`).
- `car_vs_n_val_table`: OM-GRPO with CAR vs direct sampling with n = 8 / 16 / 64 rollouts:
  accuracy, time per step and total time.
- `overhead_table`: mean seconds per step of every stage (`time/<stage>`) and peak memory
  (`mem/peak_gb`) per variant.

Like the figures they raise `MissingRunsError` (naming the presets to run) when the runs they
need are absent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from omgrpo.analysis.figures import (
    HINT_METHODS,
    HINT_N,
    MIN_SEEDS_FOR_CI,
    MissingRunsError,
    _car_on,
    _cfg,
    _has,
    _numeric,
    _with_labels,
)
from omgrpo.analysis.load import aggregate_seeds, run_roots

__all__ = [
    "TABLES",
    "TABLE_TITLES",
    "Table",
    "all_tables",
    "car_vs_n_val_table",
    "markdown_table",
    "overhead_table",
    "run_summary",
    "val_acc_table",
]


@dataclass
class Table:
    name: str
    title: str
    frame: pd.DataFrame
    markdown: str

    def _repr_markdown_(self) -> str:
        return f"**{self.title}**\n\n{self.markdown}"


def markdown_table(frame: pd.DataFrame, *, index: bool = False, floatfmt: str = ".3g") -> str:
    """A GitHub-flavoured markdown table (no `tabulate` needed)."""
    frame = frame.reset_index() if index else frame

    def cell(value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return ""
        if isinstance(value, float | np.floating):
            text = format(float(value), floatfmt)
        else:
            text = str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    head = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    return "\n".join(lines)


SEEDS_NOTE = (
    "\n\nmean ± 95% CI half-width (Student t) over seeds when there are ≥ 3 seeds; with 2 "
    "seeds the mean and, in parentheses, the range of the two (a 2-seed t-interval, t = 12.7, "
    "says nothing); with one seed its value. `seeds` is n."
)


def _summary(row: pd.Series, prefix: str, *, percent: bool = False, digits: int = 2) -> str:
    """One cell from a row with `seeds` and `{prefix}mean`, `ci95`, `min`, `max`: "mean ± ci"
    with >= 3 seeds, "mean (min–max)" with 2, "mean" with one."""
    mean = row[f"{prefix}mean"]
    if mean is None or pd.isna(mean):
        return ""
    k = 100.0 if percent else 1.0

    def num(column: str) -> str:
        return f"{row[prefix + column] * k:.{digits}f}"

    if row["seeds"] >= MIN_SEEDS_FOR_CI and pd.notna(row[f"{prefix}ci95"]):
        return f"{num('mean')} ± {num('ci95')}"
    if row["seeds"] >= 2:
        return f"{num('mean')} ({num('min')}–{num('max')})"
    return num("mean")


def _per_run(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per run: final (value at the last step that has it) and peak of `metric`."""
    data = df[["run", "step", metric]].copy()
    data[metric] = _numeric(data, metric)
    data = data.dropna(subset=[metric]).sort_values(["run", "step"])
    grouped = data.groupby("run", sort=True)[metric]
    return pd.DataFrame(
        {
            "final": grouped.last(),
            "peak": grouped.max(),
            "last_step": data.groupby("run")["step"].last(),
        }
    ).reset_index()


def run_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: identity, steps, final/peak val/acc, final unique answers per prompt
    and batch-mode share (NaN where a run did not log them)."""
    runs = df.drop_duplicates("run")[["run", "experiment", "variant", "method", "seed", "scale"]]
    steps = df.groupby("run")["step"].max().rename("steps")
    out = runs.merge(steps, on="run", how="left")
    for metric, cols in (
        ("val/acc", ("final val/acc", "peak val/acc")),
        ("answers/unique_per_prompt", ("final unique/prompt", None)),
        ("answers/batch_mode_share", ("final batch-mode share", None)),
    ):
        if metric in df.columns and _has(df, metric):
            per = _per_run(df, metric).set_index("run")
            out[cols[0]] = out["run"].map(per["final"])
            if cols[1]:
                out[cols[1]] = out["run"].map(per["peak"])
        else:
            out[cols[0]] = np.nan
            if cols[1]:
                out[cols[1]] = np.nan
    return out.reset_index(drop=True)


def val_acc_table(df: pd.DataFrame, metric: str = "val/acc") -> Table:
    """Final and peak `metric` per (scale, experiment, variant) over seeds, with n (`seeds`):
    mean ± 95% CI with >= 3 seeds, mean (min–max) with 2, the value with one."""
    if df is None or df.empty or not _has(df, metric):
        raise MissingRunsError(f"main table: no run logs {metric}; it needs {HINT_METHODS}")
    per = _per_run(df, metric)
    df = df.assign(root=run_roots(df))
    ident = df.drop_duplicates("run")[["run", "scale", "experiment", "variant", "method", "root"]]
    per = per.merge(ident, on="run")
    by = ["scale", "experiment", "variant", "root"]
    stats = ["mean", "ci95", "min", "max"]
    final = aggregate_seeds(per, "final", by=by).rename(columns={"n": "seeds"})
    peak = aggregate_seeds(per, "peak", by=by)
    frame = final[[*by, "seeds", *stats]].rename(columns={c: f"final_{c}" for c in stats})
    frame = frame.merge(peak[[*by, *stats]].rename(columns={c: f"peak_{c}" for c in stats}), on=by)
    method = ident.drop_duplicates(by).set_index(by)["method"]
    frame.insert(4, "method", [method.get(tuple(k), "") for k in frame[by].itertuples(index=False)])
    order = {"gt": 0, "om_grpo": 1, "mv": 2}
    frame = frame.sort_values(
        by=["scale", "experiment", "method", "variant"],
        key=lambda s: s.map(order).fillna(9) if s.name == "method" else s,
        kind="stable",
    ).reset_index(drop=True)
    percent = metric.startswith(("val/", "acc/"))
    unit = " (%)" if percent else ""
    show = pd.DataFrame(
        {
            "scale": frame["scale"],
            "experiment": frame["experiment"],
            "variant": [f"{r}: {v}" if r else v for r, v in zip(frame["root"], frame["variant"])],
            "method": frame["method"],
            "seeds": frame["seeds"],
            **{
                f"{which} {metric}{unit}": [
                    _summary(row, f"{which}_", percent=percent) for _, row in frame.iterrows()
                ]
                for which in ("final", "peak")
            },
        }
    )
    table = markdown_table(show) + SEEDS_NOTE
    return Table("main", f"Final and peak {metric} per variant", frame, table)


def _hms(seconds: float) -> str:
    if seconds is None or pd.isna(seconds):
        return ""
    s = round(float(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def car_vs_n_val_table(df: pd.DataFrame, metric: str = "val/acc") -> Table:
    """OM-GRPO with CAR vs without CAR at n = 8 / 16 / 64 rollouts per prompt: final `metric`
    (over seeds, as in `val_acc_table`), mean seconds per step, and total training time."""
    what = "CAR vs more rollouts"
    if df is None or df.empty:
        raise MissingRunsError(f"{what}: no runs loaded; it needs {HINT_N}")
    om = df[df["method"] == "om_grpo"].copy()
    if om.empty or not _has(om, metric) or not _has(om, "time/step"):
        raise MissingRunsError(
            f"{what}: no om_grpo run logs {metric} and time/step; it needs {HINT_N}"
        )
    n = pd.to_numeric(_cfg(om, "rollout.n"), errors="coerce")
    car = _car_on(om)
    om["config"] = [
        f"{'OM-GRPO' if c else 'w/o CAR'} (n={int(k) if pd.notna(k) else '?'})"
        for c, k in zip(car, n)
    ]
    if om["scale"].nunique() > 1:
        om["config"] = om["scale"].astype(str) + ": " + om["config"]
    om["car"], om["n"] = car.to_numpy(), n
    if om["config"].nunique() < 2:
        raise MissingRunsError(
            f"{what}: only one configuration ({om['config'].iloc[0]}); it needs {HINT_N}"
        )
    per = _per_run(om, metric)
    times = om.groupby("run").agg(
        step_s=("time/step", lambda s: pd.to_numeric(s, errors="coerce").mean()),
        total_s=("time/step", lambda s: pd.to_numeric(s, errors="coerce").sum()),
    )
    per = per.merge(times, left_on="run", right_index=True)
    ident = om.drop_duplicates("run")[["run", "config", "car", "n", "scale"]]
    per = per.merge(ident, on="run")
    acc = aggregate_seeds(per, "final", by=["config"])
    step_s = per.groupby("config")["step_s"].mean()
    total_s = per.groupby("config")["total_s"].mean()
    keys = per.drop_duplicates("config").set_index("config")
    frame = pd.DataFrame(
        {
            "config": acc["config"],
            "car": acc["config"].map(keys["car"]).astype(bool),
            "n": acc["config"].map(keys["n"]),
            "seeds": acc["n"],
            **{f"final_{metric}_{c}": acc[c] for c in ("mean", "ci95", "min", "max")},
            "time_per_step_s": acc["config"].map(step_s),
            "total_time_s": acc["config"].map(total_s),
        }
    )
    frame = frame.sort_values(["car", "n"], ascending=[False, True], kind="stable")
    frame = frame.reset_index(drop=True)
    percent = metric.startswith(("val/", "acc/"))
    show = pd.DataFrame(
        {
            "method": frame["config"],
            "seeds": frame["seeds"],
            f"final {metric}" + (" (%)" if percent else ""): [
                _summary(row, f"final_{metric}_", percent=percent) for _, row in frame.iterrows()
            ],
            "time/step (s)": [f"{v:.2f}" for v in frame["time_per_step_s"]],
            "total time": [_hms(v) for v in frame["total_time_s"]],
        }
    )
    return Table("car_vs_n", "CAR vs more rollouts", frame, markdown_table(show) + SEEDS_NOTE)


STAGES = {
    "gen": "Generation",
    "car": "CAR pair answers",
    "reward": "Reward",
    "old_logprob": "Old-policy log prob",
    "ref_logprob": "Reference-model log prob",
    "adv": "Advantage",
    "update": "Actor update",
}


def overhead_table(df: pd.DataFrame) -> Table:
    """Mean seconds per step of each stage (`time/<stage>`), their total (`time/step`) and
    peak memory (`mem/peak_gb`: max over steps and runs; mean over runs of each run's max)
    per variant (rows: components, columns: variants)."""
    what = "per-stage overhead"
    if df is None or df.empty or not _has(df, "time/step"):
        raise MissingRunsError(f"{what}: no run logs time/step; it needs {HINT_METHODS}")
    df = _with_labels(df)
    stage_cols = [c for c in df.columns if c.startswith("time/") and c != "time/step"]
    known = [f"time/{s}" for s in STAGES if f"time/{s}" in stage_cols]
    stage_cols = known + sorted(set(stage_cols) - set(known))
    rows: dict[str, dict[str, float]] = {}
    curves = list(dict.fromkeys(df["curve"]))
    for curve in curves:
        part = df[df["curve"] == curve]

        def mean_over_runs(col: str, part=part) -> float:
            per_run = part.groupby("run")[col].apply(
                lambda s: pd.to_numeric(s, errors="coerce").mean()
            )
            return float(per_run.mean()) if per_run.notna().any() else math.nan

        for col in stage_cols:
            name = STAGES.get(col[len("time/") :], col)
            rows.setdefault(f"{name} (s)", {})[curve] = mean_over_runs(col)
        rows.setdefault("Total per step (s)", {})[curve] = mean_over_runs("time/step")
        if _has(part, "mem/peak_gb"):
            peak = part.groupby("run")["mem/peak_gb"].apply(
                lambda s: pd.to_numeric(s, errors="coerce").max()
            )
            rows.setdefault("Max peak memory (GB)", {})[curve] = float(peak.max())
            rows.setdefault("Mean peak memory (GB)", {})[curve] = float(peak.mean())
        if _has(part, "perf/tokens_per_s"):
            rows.setdefault("Generation throughput (tokens/s)", {})[curve] = mean_over_runs(
                "perf/tokens_per_s"
            )
    frame = pd.DataFrame(rows).T[curves]
    frame = frame.dropna(how="all")
    frame.index.name = "component"
    show = frame.map(lambda v: "" if pd.isna(v) else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}")
    runs = df.groupby("curve")["run"].nunique()
    show.columns = [f"{curve} (n={runs[curve]})" for curve in show.columns]
    note = (
        "\n\nmemory: GPU peak allocated on GPUs, peak RSS of the process on the CPU; "
        "times are means over steps, then over the n seeds (runs) of each variant."
    )
    return Table("overhead", "Per-stage overhead", frame, markdown_table(show, index=True) + note)


TABLES: dict[str, Callable[[pd.DataFrame], Table]] = {
    "main": val_acc_table,
    "car_vs_n": car_vs_n_val_table,
    "overhead": overhead_table,
}


TABLE_TITLES = {
    "main": "Final and peak val/acc per variant (main results / ablations)",
    "car_vs_n": "CAR vs more rollouts (n = 8 / 16 / 64)",
    "overhead": "Per-stage overhead",
}


def all_tables(df: pd.DataFrame, only: Sequence[str] | None = None) -> dict[str, Table | str]:
    """Every table the runs allow: name -> Table, or name -> the MissingRunsError message."""
    out: dict[str, Table | str] = {}
    for name, fn in TABLES.items():
        if only and name not in only:
            continue
        try:
            out[name] = fn(df)
        except MissingRunsError as e:
            out[name] = str(e)
    return out
