"""A pre-registered study's predictions, marked confirmed / refuted / inconclusive from its runs.

The pre-registration (`reports/collapse-study/PREREGISTRATION.md`) ends in a fenced YAML block
that fixes each prediction before any run: the world (`run.experiment`), the measure, the
metric, the method(s) and the expected side of a threshold. This module reads that block and
the runs' frame (`omgrpo.analysis.load.load_runs`) and computes, per prediction, one value per
paired unit (world's base and seed), their mean and 95% t-interval, and the verdict:

- several units: *confirmed* if the interval lies on the predicted side of the threshold,
  *refuted* if it lies entirely on the other side, *inconclusive* otherwise;
- measure `opened` (a per-unit binary outcome: 1 where the change of `metric` under `a`
  exceeds `above`, else 0): the share of units with its exact (Clopper-Pearson) 95% interval,
  judged against the threshold the same way;
- one unit: the point estimate's side, marked `1 seed, no CI`;
- *not run* when a run it needs has no data.

A world's units are its runs' `(experiment, seed)`: the world's own base (`experiment` equal to
the world) and further bases named `<world>_base<k>`. `seeds:` restricts a prediction to the
world's own base and those seeds.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from omgrpo.analysis.figures import DRAW, MissingRunsError
from omgrpo.analysis.load import find_run_dirs, load_runs, t_critical
from omgrpo.analysis.mechanism import mechanism_section, mechanism_table
from omgrpo.analysis.report import base_checks, base_checks_section, what_happened
from omgrpo.tracking.store import RunStore

__all__ = ["Verdict", "judge_predictions", "read_preregistration", "verdict_table"]

MEASURES = ("change", "diff", "change_diff", "spearman", "opened")
OPS = (">", "<", "abs<")


@dataclass(frozen=True)
class Verdict:
    id: str
    world: str
    measure: str
    metric: str
    expect: str
    values: dict[str, float]  # unit ("experiment/s<seed>") -> value
    mean: float | None
    ci95: tuple[float, float] | None
    verdict: str  # confirmed | refuted | inconclusive | not run (+ ", 1 seed, no CI")


def read_preregistration(path: str | Path) -> dict[str, Any]:
    """The YAML block of a pre-registration file, checked (file and prediction named on error)."""
    path = Path(path)
    blocks = re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S)
    if not blocks:
        raise ValueError(f"{path}: no ```yaml block with the predictions")
    spec = yaml.safe_load(blocks[-1])
    for key in ("predictions", "final_steps", "start_step"):
        if key not in spec:
            raise ValueError(f"{path}: the predictions block has no '{key}'")
    for p in spec["predictions"]:
        name = p.get("id", "?")
        if p.get("measure") not in MEASURES:
            raise ValueError(f"{path}: {name}: measure must be one of {MEASURES}")
        op = p.get("expect", [None])[0]
        if op not in OPS or len(p["expect"]) != 2:
            raise ValueError(f"{path}: {name}: expect must be [op, threshold], op in {OPS}")
        needs = {"change": ["a"], "diff": ["a", "b"], "change_diff": ["a", "b"]}
        needs["spearman"] = ["methods", "x"]
        needs["opened"] = ["a", "above"]
        missing = [k for k in ["world", "metric", *needs[p["measure"]]] if k not in p]
        if missing:
            raise ValueError(f"{path}: {name}: missing {missing}")
    gates = spec.get("stop_unless_confirmed")
    ids = {p.get("id") for p in spec["predictions"]}
    unknown = [g for g in _as_list(gates) if g not in ids]
    if unknown:
        raise ValueError(f"{path}: stop_unless_confirmed names no prediction: {unknown}")
    return spec


def _as_list(value: Any) -> list:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def _final(run: pd.DataFrame, metric: str, spec: Mapping) -> float:
    """A run's final value of `metric`: the mean at the final validation steps, or for a
    training metric the mean over the last `train_window` steps."""
    values = pd.to_numeric(run.get(metric), errors="coerce") if metric in run else None
    if values is None:
        return math.nan
    if metric.startswith("val/"):
        rows = run["step"].isin(spec["final_steps"])
    else:
        last = max(spec["final_steps"])
        rows = (run["step"] > last - spec.get("train_window", 15)) & (run["step"] <= last)
    picked = values[rows].dropna()
    if metric.startswith("val/") and len(picked) < len(spec["final_steps"]):
        return math.nan  # a run that has not reached its final validations
    return float(picked.mean()) if len(picked) else math.nan


def _start(run: pd.DataFrame, metric: str, spec: Mapping) -> float:
    """The value at `start_step` (a prediction may set its own, e.g. 1 for the `mech/*`
    metrics, which are first measured at step 1)."""
    if metric not in run:
        return math.nan
    values = pd.to_numeric(run.loc[run["step"] == spec["start_step"], metric], errors="coerce")
    values = values.dropna()
    return float(values.iloc[0]) if len(values) else math.nan


def _world_pattern(world: str) -> str:
    """`run.experiment` of a world's runs: the world, or `<world>_base<k>` for further bases."""
    return re.escape(world) + r"(_base\d+)?"


