"""A measured early warning: for each signal a label-free run logs, how many steps before the
run's validation accuracy falls it alarms, and how often it alarms on runs whose accuracy did not
fall (docs/diagnostics.md, "Early warning").

    python -m omgrpo.analysis.warning RUNS... --out DIR [--calibrate SOURCES...]

writes DIR/warning.md and DIR/warning.json. RUNS are run directories or folders of them (full
runs or their compact copies); the runs under `--calibrate` choose each signal's threshold, the
others are judged with it. Every run is also judged leave-one-seed-out: thresholds chosen on the
runs of every other seed. The definitions below were fixed before any result was read.

**Fall.** A run's base is its `val/acc` at its first validation (step 0). It *falls* at the first
later validation step whose `val/acc` is below base − `FALL_MARGIN` (0.05, absolute; half the
verdict's `DEGRADE_DROP`, so a fall is seen before a run is called degraded) and whose next
validation is below it too (a fall at the last validation needs no confirmation). With validation
every V steps, the fall happened somewhere in the V steps before that validation.

**Alarm, a signal.** Each signal has a bad direction (`SIGNALS`: e.g. the flip rate up, unique
answers per prompt down). Its baseline is the median of its first `BASELINE_STEPS` (5) logged
training values (nan steps are skipped, as everywhere here); after them it alarms at the first
training step at which it has been beyond the baseline by at least δ in its bad direction for
`PATIENCE` (3) logged steps in a row.

**Alarm, the detector.** `omgrpo.core.diagnostics.CollapseDetector`'s rule replayed over
`answers/unique_per_prompt` and `answers/batch_mode_share` at given (max unique per prompt, min
mode share, patience), absolute levels, from step 1 (`DETECTOR_GRID`; the default first).

**Lead time** = fall step − alarm step (> 0: warned before the fall was seen). On a run that
fell, an alarm with lead ≥ 0 is a *hit*, a later one is *late*, none is a *miss*. On a run that
did not fall, any alarm is a *false alarm*; the false-alarm rate is alarmed / such runs.

**Choice.** On the calibration runs each candidate threshold scores hit rate − false-alarm rate;
ties go to the longer median lead of the hits, then to the earlier candidate (δ: largest first,
the most conservative; the detector: its default first, so the default stands on a tie). A
signal's candidate δs are `QUANTILES` of its positive bad-direction deviations on the calibration
runs. The detector's default changes only if the setting chosen on the calibration runs differs
from it and, on the judged runs, warns on at least as many falls with fewer false alarms, or on
more falls with no more false alarms (`detector_decision`). The signal that warns first
(`first_warning`): among the signals that warned on at least half of the judged falls with a
false-alarm rate of at most `FIRST_MAX_FALSE_ALARM`, the one with the longest median lead.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from omgrpo.core.diagnostics import COLLAPSE_DEFAULTS

FALL_MARGIN = 0.05
BASELINE_STEPS = 5
PATIENCE = 3
QUANTILES = tuple(float(q) for q in np.linspace(0.05, 0.995, 40))
FIRST_MAX_FALSE_ALARM = 0.2


@dataclass(frozen=True)
class Signal:
    column: str
    direction: int
    """+1: alarms when the signal rises; -1: when it falls."""
    uses_labels: bool = False


SIGNALS: tuple[Signal, ...] = (
    Signal("answers/label_flip_rate", +1),
    Signal("kl/answer", +1),
    Signal("kl/reasoning", +1),
    Signal("answers/batch_mode_share", +1),
    Signal("answers/unique_per_prompt", -1),
    Signal("answers/vote_entropy", -1),
    Signal("entropy/answer", -1),
    Signal("reward/total", +1),
    Signal("answers/top_vote_acc", -1, uses_labels=True),
    Signal("acc/train", -1, uses_labels=True),
    Signal("answers/confidently_wrong", +1, uses_labels=True),
)
"""The signals judged (those a run set does not log are left out), with their bad direction."""

DEFAULT_DETECTOR = (
    float(COLLAPSE_DEFAULTS["max_unique_per_prompt"]),
    float(COLLAPSE_DEFAULTS["min_mode_share"]),
    int(COLLAPSE_DEFAULTS["patience"]),
)
DETECTOR_GRID: tuple[tuple[float, float, int], ...] = (
    DEFAULT_DETECTOR,
    *(
        (u, s, p)
        for u in (1.25, 1.5, 2.0, 2.5, 3.0)
        for s in (0.3, 0.4, 0.5, 0.6, 0.7)
        for p in (1, 3, 5)
        if (u, s, p) != DEFAULT_DETECTOR
    ),
)
"""The detector settings tried (max unique per prompt, min mode share, patience), default first."""
DETECTOR = "detector"


@dataclass(frozen=True)
class History:
    """One run's logged series: training steps (≥ 1) and each signal on them, validations."""

    label: str
    seed: int | None
    steps: np.ndarray
    signals: Mapping[str, np.ndarray]
    val_steps: np.ndarray
    val_acc: np.ndarray


