"""Time to event in a pre-registered study (study v4's "Time to event"): when, in each run, the
guess route opened and the collapse detector fired, right-censored at the study's horizon.

The rules (a pre-registration's `events` block):

- `route_open: {metric, rise_above, from_step, confirm: next_validation}`: the first
  validation step t after `from_step` at which `metric` exceeds its `from_step` value by more
  than `rise_above`, and does so again at the next validation. At the censor step there is no
  next validation, so one is enough there.
- `detector: {logged, replay, max_unique_per_prompt, min_mode_share, patience}`: the step the
  run logged as `logged` (`collapse/detected_step`), or, where it logged none,
  `omgrpo.analysis.load.collapse_step` replayed over the run's answers with these thresholds.
- `censor_at`: an event after this step counts as no event; a unit reads "> censor_at".

A run that stopped before the censor step without the event is followed only to its last
step: it reads "> <last step>" and is left out of the share and the median (its outcome by the
censor step is not known).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from omgrpo.analysis.load import collapse_step
from omgrpo.analysis.study_stats import clopper_pearson, median_interval

__all__ = ["EVENTS", "EventTime", "event_summary", "event_time", "occurred_by"]

EVENTS = ("route_open", "detector")
DETECTOR_REPLAY = "omgrpo.analysis.load.collapse_step"


@dataclass(frozen=True)
class EventTime:
    """A unit's event: `step` (None: not by `followed_to`), `followed_to`: the last step of
    the run that was looked at (the censor step for a finished run; None: no data)."""

    step: int | None
    followed_to: int | None


def _series(run: pd.DataFrame, metric: str, censor: int) -> list[tuple[int, float]]:
    if metric not in run.columns:
        return []
    values = pd.to_numeric(run[metric], errors="coerce")
    rows = pd.DataFrame({"step": run["step"], "v": values}).dropna()
    rows = rows[rows["step"] <= censor].sort_values("step")
    return [(int(s), float(v)) for s, v in zip(rows["step"], rows["v"])]


def route_open_time(run: pd.DataFrame, rule: Mapping, censor: int) -> EventTime:
    """The route-open event of one run (module docstring)."""
    points = _series(run, rule["metric"], censor)
    start = [v for s, v in points if s == rule.get("from_step", 0)]
    if not start:
        return EventTime(None, None)
    later = [(s, v - start[0]) for s, v in points if s > rule.get("from_step", 0)]
    followed = later[-1][0] if later else None
    confirm = rule.get("confirm", "next_validation") == "next_validation"
    for i, (step, rise) in enumerate(later):
        if rise <= rule["rise_above"]:
            continue
        if step == censor or not confirm:
            return EventTime(step, followed)
        if i + 1 < len(later) and later[i + 1][1] > rule["rise_above"]:
            return EventTime(step, followed)
    return EventTime(None, followed)


def detector_time(run: pd.DataFrame, rule: Mapping, censor: int) -> EventTime:
    """The detector's firing in one run: logged, else replayed (module docstring)."""
    steps = run.loc[run["step"] > 0, "step"]
    followed = int(min(steps.max(), censor)) if len(steps) else None
    logged = rule.get("logged", "collapse/detected_step")
    fired = None
    if logged in run.columns:
        values = pd.to_numeric(run[logged], errors="coerce").dropna()
        fired = int(values.iloc[0]) if len(values) else None
    if fired is None:
        keys = ("max_unique_per_prompt", "min_mode_share", "patience")
        fired = collapse_step(
            run.drop(columns=[logged], errors="ignore"), {k: rule.get(k) for k in keys}
        )
    if fired is not None and fired > censor:
        fired = None
    return EventTime(fired, followed)


def event_time(run: pd.DataFrame, event: str, events: Mapping) -> EventTime:
    """`event` (`route_open` or `detector`) in one run, by the `events` block's rule."""
    if run.empty:
        return EventTime(None, None)
    censor = int(events["censor_at"])
    if event == "route_open":
        return route_open_time(run, events["route_open"], censor)
    return detector_time(run, events["detector"], censor)


def occurred_by(t: EventTime, by_step: int) -> float:
    """1 if the event happened by `by_step`, 0 if the run was followed that far without it,
    NaN if not known (no data, or a run that stopped earlier)."""
    if t.step is not None and t.step <= by_step:
        return 1.0
    if t.followed_to is not None and t.followed_to >= by_step:
        return 0.0
    return math.nan


def unit_text(t: EventTime, censor: int) -> str:
    if t.step is not None:
        return str(t.step)
    if t.followed_to is None:
        return "not run"
    return f"> {t.followed_to}" + ("" if t.followed_to >= censor else " (stopped)")


def event_summary(times: Mapping[str, EventTime], censor: int) -> dict:
    """Per arm and event: each unit's time as text, the share with the event by `censor` and
    its Clopper-Pearson interval, and the median time with its order-statistic interval (units
    followed to `censor` or with the event only)."""
    known = {u: t for u, t in times.items() if not math.isnan(occurred_by(t, censor))}
    k = sum(t.step is not None for t in known.values())
    n = len(known)
    ci = clopper_pearson(k, n) if n else None
    med = median_interval([t.step for t in known.values()], censor)
    return {
        "units": {u: unit_text(t, censor) for u, t in times.items()},
        "k": k,
        "n": n,
        "share_ci95": ci,
        "median": med.median,
        "median_interval": (med.low, med.high),
        "median_coverage": med.coverage,
    }


def event_table(rows: Sequence[tuple[str, str, str, dict]], censor: int) -> list[str]:
    """Markdown rows of the time-to-event table: (world, arm, event, `event_summary`)."""
    lines = [
        f"| world | arm | event | each unit's step (censored at {censor}) | with the event by "
        f"{censor} | 95% CI (Clopper–Pearson) | median step | its interval (coverage) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, arm, event, s in rows:
        units = ", ".join(f"{u} {text}" for u, text in s["units"].items()) or "–"
        share = f"{s['k']}/{s['n']}" if s["n"] else "–"
        ci = "–" if s["share_ci95"] is None else "{:.2f} to {:.2f}".format(*s["share_ci95"])
        cov = s["median_coverage"]
        interval = (
            "–"
            if not s["n"]
            else f"{s['median_interval'][0]} to {s['median_interval'][1]} ({cov:.1%})"
        )
        lines.append(
            f"| {world} | {arm} | {event} | {units} | {share} | {ci} | {s['median']} | {interval} |"
        )
    return lines