def _units(df: pd.DataFrame, world: str, seeds: Sequence[int] | None) -> list[tuple[str, int]]:
    mine = df["experiment"].astype(str).str.fullmatch(_world_pattern(world))
    units = sorted({(str(e), int(s)) for e, s in df.loc[mine, ["experiment", "seed"]].values})
    if seeds is not None:
        units = [(e, s) for e, s in units if e == world and s in seeds]
    return units


def _run(df: pd.DataFrame, experiment: str, seed: int, method: str) -> pd.DataFrame:
    return df[(df["experiment"] == experiment) & (df["seed"] == seed) & (df["method"] == method)]


def _change(run: pd.DataFrame, metric: str, spec: Mapping) -> float:
    return _final(run, metric, spec) - _start(run, metric, spec)


def _unit_value(df: pd.DataFrame, p: Mapping, unit: tuple[str, int], spec: Mapping) -> float:
    experiment, seed = unit
    metric, measure = p["metric"], p["measure"]
    spec = {**spec, "start_step": p.get("start_step", spec["start_step"])}
    a = _run(df, experiment, seed, p.get("a", ""))
    if measure == "change":
        return _change(a, metric, spec)
    if measure == "opened":
        change = _change(a, metric, spec)
        return math.nan if math.isnan(change) else float(change > p["above"])
    if measure == "spearman":
        changes = [_change(_run(df, experiment, seed, m), metric, spec) for m in p["methods"]]
        if any(math.isnan(c) for c in changes):
            return math.nan
        return float(pd.Series(p["x"]).corr(pd.Series(changes), method="spearman"))
    other = p.get("world_b", experiment)
    b = _run(df, other, seed, p["b"])
    if measure == "diff":
        return _final(a, metric, spec) - _final(b, metric, spec)
    return _change(a, metric, spec) - _change(b, metric, spec)  # change_diff


def _decide(
    op: str, threshold: float, values: list[float], binary: bool = False
) -> tuple[float, tuple | None, str]:
    mean = float(np.mean(values))
    if binary:  # a share of units: the exact binomial interval (a t-interval on 0/1 is not)
        from scipy import stats

        ci = stats.binomtest(round(sum(values)), len(values)).proportion_ci(0.95, "exact")
        return mean, (ci.low, ci.high), _side(op, threshold, ci.low, ci.high)
    if len(values) == 1:
        holds = (
            abs(mean) < threshold
            if op == "abs<"
            else (mean > threshold if op == ">" else mean < threshold)
        )
        return mean, None, ("confirmed" if holds else "refuted") + ", 1 seed, no CI"
    half = t_critical(len(values) - 1) * float(np.std(values, ddof=1)) / math.sqrt(len(values))
    return mean, (mean - half, mean + half), _side(op, threshold, mean - half, mean + half)


def _side(op: str, threshold: float, lo: float, hi: float) -> str:
    """Where the interval [lo, hi] lies against the predicted side of the threshold."""
    if op == ">":
        verdict = "confirmed" if lo > threshold else "refuted" if hi < threshold else "inconclusive"
    elif op == "<":
        verdict = "confirmed" if hi < threshold else "refuted" if lo > threshold else "inconclusive"
    else:  # abs<: the whole interval within (-threshold, threshold), or entirely outside it
        inside = -threshold < lo and hi < threshold
        outside = lo > threshold or hi < -threshold
        verdict = "confirmed" if inside else "refuted" if outside else "inconclusive"
    return verdict