# -- one run ----------------------------------------------------------------------------------
def fall_step(
    val_steps: Sequence[int], val_acc: Sequence[float], margin: float = FALL_MARGIN
) -> int | None:
    """The validation step at which `val/acc` falls (module docstring), or None."""
    steps, acc = np.asarray(val_steps), np.asarray(val_acc, dtype=float)
    keep = ~np.isnan(acc)
    steps, acc = steps[keep], acc[keep]
    if len(acc) < 2:
        return None
    below = acc < acc[0] - margin
    for i in range(1, len(acc)):
        if below[i] and (i == len(acc) - 1 or below[i + 1]):
            return int(steps[i])
    return None


def deviation_floor(
    values: Sequence[float],
    direction: int,
    baseline_steps: int = BASELINE_STEPS,
    patience: int = PATIENCE,
) -> np.ndarray:
    """Per training step: the smallest bad-direction deviation from the baseline over the last
    `patience` logged values (nan on nan steps and until baseline and patience are filled).
    The signal alarms at threshold δ at the first step whose floor is ≥ δ."""
    x = np.asarray(values, dtype=float)
    out = np.full(len(x), np.nan)
    idx = np.flatnonzero(~np.isnan(x))
    if len(idx) < baseline_steps + patience:
        return out
    base = float(np.median(x[idx[:baseline_steps]]))
    dev = direction * (x[idx[baseline_steps:]] - base)
    windows = np.lib.stride_tricks.sliding_window_view(dev, patience).min(axis=1)
    out[idx[baseline_steps + patience - 1 :]] = windows
    return out


def first_alarms(steps: np.ndarray, floor: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """For each threshold, the first step whose floor reaches it (nan: never)."""
    with np.errstate(invalid="ignore"):
        reached = floor[None, :] >= np.asarray(thresholds, dtype=float)[:, None]
    any_ = reached.any(axis=1)
    first = np.asarray(steps, dtype=float)[reached.argmax(axis=1)] if len(steps) else any_ * 0.0
    return np.where(any_, first, np.nan)


def detector_alarm(
    steps: Sequence[int],
    unique: Sequence[float],
    share: Sequence[float],
    setting: tuple[float, float, int] = DEFAULT_DETECTOR,
) -> int | None:
    """The step `CollapseDetector(*setting)` fires at over these training steps (steps with a
    nan are skipped, as `omgrpo.analysis.load.collapse_step` does), or None."""
    max_unique, min_share, patience = setting
    streak = 0
    for step, u, s in zip(steps, unique, share):
        if math.isnan(u) or math.isnan(s):
            continue
        streak = streak + 1 if (u <= max_unique and s >= min_share) else 0
        if streak >= patience:
            return int(step)
    return None


def lead_time(alarm: float | None, fall: float | None) -> float | None:
    """fall − alarm in steps (None unless both exist)."""
    if alarm is None or fall is None or math.isnan(alarm) or math.isnan(fall):
        return None
    return float(fall - alarm)


# -- a set of runs ----------------------------------------------------------------------------
def run_label(run_dir: str | Path, run: str | None = None) -> str:
    """`<study>/<run>` for a run under a `runs` folder (`collapse-study-v3/toy__mv__s7`), else
    `<parent>/<run>`."""
    path = Path(run_dir)
    parent = path.parent.parent if path.parent.name == "runs" else path.parent
    return f"{parent.name}/{run or path.name}"


def histories(df: pd.DataFrame) -> list[History]:
    """One `History` per run of a `omgrpo.analysis.load.load_runs` frame, sorted by label."""
    out = []
    for run_dir, g in df.groupby("run_dir", sort=False):
        g = g.sort_values("step")
        train = g[g["step"] >= 1]
        signals = {
            s.column: pd.to_numeric(train[s.column], errors="coerce").to_numpy(float)
            for s in SIGNALS
            if s.column in g.columns
        }
        for col in ("answers/unique_per_prompt", "answers/batch_mode_share"):
            if col in g.columns:
                signals[col] = pd.to_numeric(train[col], errors="coerce").to_numpy(float)
        acc = pd.to_numeric(g["val/acc"], errors="coerce") if "val/acc" in g else g["step"] * np.nan
        seed = g["seed"].iloc[0] if "seed" in g.columns else None
        out.append(
            History(
                label=run_label(str(run_dir), str(g["run"].iloc[0]) if "run" in g else None),
                seed=None if seed is None or pd.isna(seed) else int(seed),
                steps=train["step"].to_numpy(int),
                signals=signals,
                val_steps=g.loc[acc.notna(), "step"].to_numpy(int),
                val_acc=acc[acc.notna()].to_numpy(float),
            )
        )
    return sorted(out, key=lambda h: h.label)


def falls_of(runs: Sequence[History], margin: float = FALL_MARGIN) -> np.ndarray:
    """Each run's fall step (nan: did not fall)."""
    found = [fall_step(h.val_steps, h.val_acc, margin) for h in runs]
    return np.array([np.nan if f is None else f for f in found], dtype=float)


def detector_alarms(runs: Sequence[History], grid: Sequence[tuple] = DETECTOR_GRID) -> np.ndarray:
    """(runs × settings) alarm steps of the detector (nan: never; also without its inputs)."""
    out = np.full((len(runs), len(grid)), np.nan)
    for i, h in enumerate(runs):
        unique = h.signals.get("answers/unique_per_prompt")
        share = h.signals.get("answers/batch_mode_share")
        if unique is None or share is None:
            continue
        for j, setting in enumerate(grid):
            step = detector_alarm(h.steps, unique, share, setting)
            out[i, j] = np.nan if step is None else step
    return out


def signal_floors(runs: Sequence[History], signal: Signal) -> list[np.ndarray | None]:
    """Each run's `deviation_floor` of the signal (None where the run does not log it)."""
    return [
        deviation_floor(h.signals[signal.column], signal.direction)
        if signal.column in h.signals
        else None
        for h in runs
    ]


def candidate_thresholds(floors: Sequence[np.ndarray | None], rows: Sequence[int]) -> np.ndarray:
    """`QUANTILES` of the positive floors of the runs in `rows`, largest first (unique)."""
    keep = {int(i) for i in rows}
    values = [f[~np.isnan(f)] for i, f in enumerate(floors) if i in keep and f is not None]
    pooled = np.concatenate(values) if values else np.array([])
    pooled = pooled[pooled > 0]
    if not len(pooled):
        return np.array([np.inf])
    return np.unique(np.quantile(pooled, QUANTILES))[::-1]


def signal_alarms(
    runs: Sequence[History], floors: Sequence[np.ndarray | None], thresholds: np.ndarray
) -> np.ndarray:
    """(runs × thresholds) first alarm steps (nan: never)."""
    out = np.full((len(runs), len(thresholds)), np.nan)
    for i, (h, floor) in enumerate(zip(runs, floors)):
        if floor is not None:
            out[i] = first_alarms(h.steps, floor, thresholds)
    return out


# -- scoring and choosing ---------------------------------------------------------------------
def outcome(alarms: np.ndarray, falls: np.ndarray) -> tuple[float, float, float]:
    """(hit rate, false-alarm rate, median lead of the hits; -inf without a hit) of one alarm
    step per run (nan: no alarm) against the runs' fall steps (nan: no fall)."""
    fell = ~np.isnan(falls)
    with np.errstate(invalid="ignore"):
        hit = fell & (falls - alarms >= 0)
    false = ~fell & ~np.isnan(alarms)
    hit_rate = hit.sum() / fell.sum() if fell.any() else 0.0
    false_rate = false.sum() / (~fell).sum() if (~fell).any() else 0.0
    lead = float(np.median((falls - alarms)[hit])) if hit.any() else -math.inf
    return float(hit_rate), float(false_rate), lead


def choose(alarms: np.ndarray, falls: np.ndarray) -> int:
    """The column of `alarms` (runs × candidates) with the best hit rate − false-alarm rate,
    ties to the longer median lead, then to the earlier column."""
    best, best_key = 0, None
    for j in range(alarms.shape[1]):
        hit_rate, false_rate, lead = outcome(alarms[:, j], falls)
        key = (round(hit_rate - false_rate, 12), lead)
        if best_key is None or key > best_key:
            best, best_key = j, key
    return best


def summarize(labels: Sequence[str], alarms: np.ndarray, falls: np.ndarray) -> dict[str, Any]:
    """Named results of one alarm step per run: each fallen run's fall, alarm and lead, the
    false alarms, counts and rates."""
    fell = [
        {"run": name, "fall": int(f), "alarm": None if np.isnan(a) else int(a),
         "lead": lead_time(a, f)}
        for name, a, f in zip(labels, alarms, falls)
        if not np.isnan(f)
    ]  # fmt: skip
    false = {
        name: int(a) for name, a, f in zip(labels, alarms, falls) if np.isnan(f) and not np.isnan(a)
    }
    _, false_rate, lead = outcome(np.asarray(alarms, float), np.asarray(falls, float))
    return {
        "fell": fell,
        "warned": sum(1 for r in fell if r["lead"] is not None and r["lead"] >= 0),
        "n_fell": len(fell),
        "false_alarms": false,
        "n_not_fell": int(np.isnan(falls).sum()),
        "false_alarm_rate": false_rate if np.isnan(falls).any() else None,
        "median_lead": None if lead == -math.inf else lead,
    }


Candidates = Callable[[np.ndarray], tuple[list, np.ndarray]]
"""rows → (candidate thresholds made from those runs, every run × candidate alarm steps)."""


def assess(
    labels: Sequence[str],
    seeds: Sequence[Any],
    falls: np.ndarray,
    candidates: Candidates,
    calibrate: np.ndarray | None,
) -> dict[str, Any]:
    """One signal's results: with a calibration mask, the threshold chosen on those runs and
    the named results on them (in-sample) and on the others (judged); always, each run judged
    with the threshold chosen on the runs of every other seed (`leave_one_seed_out`).
    `candidates(rows)` gives the candidate thresholds made from those rows and the alarm steps
    of every run at each."""
    names, seeds = np.asarray(labels, dtype=object), np.asarray([str(s) for s in seeds])
    out: dict[str, Any] = {}
    if calibrate is not None and calibrate.any():
        values, matrix = candidates(np.flatnonzero(calibrate))
        j = choose(matrix[calibrate], falls[calibrate])
        out["threshold"] = _jsonable(values[j])
        out["calibration"] = summarize(names[calibrate], matrix[calibrate, j], falls[calibrate])
        judged = ~calibrate
        out["judged"] = summarize(names[judged], matrix[judged, j], falls[judged])
    held, chosen = np.full(len(names), np.nan), {}
    for seed in sorted(set(seeds)):
        test = seeds == seed
        if test.all():
            continue
        values, matrix = candidates(np.flatnonzero(~test))
        j = choose(matrix[~test], falls[~test])
        held[test] = matrix[test, j]
        chosen[seed] = _jsonable(values[j])
    out["leave_one_seed_out"] = {**summarize(names, held, falls), "thresholds": chosen}
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float | np.floating):
        return None if not np.isfinite(value) else round(float(value), 6)
    return value