def judge_predictions(df: pd.DataFrame, spec: Mapping) -> list[Verdict]:
    """Every prediction of `spec` (`read_preregistration`) marked from the runs in `df`."""
    out = []
    for p in spec["predictions"]:
        units = _units(df, p["world"], p.get("seeds"))
        values = {f"{e}/s{s}": _unit_value(df, p, (e, s), spec) for e, s in units}
        finite = [v for v in values.values() if not math.isnan(v)]
        op, threshold = p["expect"]
        if finite:
            binary = p["measure"] == "opened"
            mean, ci, verdict = _decide(op, float(threshold), finite, binary)
        else:
            mean, ci, verdict = None, None, "not run"
        out.append(
            Verdict(
                id=p["id"],
                world=p["world"],
                measure=p["measure"],
                metric=p["metric"],
                expect=f"{op} {threshold}",
                values={k: round(v, 4) for k, v in values.items()},
                mean=None if mean is None else round(mean, 4),
                ci95=None if ci is None else (round(ci[0], 4), round(ci[1], 4)),
                verdict=verdict,
            )
        )
    return out


def verdict_table(verdicts: Sequence[Verdict], texts: Mapping[str, str] | None = None) -> str:
    """Markdown: one row per prediction (value, 95% CI, n, verdict)."""
    rows = [
        "| id | prediction | measured (mean) | 95% CI | n | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        what = (texts or {}).get(v.id) or f"{v.measure} of {v.metric} {v.expect}"
        ci = "–" if v.ci95 is None else f"{v.ci95[0]:+.3f} to {v.ci95[1]:+.3f}"
        mean = "–" if v.mean is None else f"{v.mean:+.3f}"
        n = sum(not math.isnan(x) for x in v.values.values())
        rows.append(f"| {v.id} | {what} | {mean} | {ci} | {n} | {v.verdict} |")
    return "\n".join(rows)


def prediction_texts(path: str | Path) -> dict[str, str]:
    """Prediction id -> its words, from the pre-registration's table rows `| P<n> | world |
    words |` (ids: capitals then digits, e.g. P3, C1, S12)."""
    rows = re.findall(
        r"^\| ([A-Z]+\d+) \| [^|]+ \| ([^|]+) \|$", Path(path).read_text(), flags=re.M
    )
    return {pid: text.strip() for pid, text in rows}


def as_json(verdicts: Sequence[Verdict]) -> list[dict]:
    return [asdict(v) for v in verdicts]


PROCESS_METRICS = (
    ("val/chain_acc_hard", "chain acc"),
    ("val/line_acc_hard", "line acc"),
    ("val/informativeness_hard", "informative"),
    ("val/support_hard", "support"),
    ("val/guess_prior_hard", "prior"),
    ("val/guess_truncated_hard", "truncated"),
    ("val/guess_copy_error_hard", "copy error"),
    ("val/guess_malformed_hard", "malformed"),
)


def process_quality_section(df: pd.DataFrame, spec: Mapping) -> list[str]:
    """The report's "Process quality" section: per world and method, the seed means of start ->
    final of the exact process grade and the guess kinds on hard problems (docs/metrics.md
    "Process quality"); empty when no run logs them (runs older than the metrics)."""
    names = [m for m, _ in PROCESS_METRICS if m in df.columns]
    if not names or df[names].isna().all().all():
        return []
    lines = [
        "## Process quality (hard problems, start → final, mean over seeds)",
        "",
        "| world | method | n | " + " | ".join(t for m, t in PROCESS_METRICS if m in names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for (world, method), runs in df.groupby(["experiment", "method"], sort=True):
        cells, n = [], runs["run"].nunique()
        for metric in names:
            pairs = [
                (_start(r, metric, spec), _final(r, metric, spec))
                for _, r in runs.groupby("run")
                if r[metric].notna().any()
            ]
            if not pairs:
                cells.append("–")
                continue
            start, final = np.nanmean([p[0] for p in pairs]), np.nanmean([p[1] for p in pairs])
            cells.append(f"{start:.2f} → {final:.2f}")
        lines.append(f"| {world} | {method} | {n} | " + " | ".join(cells) + " |")
    guide = (
        "chain acc: the reasoning is the problem's own chain; line acc: share of right lines; "
        "informative: lines applying the next operation; support: the box follows from the lines "
        "as written; prior / truncated / copy error / malformed: the kinds of guess (they add up "
        "to the hard guess rate)."
    )
    return [*lines, "", guide, ""]


def _state(run_dir: Path) -> str | None:
    try:
        return RunStore(run_dir).read_status().get("state")
    except (OSError, ValueError):
        return None


def _draw_figures(df: pd.DataFrame, spec: Mapping, folder: Path) -> list[str]:
    """Each predicted world's figures into `folder`; their file names."""
    figures = []
    for world in sorted({p["world"] for p in spec["predictions"]}):
        runs_of_world = df[df["experiment"].astype(str).str.fullmatch(_world_pattern(world))]
        for name in ("training_dynamics", "collapse_route", "token_roles"):
            try:
                fig = DRAW[name](runs_of_world)
            except MissingRunsError:
                continue  # e.g. no hard problems in the faithful world
            fig.savefig(folder / f"{world}__{name}.png", dpi=110)
            figures.append(f"{world}__{name}.png")
    return figures


def _warnings(interim_runs: Sequence[Path] | None, failed_gates: Sequence[Verdict]) -> list[str]:
    """The bold lines that say the verdicts are not to be interpreted: an incomplete grid
    (`interim_runs`: the run directories found) and the gates that were not confirmed."""
    lines = []
    if interim_runs is not None:
        finished = sum(_state(d) in ("finished", "collapsed") for d in interim_runs)
        lines += [
            f"**Interim report: the grid is not complete ({finished} of the {len(interim_runs)} "
            "runs found have finished). By the pre-registration these verdicts are not "
            "interpreted; they are printed to show the state of the study.**",
            "",
        ]
    if failed_gates:
        lines += [
            "**"
            + "; ".join(f"The control {g.id} is {g.verdict}" for g in failed_gates)
            + ": by the pre-registration the study stops here. The other verdicts are printed "
            "but not interpreted.**",
            "",
        ]
    return lines


def write_study_report(
    runs: Sequence[str | Path],
    prereg: str | Path,
    out: str | Path,
    *,
    command: str | None = None,
    seconds: float | None = None,
    interim: bool = False,
) -> Path:
    """`out`/report.md, summary.json and figures/<world>.png for a pre-registered study;
    `interim`: the grid is incomplete, and the report says its verdicts are not interpreted."""
    spec = read_preregistration(prereg)
    out = Path(out)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    run_dirs = find_run_dirs(*runs)
    df = load_runs(*runs)
    verdicts = judge_predictions(df, spec)
    by_id = {v.id: v for v in verdicts}
    gates = _as_list(spec.get("stop_unless_confirmed"))
    failed = [g for g in gates if not by_id[g].verdict.startswith("confirmed")]
    stopped = bool(failed)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    figures = _draw_figures(df, spec, out / "figures")
    checks = base_checks(run_dirs)
    lines = [
        f"# Collapse study: report (pre-registration version {spec.get('version')}, "
        f"{spec.get('date')})",
        "",
        f"Written by `{command or 'omgrpo study-report'}` at commit {commit or 'unknown'} on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        + (f"; wall time {seconds / 60:.1f} min." if seconds is not None else "."),
        f"{df['run'].nunique() if len(df) else 0} runs in {', '.join(map(str, runs))}.",
        "",
    ]
    lines += _warnings(run_dirs if interim else None, [by_id[g] for g in failed])
    lines += ["## Predictions", "", verdict_table(verdicts, prediction_texts(prereg)), ""]
    lines += what_happened(df)
    lines += process_quality_section(df, spec)
    lines += base_checks_section(checks)
    lines += mechanism_section(df)
    lines += ["## Figures", ""] + [f"![{f}](figures/{f})" for f in figures]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    summary = {
        "preregistration": str(prereg),
        "command": command,
        "commit": commit,
        "seconds": seconds,
        "interim": interim,
        "stopped_by_positive_control": stopped,
        "verdicts": as_json(verdicts),
        "base_checks": checks,
        "mechanism": mechanism_table(df).to_dict("records"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return out / "report.md"