def detector_name(setting: Sequence[float]) -> str:
    return "detector ({:g} / {:g} / {:d})".format(*setting)


def early_warning(runs: Sequence[History], calibrate: Sequence[str] | None = None) -> dict:
    """The whole table (module docstring) for `runs`; `calibrate`: the labels of the runs that
    choose the thresholds (None: leave-one-seed-out only)."""
    labels = [h.label for h in runs]
    seeds = [h.seed for h in runs]
    falls = falls_of(runs)
    mask = None if calibrate is None else np.array([name in set(calibrate) for name in labels])
    det = detector_alarms(runs)
    results: dict[str, Any] = {
        detector_name(DEFAULT_DETECTOR): {
            "fixed": True,
            **assess(labels, seeds, falls, lambda rows: ([DEFAULT_DETECTOR], det[:, :1]), mask),
        },
        DETECTOR: assess(labels, seeds, falls, lambda rows: (list(DETECTOR_GRID), det), mask),
    }
    for signal in SIGNALS:
        if not any(signal.column in h.signals for h in runs):
            continue
        floors = signal_floors(runs, signal)

        def candidates(rows: np.ndarray, floors: list = floors) -> tuple[list, np.ndarray]:
            thresholds = candidate_thresholds(floors, rows)
            return list(thresholds), signal_alarms(runs, floors, thresholds)

        results[signal.column] = {
            "direction": "up" if signal.direction > 0 else "down",
            "uses_labels": signal.uses_labels,
            **assess(labels, seeds, falls, candidates, mask),
        }
    basis = "judged" if mask is not None and (~mask).any() else "leave_one_seed_out"
    return {
        "definitions": definitions(),
        "runs": _run_rows(runs, falls, mask),
        "basis": basis,
        "signals": results,
        "detector_decision": detector_decision(results, basis),
        "warns_first": {
            b: {"any": first_warning(results, b), "label_free": first_warning(results, b, True)}
            for b in ("judged", "leave_one_seed_out")
        },
    }


def definitions() -> dict[str, Any]:
    return {
        "fall_margin": FALL_MARGIN,
        "baseline_steps": BASELINE_STEPS,
        "patience": PATIENCE,
        "quantiles": [round(q, 4) for q in QUANTILES],
        "detector_default": list(DEFAULT_DETECTOR),
        "detector_grid": [list(s) for s in DETECTOR_GRID],
        "first_max_false_alarm": FIRST_MAX_FALSE_ALARM,
    }


def _run_rows(runs: Sequence[History], falls: np.ndarray, mask: np.ndarray | None) -> list:
    rows = []
    for i, h in enumerate(runs):
        acc = dict(zip(h.val_steps.tolist(), h.val_acc.tolist()))
        fall = None if np.isnan(falls[i]) else int(falls[i])
        rows.append(
            {
                "run": h.label,
                "seed": h.seed,
                "set": None if mask is None else ("calibration" if mask[i] else "judged"),
                "base_acc": h.val_acc[0].item() if len(h.val_acc) else None,
                "final_acc": h.val_acc[-1].item() if len(h.val_acc) else None,
                "fall": fall,
                "acc_at_fall": acc.get(fall),
            }
        )
    return rows


def detector_decision(results: Mapping[str, Any], basis: str) -> dict[str, Any]:
    """Whether the detector's default should change (the rule in the module docstring), on
    `basis` (`judged` or `leave_one_seed_out`)."""
    default = results[detector_name(DEFAULT_DETECTOR)][basis]
    chosen = results[DETECTOR]
    if basis == "judged":
        proposed = tuple(chosen["threshold"])
    else:  # the setting most folds chose
        picks = [tuple(t) for t in chosen[basis]["thresholds"].values()]
        proposed = max(set(picks), key=picks.count) if picks else DEFAULT_DETECTOR
    new = chosen[basis]
    fa_new, fa_old = new["false_alarm_rate"] or 0.0, default["false_alarm_rate"] or 0.0
    better = (new["warned"] >= default["warned"] and fa_new < fa_old) or (
        new["warned"] > default["warned"] and fa_new <= fa_old
    )
    change = proposed != DEFAULT_DETECTOR and better
    return {
        "basis": basis,
        "default": list(DEFAULT_DETECTOR),
        "chosen": list(proposed),
        "default_result": {"warned": default["warned"], "false_alarm_rate": fa_old},
        "chosen_result": {"warned": new["warned"], "false_alarm_rate": fa_new},
        "n_fell": new["n_fell"],
        "change": bool(change),
    }


def first_warning(results: Mapping[str, Any], basis: str, label_free: bool = False) -> str | None:
    """The signal that warns first on `basis` (module docstring), or None; `label_free`: among
    the signals that read no label only."""
    best, best_lead = None, -math.inf
    for name, res in results.items():
        summary = res.get(basis)
        if label_free and res.get("uses_labels"):
            continue
        if not summary or not summary["n_fell"]:
            continue
        rate = summary["false_alarm_rate"] or 0.0
        lead = summary["median_lead"]
        ok = summary["warned"] >= summary["n_fell"] / 2 and rate <= FIRST_MAX_FALSE_ALARM
        if ok and lead is not None and lead > best_lead:
            best, best_lead = name, lead
    return best


# -- the report -------------------------------------------------------------------------------
MAX_NAMED = 8
"""Markdown names at most this many false alarms per cell (warning.json names them all)."""


def _short(label: str) -> str:
    return label.replace("collapse-study-", "")


def _threshold_text(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, list):
        return " / ".join(f"{v:g}" for v in value)
    return f"{value:.3g}"


def _leads_text(summary: Mapping[str, Any]) -> str:
    parts = []
    for r in summary["fell"]:
        lead = r["lead"]
        text = "miss" if lead is None else f"{lead:+.0f}"
        parts.append(f"{_short(r['run'])} {text}")
    return "; ".join(parts) or "no run fell"


def _false_text(summary: Mapping[str, Any]) -> str:
    n = summary["n_not_fell"]
    if not n:
        return "–"
    false = summary["false_alarms"]
    names = ", ".join(f"{_short(run)} @{step}" for run, step in list(false.items())[:MAX_NAMED])
    more = f", and {len(false) - MAX_NAMED} more" if len(false) > MAX_NAMED else ""
    return f"{len(false)}/{n} ({len(false) / n:.0%})" + (f": {names}{more}" if false else "")


def signal_table(result: Mapping[str, Any], basis: str) -> list[str]:
    """One markdown table: per signal its threshold, falls warned, leads by run, false alarms."""
    head = "| signal | alarms when | threshold | falls warned (lead ≥ 0) | lead by run (steps) |"
    lines = [head + " false alarms |", "|---|---|---|---|---|---|"]
    for name, res in result["signals"].items():
        summary = res.get(basis)
        if summary is None:
            continue
        if basis == "leave_one_seed_out":
            picks = sorted({json.dumps(v) for v in summary["thresholds"].values()})
            threshold = "; ".join(_threshold_text(json.loads(p)) for p in picks)
        else:
            threshold = _threshold_text(res.get("threshold"))
        when = "fixed" if res.get("fixed") else res.get("direction", "chosen setting")
        labels = " (labels)" if res.get("uses_labels") else ""
        warned = f"{summary['warned']}/{summary['n_fell']}" if summary["n_fell"] else "–"
        lines.append(
            f"| `{name}`{labels} | {when} | {threshold} | {warned} | {_leads_text(summary)} | "
            f"{_false_text(summary)} |"
        )
    return lines


def _lead_range(summary: Mapping[str, Any]) -> str:
    leads = [r["lead"] for r in summary["fell"] if r["lead"] is not None and r["lead"] >= 0]
    if not leads:
        return "–"
    return f"{np.median(leads):+.0f} ({min(leads):+.0f} to {max(leads):+.0f})"


def _count(summary: Mapping[str, Any] | None, key: str) -> str:
    if summary is None:
        return "–"
    if key == "warned":
        return f"{summary['warned']}/{summary['n_fell']}" if summary["n_fell"] else "–"
    n = summary["n_not_fell"]
    false = len(summary["false_alarms"])
    return f"{false}/{n} ({false / n:.0%})" if n else "–"


def summary_table(result: Mapping[str, Any]) -> list[str]:
    """The short table: per signal, on the judged runs (threshold from the calibration runs) and
    leave-one-seed-out, the falls warned, the leads of the warned falls (median, range) and the
    false alarms."""
    lines = [
        "| signal | alarms when | threshold | judged: falls warned | lead, steps (median, range) "
        "| false alarms | leave-one-seed-out: falls warned | lead, steps | false alarms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in result["signals"].items():
        judged, loso = res.get("judged"), res["leave_one_seed_out"]
        when = "fixed" if res.get("fixed") else res.get("direction", "chosen setting")
        labels = " (labels)" if res.get("uses_labels") else ""
        lines.append(
            f"| `{name}`{labels} | {when} | {_threshold_text(res.get('threshold'))} | "
            f"{_count(judged, 'warned')} | {_lead_range(judged) if judged else '–'} | "
            f"{_count(judged, 'false')} | {_count(loso, 'warned')} | {_lead_range(loso)} | "
            f"{_count(loso, 'false')} |"
        )
    return lines


def _runs_section(result: Mapping[str, Any]) -> list[str]:
    rows = result["runs"]
    fell = [r for r in rows if r["fall"] is not None]
    sets = {s: sum(1 for r in rows if r["set"] == s) for s in ("calibration", "judged")}
    lines = [
        f"{len(rows)} runs ({sets['calibration']} calibration, {sets['judged']} judged); "
        f"{len(fell)} fell (val/acc below its step-0 value by more than {FALL_MARGIN:g}, "
        "confirmed at the next validation).",
        "",
    ]
    if fell:
        lines += ["| run | set | val/acc at step 0 | fall step | val/acc there | final |"]
        lines += ["|---|---|---|---|---|---|"]
        lines += [
            f"| {r['run']} | {r['set'] or '–'} | {r['base_acc']:.3f} | {r['fall']} | "
            f"{r['acc_at_fall']:.3f} | {r['final_acc']:.3f} |"
            for r in fell
        ]
    return lines


def render(result: Mapping[str, Any], command: str = "") -> str:
    """warning.md: the runs that fell, the tables (judged, calibration, leave-one-seed-out),
    the detector's default and the signal that warns first."""
    lines = ["# Early warning: lead time before val/acc falls, and false alarms", ""]
    if command:
        lines += [f"Written by `{command}`.", ""]
    lines += [*_runs_section(result), "", "## Summary", "", *summary_table(result), ""]
    titles = {
        "judged": "Judged runs (thresholds chosen on the calibration runs)",
        "calibration": "Calibration runs (in-sample: the thresholds were chosen on these)",
        "leave_one_seed_out": "Leave-one-seed-out (each seed's runs judged with thresholds "
        "chosen on the other seeds')",
    }
    for basis, title in titles.items():
        table = signal_table(result, basis)
        if len(table) > 2:
            lines += [f"## {title}", "", *table, ""]
    d = result["detector_decision"]
    lines += [
        "## The detector's default",
        "",
        f"On the {d['basis'].replace('_', '-')} runs ({d['n_fell']} fell): the default "
        f"{_threshold_text(d['default'])} warned on {d['default_result']['warned']} with a "
        f"false-alarm rate of {d['default_result']['false_alarm_rate']:.0%}; the calibration's "
        f"choice {_threshold_text(d['chosen'])} on {d['chosen_result']['warned']} with "
        f"{d['chosen_result']['false_alarm_rate']:.0%}. "
        + ("The default should change." if d["change"] else "The default stands."),
        "",
        "## Which signal warns first",
        "",
    ]
    none = (
        f"none (no signal warned on at least half the falls with at most "
        f"{FIRST_MAX_FALSE_ALARM:.0%} false alarms)"
    )
    for basis, names in result["warns_first"].items():
        lines.append(
            f"- {basis.replace('_', '-')}: "
            + "; ".join(f"{kind.replace('_', '-')} `{n}`" if n else f"{kind.replace('_', '-')} {none}"
                        for kind, n in names.items())
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def _dump(result: Mapping[str, Any]) -> str:
    """warning.json, small and diffable: a line per top-level value, per run, and per signal's
    key (its threshold, and each basis's named results)."""

    def one(value: Any) -> str:
        return json.dumps(value, default=_jsonable, ensure_ascii=False, allow_nan=False)

    def block(pairs: list[str], indent: str, close: str) -> str:
        return ",\n".join(indent + p for p in pairs) + "\n" + close

    parts = []
    for key, value in result.items():
        if key == "signals":
            inner = [
                f"{one(name)}: {{\n"
                + block(
                    [f"{one(k)}: {one(_compact(result, k, v))}" for k, v in res.items()],
                    "   ",
                    "  }",
                )
                for name, res in value.items()
            ]
            parts.append(f"{one(key)}: {{\n" + block(inner, "  ", " }"))
        elif key == "runs":
            parts.append(f"{one(key)}: [\n" + block([one(r) for r in value], "  ", " ]"))
        else:
            parts.append(f"{one(key)}: {one(value)}")
    return "{\n" + block(parts, " ", "}") + "\n"


def basis_labels(result: Mapping[str, Any], basis: str) -> list[str]:
    """The runs a basis covers, in order: `calibration`, `judged`, or all."""
    runs = result["runs"]
    return [r["run"] for r in runs if basis not in ("calibration", "judged") or r["set"] == basis]


def _compact(result: Mapping[str, Any], basis: str, summary: Any) -> Any:
    """In warning.json a basis's false alarms become `alarms`: every run's alarm step in the
    order of `basis_labels` (null: none), which names them through `runs`."""
    if not isinstance(summary, Mapping) or "false_alarms" not in summary:
        return summary
    steps = {**summary["false_alarms"], **{r["run"]: r["alarm"] for r in summary["fell"]}}
    out = {k: v for k, v in summary.items() if k != "false_alarms"}
    out["n_false_alarms"] = len(summary["false_alarms"])
    out["alarms"] = [steps.get(name) for name in basis_labels(result, basis)]
    return out


def _calibration_labels(sources: Sequence[str], runs: Sequence[History], df: pd.DataFrame) -> list:
    roots = [Path(s).resolve() for s in sources]
    dirs = {run_label(str(d), str(r)): Path(str(d)).resolve() for d, r in
            df.groupby("run_dir", sort=False)["run"].first().items()}  # fmt: skip
    return [h.label for h in runs if any(dirs[h.label].is_relative_to(r) for r in roots)]


def main(argv: Sequence[str] | None = None) -> int:
    from omgrpo.analysis.load import load_runs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories or folders of them")
    ap.add_argument("--out", required=True, help="folder for warning.md and warning.json")
    ap.add_argument(
        "--calibrate",
        nargs="+",
        default=None,
        help="the run folders that choose the thresholds (the other runs are judged)",
    )
    args = ap.parse_args(argv)
    df = load_runs(*args.runs, *(args.calibrate or []))
    runs = histories(df)
    calibrate = None if args.calibrate is None else _calibration_labels(args.calibrate, runs, df)
    result = early_warning(runs, calibrate)
    command = "python -m omgrpo.analysis.warning " + " ".join(
        [
            *args.runs,
            "--out",
            args.out,
            *(["--calibrate", *args.calibrate] if args.calibrate else []),
        ]
    )
    result["command"] = command
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "warning.json").write_text(_dump(result))
    (out / "warning.md").write_text(render(result, command))
    print(f"wrote {out / 'warning.md'} and {out / 'warning.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
