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

From pre-registration version 4 on, the block may also hold (each optional; any other key is
refused, naming it, so that a key this module does not implement is never judged silently):

- `at_every_validation: true` on a prediction: judged at each validation after its start step,
  each on its own; *confirmed* only if confirmed at every one, *refuted* if refuted at any,
  *inconclusive* otherwise (the per-validation rows are printed);
- `events` and `event_predictions`: time to event (`omgrpo.analysis.study_events`): per arm and
  unit the step the route opened / the collapse detector fired, right-censored at
  `events.censor_at`; an event prediction judges the share of units with the event by
  `by_step` by its Clopper-Pearson interval;
- `holm_family` and `holm_alpha_one_sided`: a Holm column for the family's predictions, from
  one-sided p-values (`omgrpo.analysis.study_stats`): a t-test against the threshold for `>` /
  `<`, TOST for `abs<`, the exact binomial test for a share; Holm's procedure is applied to the
  predicted side (Holm-confirmed) and to the opposite side (Holm-refuted);
- `sensitivity: by_base`: per confirmatory prediction (the Holm family, else every one) the
  mean and t-interval within each base and the base-stratified estimate, with a note on units
  nested in bases.

An `ERRATA.md` beside the pre-registration (corrections and reading notes written after the
results; the pre-registration itself is never edited) is printed in the report under its
predictions. Reports of version 4 on also give the runs' logged wall time; `summary.json`
always records it (`wall_time`).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from omgrpo.analysis.figures import DRAW, MissingRunsError, save_png
from omgrpo.analysis.load import find_run_dirs, load_runs, t_critical
from omgrpo.analysis.mechanism import mechanism_section, mechanism_table
from omgrpo.analysis.report import base_checks, base_checks_section, what_happened
from omgrpo.analysis.study_events import (
    DETECTOR_REPLAY,
    EVENTS,
    event_summary,
    event_table,
    event_time,
    occurred_by,
)
from omgrpo.analysis.study_stats import binomial_p, clopper_pearson, holm, stratified, t_p
from omgrpo.errors import InputError
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
    # version 4 on (left out of as_json when None): the one-sided p-values (predicted side,
    # opposite side) and the Holm verdict with its adjusted p-values, for the Holm family;
    # the per-validation rows of an `at_every_validation` prediction; the per-base rows.
    p_one_sided: tuple[float, float] | None = None
    holm: str | None = None
    holm_p: tuple[float, float] | None = None
    per_validation: tuple[dict, ...] | None = None
    by_base: dict | None = None


EXTRA_FIELDS = ("p_one_sided", "holm", "holm_p", "per_validation", "by_base")


TOP_KEYS = frozenset(
    {"version", "date", "start_step", "final_steps", "train_window", "horizon",
     "validation_every", "stop_unless_confirmed", "holm_family", "holm_alpha_one_sided",
     "sensitivity", "predictions", "events", "event_predictions"}
)  # fmt: skip
PREDICTION_KEYS = frozenset(
    {"id", "world", "measure", "metric", "a", "b", "world_b", "methods", "x", "seeds", "above",
     "expect", "start_step", "at_every_validation"}
)  # fmt: skip
EVENT_PREDICTION_KEYS = frozenset({"id", "world", "event", "a", "by_step", "expect", "seeds"})
EVENTS_KEYS = frozenset({"route_open", "detector", "censor_at", "arms"})
ROUTE_OPEN_KEYS = frozenset({"metric", "rise_above", "from_step", "confirm"})
DETECTOR_KEYS = frozenset(
    {"logged", "replay", "max_unique_per_prompt", "min_mode_share", "patience"}
)
SENSITIVITIES = ("by_base",)
_NEEDS = {
    "change": ["a"],
    "diff": ["a", "b"],
    "change_diff": ["a", "b"],
    "spearman": ["methods", "x"],
    "opened": ["a", "above"],
}


def read_preregistration(path: str | Path) -> dict[str, Any]:
    """The YAML block of a pre-registration file, checked: an unknown key anywhere in it, a
    missing or malformed field, an id named twice or a gate / Holm member that names no
    prediction raises `InputError` naming the file, the prediction and the key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read the pre-registration: {e}", file=path) from e
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    if not blocks:
        raise InputError("no ```yaml block with the predictions", file=path)
    try:
        spec = yaml.safe_load(blocks[-1])
    except yaml.YAMLError as e:
        raise InputError(f"the predictions block is not valid YAML: {e}", file=path) from e
    _known_keys(path, "the predictions block", spec, TOP_KEYS)
    for key in ("predictions", "final_steps", "start_step"):
        if key not in spec:
            raise InputError(f"the predictions block has no '{key}'", file=path)
    for key in ("predictions", "event_predictions"):
        if key in spec and not isinstance(spec[key], list):
            raise InputError(f"'{key}' must be a list", file=path, found=spec[key])
    for p in spec["predictions"]:
        _check_prediction(path, p)
    _check_events(path, spec)
    ids = [p.get("id") for p in [*spec["predictions"], *(spec.get("event_predictions") or [])]]
    twice = sorted({i for i in ids if ids.count(i) > 1}, key=str)
    if twice:
        raise InputError(f"prediction ids named more than once: {twice}", file=path)
    gates = spec.get("stop_unless_confirmed")
    unknown = [g for g in _as_list(gates) if g not in ids]
    if unknown:
        raise InputError(f"stop_unless_confirmed names no prediction: {unknown}", file=path)
    _check_family(path, spec, ids)
    return spec


def _known_keys(path: Path, where: str, mapping: Any, known: frozenset) -> None:
    if not isinstance(mapping, dict):
        raise InputError(f"{where} must be a mapping", file=path, found=mapping)
    extra = sorted(set(mapping) - known, key=str)
    if extra:
        raise InputError(
            f"{where}: unknown key {extra[0]!r}; a key study-report does not implement would "
            "be ignored, so it is refused",
            file=path,
            expected="one of " + ", ".join(sorted(known)),
        )


def _check_prediction(path: Path, p: Any) -> None:
    name = p.get("id", "?") if isinstance(p, dict) else "?"
    _known_keys(path, f"prediction {name}", p, PREDICTION_KEYS)
    if p.get("measure") not in MEASURES:
        raise InputError(f"{name}: measure must be one of {MEASURES}", file=path)
    _check_expect(path, name, p.get("expect"), OPS)
    missing = [k for k in ["world", "metric", *_NEEDS[p["measure"]]] if k not in p]
    if missing:
        raise InputError(f"{name}: missing {missing}", file=path)
    every = p.get("at_every_validation", False)
    if not isinstance(every, bool):
        raise InputError(f"{name}: at_every_validation must be true or false", file=path)
    if every and (p["measure"] == "spearman" or not str(p["metric"]).startswith("val/")):
        raise InputError(
            f"{name}: at_every_validation needs a validation metric (val/...) and a change, "
            "diff, change_diff or opened measure",
            file=path,
        )


def _check_expect(path: Path, name: str, expect: Any, ops: Sequence[str]) -> None:
    ok = isinstance(expect, list) and len(expect) == 2 and expect[0] in ops
    if not ok or isinstance(expect[1], bool) or not isinstance(expect[1], int | float):
        raise InputError(f"{name}: expect must be [op, threshold], op in {tuple(ops)}", file=path)


def _check_events(path: Path, spec: Mapping) -> None:
    events, preds = spec.get("events"), spec.get("event_predictions")
    if events is None:
        if preds:
            raise InputError("event_predictions need an 'events' block", file=path)
        return
    _known_keys(path, "events", events, EVENTS_KEYS)
    censor = events.get("censor_at")
    if isinstance(censor, bool) or not isinstance(censor, int) or censor < 1:
        raise InputError("events: censor_at must be a step (a positive integer)", file=path)
    arms = events.get("arms", [])
    if not isinstance(arms, list) or not all(isinstance(a, str) for a in arms):
        raise InputError("events: arms must be a list of method names", file=path)
    if "route_open" in events:
        rule = events["route_open"]
        _known_keys(path, "events.route_open", rule, ROUTE_OPEN_KEYS)
        if "metric" not in rule or not isinstance(rule.get("rise_above"), int | float):
            raise InputError("events.route_open needs a metric and rise_above", file=path)
        if rule.get("confirm", "next_validation") != "next_validation":
            raise InputError("events.route_open: confirm must be next_validation", file=path)
    if "detector" in events:
        _known_keys(path, "events.detector", events["detector"], DETECTOR_KEYS)
        replay = events["detector"].get("replay", DETECTOR_REPLAY)
        if replay != DETECTOR_REPLAY:
            raise InputError(f"events.detector: replay must be {DETECTOR_REPLAY}", file=path)
    for p in preds or []:
        _check_event_prediction(path, p, events)


def _check_event_prediction(path: Path, p: Any, events: Mapping) -> None:
    name = p.get("id", "?") if isinstance(p, dict) else "?"
    _known_keys(path, f"event prediction {name}", p, EVENT_PREDICTION_KEYS)
    missing = [k for k in ("id", "world", "event", "a", "by_step", "expect") if k not in p]
    if missing:
        raise InputError(f"{name}: missing {missing}", file=path)
    if p["event"] not in EVENTS or (p["event"] == "route_open" and "route_open" not in events):
        raise InputError(f"{name}: event must be one the events block defines", file=path)
    _check_expect(path, name, p["expect"], (">", "<"))
    if not 0 < p["expect"][1] < 1:
        raise InputError(f"{name}: a share's threshold must lie in (0, 1)", file=path)
    if not isinstance(p["by_step"], int) or p["by_step"] > events["censor_at"]:
        raise InputError(f"{name}: by_step must be a step <= events.censor_at", file=path)


def _check_family(path: Path, spec: Mapping, ids: Sequence) -> None:
    family = spec.get("holm_family")
    if family is not None:
        if not isinstance(family, list) or not family:
            raise InputError("holm_family must be a list of prediction ids", file=path)
        unknown = [f for f in family if f not in ids]
        if unknown:
            raise InputError(f"holm_family names no prediction: {unknown}", file=path)
    alpha = spec.get("holm_alpha_one_sided", 0.025)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < 0.5:
        raise InputError("holm_alpha_one_sided must lie in (0, 0.5)", file=path, found=alpha)
    if spec.get("sensitivity") not in (None, *SENSITIVITIES):
        raise InputError(
            "sensitivity: unknown analysis", file=path, found=spec.get("sensitivity"),
            expected=" or ".join(SENSITIVITIES),
        )  # fmt: skip


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


RUN_KEYS = ["experiment", "seed", "method"]
_runs_of: dict[int, tuple[weakref.ref, dict]] = {}  # id(frame) -> (the frame, its runs)


def _run(df: pd.DataFrame, experiment: str, seed: int, method: str) -> pd.DataFrame:
    """The rows of one run (read only). The frame is split into its runs once: filtering the
    whole frame for each of a report's ~500 lookups took a quarter of `study-report`."""
    ref, runs = _runs_of.get(id(df), (None, {}))
    if ref is None or ref() is not df:
        runs = {key: rows for key, rows in df.groupby(RUN_KEYS, sort=False)}
        _runs_of.clear()
        _runs_of[id(df)] = (weakref.ref(df), runs)
    return runs.get((experiment, seed, method), df.iloc[:0])


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
        ci = clopper_pearson(round(sum(values)), len(values))
        return mean, ci, _side(op, threshold, ci[0], ci[1])
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


def _p_values(op: str, threshold: float, values: list[float], binary: bool) -> tuple | None:
    """One-sided p-values (predicted side, opposite side), `omgrpo.analysis.study_stats`."""
    if binary:
        if op == "abs<":
            return None
        return binomial_p(round(sum(values)), len(values), threshold, op)
    return t_p(values, op, threshold) if len(values) >= 2 else None


def _verdict(p: Mapping, raw: Mapping[str, float], spec: Mapping, binary: bool) -> Verdict:
    """A prediction's verdict from its per-unit values `raw` (NaN: the unit has no data)."""
    finite = [v for v in raw.values() if not math.isnan(v)]
    op, threshold = p["expect"]
    pvals, by_base = None, None
    if finite:
        mean, ci, verdict = _decide(op, float(threshold), finite, binary)
        pvals = _p_values(op, float(threshold), finite, binary)
        if spec.get("sensitivity") == "by_base":
            by_base = _by_base(raw, op, float(threshold), binary)
    else:
        mean, ci, verdict = None, None, "not run"
    return Verdict(
        id=p["id"],
        world=p["world"],
        measure=p.get("measure", "event"),
        metric=p.get("metric", p.get("event", "")),
        expect=f"{op} {threshold}",
        values={k: round(v, 4) for k, v in raw.items()},
        mean=None if mean is None else round(mean, 4),
        ci95=None if ci is None else (round(ci[0], 4), round(ci[1], 4)),
        verdict=verdict,
        p_one_sided=None if pvals is None else (round(pvals[0], 6), round(pvals[1], 6)),
        by_base=by_base,
    )


def _judge(df: pd.DataFrame, p: Mapping, spec: Mapping) -> Verdict:
    units = _units(df, p["world"], p.get("seeds"))
    raw = {f"{e}/s{s}": _unit_value(df, p, (e, s), spec) for e, s in units}
    verdict = _verdict(p, raw, spec, binary=p["measure"] == "opened")
    if p.get("at_every_validation"):
        verdict = _every_validation(df, p, spec, units, verdict)
    return verdict


def _validation_steps(
    df: pd.DataFrame, p: Mapping, spec: Mapping, units: Sequence[tuple[str, int]]
) -> list[int]:
    """The steps after the prediction's start (up to the last final step) at which its
    metric was logged in the runs it compares."""
    arms = {p.get("a"), p.get("b"), *p.get("methods", [])} - {None}
    experiments = {e for e, _ in units} | ({p["world_b"]} if "world_b" in p else set())
    rows = df[df["experiment"].isin(experiments) & df["method"].isin(arms)]
    if p["metric"] not in rows.columns:
        return []
    logged = rows.loc[pd.to_numeric(rows[p["metric"]], errors="coerce").notna(), "step"]
    start, last = p.get("start_step", spec["start_step"]), max(spec["final_steps"])
    return sorted({int(s) for s in logged if start < s <= last})


def _every_validation(
    df: pd.DataFrame, p: Mapping, spec: Mapping, units: list, final: Verdict
) -> Verdict:
    """`at_every_validation`: the prediction judged at each validation on its own (final
    window = that one step); confirmed only if confirmed at every one, refuted if refuted at
    any. The row keeps the final window's mean and interval; p-values: the largest predicted-
    side p (all must hold) and the smallest opposite-side p (one suffices)."""
    op, threshold = p["expect"]
    rows = []
    for step in _validation_steps(df, p, spec, units):
        at = {**spec, "final_steps": [step]}
        values = [_unit_value(df, p, u, at) for u in units]
        finite = [v for v in values if not math.isnan(v)]
        if not finite:
            continue
        mean, ci, verdict = _decide(op, float(threshold), finite)
        pvals = _p_values(op, float(threshold), finite, False) or (math.nan, math.nan)
        rows.append(
            {"step": step, "n": len(finite), "mean": round(mean, 4), "p": pvals,
             "ci95": None if ci is None else (round(ci[0], 4), round(ci[1], 4)),
             "verdict": verdict.split(",")[0]}
        )  # fmt: skip
    if not rows:
        return replace(final, verdict="not run", per_validation=())
    text = _combined_verdict(rows, _expected_validations(p, spec), final.verdict == "not run")
    pvals = (max(r["p"][0] for r in rows), min(r["p"][1] for r in rows))
    for r in rows:
        r["p"] = (round(r["p"][0], 6), round(r["p"][1], 6))
    return replace(
        final,
        verdict=text,
        p_one_sided=(round(pvals[0], 6), round(pvals[1], 6)),
        per_validation=tuple(rows),
    )


def _expected_validations(p: Mapping, spec: Mapping) -> list[int] | None:
    """The validation steps after the prediction's start up to the last final step, from the
    block's `validation_every` (None without it)."""
    every = spec.get("validation_every")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        return None
    start = p.get("start_step", spec["start_step"])
    return list(range(start + every, max(spec["final_steps"]) + 1, every))


def _combined_verdict(rows: list[dict], expected: list[int] | None, no_final: bool) -> str:
    """Refuted if refuted at any validation; confirmed if confirmed at every one, and every
    expected validation (the final window included) is there; else inconclusive, or not run
    where validations are missing (an unfinished run)."""
    count = {v: sum(r["verdict"] == v for r in rows) for v in ("confirmed", "refuted")}
    seen = {r["step"] for r in rows}
    missing = no_final or (expected is not None and bool(set(expected) - seen))
    of = len(expected) if expected is not None else len(rows)
    tail = f"{count['confirmed']} of {of} confirmed, {count['refuted']} refuted"
    if count["refuted"]:
        return f"refuted, at every validation ({tail})"
    if missing:
        return f"not run, at every validation ({len(rows)} of {of} validations there; {tail})"
    combined = "confirmed" if count["confirmed"] == len(rows) else "inconclusive"
    return f"{combined}, at every validation ({tail})"


def _judge_event(df: pd.DataFrame, p: Mapping, spec: Mapping) -> Verdict:
    """An event prediction: per unit 1 if `a`'s run had the event by `by_step`, 0 if it was
    followed that far without it; the share and its Clopper-Pearson interval."""
    units = _units(df, p["world"], p.get("seeds"))
    raw = {
        f"{e}/s{s}": occurred_by(event_time(_run(df, e, s, p["a"]), p["event"], spec["events"]),
                                 p["by_step"])
        for e, s in units
    }  # fmt: skip
    return _verdict({**p, "measure": "event", "metric": p["event"]}, raw, spec, binary=True)


def _by_base(raw: Mapping[str, float], op: str, threshold: float, binary: bool) -> dict:
    """Per base (`experiment`): n, mean and 95% interval (t, or Clopper-Pearson for a share),
    the base-stratified estimate, and whether the base means lie on different sides of the
    threshold (for abs<: one within +-threshold, the other outside)."""
    groups: dict[str, list[float]] = {}
    for unit, value in raw.items():
        if not math.isnan(value):
            groups.setdefault(unit.rsplit("/s", 1)[0], []).append(value)
    out = stratified(groups)
    if binary:  # a share per base: its exact interval; the stratified share has none
        for base, values in groups.items():
            out["bases"][base]["ci95"] = clopper_pearson(round(sum(values)), len(values))
        out["ci95"], out["dof"] = None, None
    sides = {_where(op, threshold, b["mean"]) for b in out["bases"].values()}
    out["sides_differ"] = len(sides) > 1
    return out


def _where(op: str, threshold: float, mean: float) -> str:
    if op == "abs<":
        return "within" if abs(mean) < threshold else "outside"
    return "above" if mean > threshold else "below" if mean < threshold else "at"


def judge_predictions(df: pd.DataFrame, spec: Mapping) -> list[Verdict]:
    """Every prediction of `spec` (`read_preregistration`) marked from the runs in `df`: the
    predictions, then the event predictions; the Holm column for `holm_family`; the per-base
    rows for its members (every prediction without a family) under `sensitivity: by_base`."""
    verdicts = [_judge(df, p, spec) for p in spec["predictions"]]
    verdicts += [_judge_event(df, p, spec) for p in spec.get("event_predictions") or []]
    family = _as_list(spec.get("holm_family"))
    adjusted: dict[str, tuple[str, tuple[float, float]]] = {}
    if family:
        alpha = float(spec.get("holm_alpha_one_sided", 0.025))
        members = [v for v in verdicts if v.id in family]
        sides = [
            holm({v.id: (v.p_one_sided or (math.nan, math.nan))[i] for v in members}, alpha)
            for i in (0, 1)
        ]
        for v in members:
            (yes, p_yes), (no, p_no) = sides[0][v.id], sides[1][v.id]
            text = "confirmed" if yes else "refuted" if no else "inconclusive"
            text = "not run" if v.verdict == "not run" else text
            adjusted[v.id] = (text, (round(p_yes, 6), round(p_no, 6)))
    out = []
    for v in verdicts:
        mine = v.id in family
        holm_text, holm_p = adjusted.get(v.id, (None, None))
        keep_base = mine or not family
        out.append(
            replace(
                v,
                p_one_sided=v.p_one_sided if mine else None,
                holm=holm_text,
                holm_p=holm_p,
                by_base=v.by_base if keep_base else None,
            )
        )
    return out


def _p_text(p: tuple[float, float] | None) -> str:
    return "–" if p is None else f"{p[0]:.3g} / {p[1]:.3g}"


def verdict_table(verdicts: Sequence[Verdict], texts: Mapping[str, str] | None = None) -> str:
    """Markdown: one row per prediction (value, 95% CI, n, verdict); with a Holm family also
    the one-sided p-values (predicted / opposite side) and the Holm verdict ("–" outside it)."""
    with_holm = any(v.holm is not None for v in verdicts)
    head = "| id | prediction | measured (mean) | 95% CI | n | verdict |"
    rule = "|---|---|---|---|---|---|"
    if with_holm:
        head += " one-sided p (predicted / opposite) | Holm |"
        rule += "---|---|"
    rows = [head, rule]
    for v in verdicts:
        what = (texts or {}).get(v.id) or f"{v.measure} of {v.metric} {v.expect}"
        ci = "–" if v.ci95 is None else f"{v.ci95[0]:+.3f} to {v.ci95[1]:+.3f}"
        mean = "–" if v.mean is None else f"{v.mean:+.3f}"
        n = sum(not math.isnan(x) for x in v.values.values())
        row = f"| {v.id} | {what} | {mean} | {ci} | {n} | {v.verdict} |"
        if with_holm:
            holm_cell = "–" if v.holm is None else f"{v.holm} (adjusted {_p_text(v.holm_p)})"
            row += f" {_p_text(v.p_one_sided)} | {holm_cell} |"
        rows.append(row)
    return "\n".join(rows)


def prediction_texts(path: str | Path) -> dict[str, str]:
    """Prediction id -> its words, from the pre-registration's table rows `| P<n> | world |
    words |` (ids: capitals then digits, e.g. P3, C1, S12)."""
    rows = re.findall(
        r"^\| ([A-Z]+\d+) \| [^|]+ \| ([^|]+) \|$", Path(path).read_text(), flags=re.M
    )
    return {pid: text.strip() for pid, text in rows}


def as_json(verdicts: Sequence[Verdict]) -> list[dict]:
    """The verdicts as dicts; the version-4 fields only where set (earlier studies' summaries
    keep their shape)."""
    out = []
    for v in verdicts:
        d = asdict(v)
        out.append({k: x for k, x in d.items() if k not in EXTRA_FIELDS or x is not None})
    return out


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
        each_run = [r for _, r in runs.groupby("run")]
        for metric in names:
            pairs = [
                (_start(r, metric, spec), _final(r, metric, spec))
                for r in each_run
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
            save_png(fig, folder / f"{world}__{name}.png", dpi=110)
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


def every_validation_section(verdicts: Sequence[Verdict]) -> list[str]:
    """Per `at_every_validation` prediction: its verdict at each validation, three validations
    to a row (step, mean, 95% CI, verdict)."""
    lines: list[str] = []
    for v in verdicts:
        if v.per_validation is None:
            continue
        lines += [
            f"### {v.id} at every validation: {v.measure} of {v.metric} {v.expect}",
            "",
            "| step | mean | 95% CI | verdict " * 3 + "|",
            "|---|---|---|---" * 3 + "|",
        ]
        cells = []
        for r in v.per_validation:
            ci = "–" if r["ci95"] is None else f"{r['ci95'][0]:+.3f} to {r['ci95'][1]:+.3f}"
            cells.append(f"| {r['step']} | {r['mean']:+.3f} | {ci} | {r['verdict']} ")
        for i in range(0, len(cells), 3):
            row = cells[i : i + 3] + ["|  |  |  |  "] * (3 - len(cells[i : i + 3]))
            lines.append("".join(row) + "|")
        lines += ["", f"{v.id}: {v.verdict}.", ""]
    return ["## Every validation", "", *lines] if lines else []


def _unit_label(unit: str, world: str) -> str:
    """`toy_shortcut/s13` -> `b0/s13`; `toy_shortcut_base1/s13` -> `b1/s13`."""
    experiment, seed = unit.rsplit("/s", 1)
    base = experiment[len(world) :].removeprefix("_base") if experiment != world else "0"
    return f"b{base}/s{seed}" if base.isdigit() else f"{experiment}/s{seed}"


def time_to_event(df: pd.DataFrame, spec: Mapping) -> list[tuple[str, str, str, dict]]:
    """(world, arm, event, `event_summary`) for every arm of `events.arms` with runs, in each
    world the event predictions (else the predictions) name."""
    events = spec.get("events")
    if not events:
        return []
    preds = spec.get("event_predictions") or spec["predictions"]
    rows = []
    for world in sorted({p["world"] for p in preds}):
        units = _units(df, world, None)
        for arm in events.get("arms", []):
            runs = {f"{e}/s{s}": _run(df, e, s, arm) for e, s in units}
            if all(r.empty for r in runs.values()):
                continue
            for event in (e for e in EVENTS if e in events):
                times = {
                    _unit_label(u, world): event_time(r, event, events) for u, r in runs.items()
                }
                rows.append((world, arm, event, event_summary(times, int(events["censor_at"]))))
    return rows


def time_to_event_section(rows: Sequence[tuple[str, str, str, dict]], spec: Mapping) -> list[str]:
    if not rows:
        return []
    censor = spec["events"]["censor_at"]
    note = (
        f'Units: b<k>/s<seed> (base k, RL seed). A unit reads "> {censor}" where the event had '
        f'not happened by step {censor} (right-censored); "(stopped)" marks a run that ended '
        "earlier, left out of the share and the median. The share's interval is the exact "
        "Clopper–Pearson 95% interval; the median's is the distribution-free interval between "
        "order statistics, with its exact coverage (for 6 units: the earliest to the latest "
        "unit, 96.9%). Route opens: the first validation after the start at which the metric "
        "exceeds its start by more than the threshold, and again at the next validation (at "
        "the censor step one suffices). Detector: the logged step, or the detector replayed."
    )
    return ["## Time to event", "", *event_table(rows, censor), "", note, ""]


def nested_units_section(verdicts: Sequence[Verdict], spec: Mapping) -> list[str]:
    """`sensitivity: by_base`: the note on units nested in bases and, per confirmatory
    prediction, the per-base rows and the base-stratified estimate."""
    rows = [v for v in verdicts if v.by_base is not None]
    if spec.get("sensitivity") != "by_base" or not rows:
        return []
    seeds: dict[str, set[int]] = {}
    for u in (u for v in rows for u in v.values):
        base, seed = u.rsplit("/s", 1)
        seeds.setdefault(base, set()).add(int(seed))
    bases = sorted(seeds)
    same = len({frozenset(x) for x in seeds.values()}) == 1
    units = (
        f"{len(seeds[bases[0]])} RL seeds ({', '.join(map(str, sorted(seeds[bases[0]])))}) on "
        f"each of {len(bases)} bases ({', '.join(bases)})"
        if same
        else "; ".join(f"{b}: seeds {', '.join(map(str, sorted(seeds[b])))}" for b in bases)
    )
    note = (
        f"The units are {units}: seeds nested in bases. The intervals above "
        "treat the units as exchangeable (a t-interval on n − 1 degrees of freedom). With "
        f"{len(bases)} bases no between-base variance can be estimated, so these intervals "
        "speak for these bases, not for bases in general. Below, per confirmatory prediction: "
        "the mean and 95% interval within each base (t on n_b − 1 degrees of freedom; "
        "Clopper–Pearson for a share) and the base-stratified estimate (the mean of the base "
        "means, with the pooled within-base SD). **Bases differ** marks a prediction whose "
        "base means lie on different sides of its threshold (for abs<: one within ±threshold, "
        "the other outside)."
    )
    table = [
        "| id | expect | per base: n, mean (95% CI) | stratified mean | 95% CI (df) | bases |",
        "|---|---|---|---|---|---|",
    ]
    for v in rows:
        b = v.by_base
        cells = "; ".join(
            f"{base}: {x['n']}, {x['mean']:+.3f}"
            + (f" ({_ci_text(x['ci95'])})" if x["ci95"] else "")
            for base, x in b["bases"].items()
        )
        ci = "–" if b["ci95"] is None else f"{_ci_text(b['ci95'])} ({b['dof']})"
        flag = "**bases differ**" if b["sides_differ"] else "agree"
        table.append(f"| {v.id} | {v.expect} | {cells} | {b['estimate']:+.3f} | {ci} | {flag} |")
    return ["## Units nested in bases", "", note, "", *table, ""]


def _ci_text(ci: Sequence[float]) -> str:
    return f"{ci[0]:+.3f} to {ci[1]:+.3f}"


def holm_note(spec: Mapping) -> list[str]:
    family = _as_list(spec.get("holm_family"))
    if not family:
        return []
    alpha = spec.get("holm_alpha_one_sided", 0.025)
    return [
        f"Multiple comparisons: the confirmatory family is {', '.join(family)}. The raw verdict "
        "uses the two-sided 95% interval (a one-sided p < 0.025 on the predicted side). The "
        f"Holm column applies Holm's step-down procedure at familywise one-sided α = {alpha} "
        "twice: to the family's p-values on the predicted side (Holm-confirmed) and to those "
        "on the opposite side (Holm-refuted); the adjusted p-values are given in the same order. "
        "p-values: a one-sided t-test against the threshold for > and <; for abs< the larger "
        "of the two one-sided tests (TOST) on the predicted side and the smaller of the two "
        "tests of lying outside on the opposite side; the exact binomial test for a share. "
        'Every other row is unadjusted ("–") and read as exploratory.',
        "",
    ]


def errata_section(prereg: Path) -> list[str]:
    """`ERRATA.md` beside the pre-registration, if any, under a heading of its own (its title
    line dropped, its headings one level down)."""
    errata = Path(prereg).parent / "ERRATA.md"
    if not errata.is_file():
        return []
    body = errata.read_text().splitlines()
    if body and body[0].startswith("# "):
        body = body[1:]
    body = ["#" + line if line.startswith("## ") else line for line in body]
    head = (
        f"From `{errata}`, beside the pre-registration (which is never edited); written after "
        "the results, it changes no number in this report."
    )
    return ["## Errata and reading notes", "", head, *body, ""]


def wall_time(df: pd.DataFrame) -> dict:
    """Per run the wall time it logged: the sum of `perf/step_wall_s` (each step from the end
    of the previous one's metrics, validation and checkpoints included; the setup and the
    step-0 validation are not logged by any run), its steps and last step; and the total."""
    per_run: dict[str, dict] = {}
    for run, rows in df.groupby("run", sort=True):
        logged = pd.Series(dtype=float)
        if "perf/step_wall_s" in rows.columns:
            logged = pd.to_numeric(rows["perf/step_wall_s"], errors="coerce").dropna()
        per_run[str(run)] = {
            "steps_wall_s": round(float(logged.sum()), 1) if len(logged) else None,
            "steps_timed": len(logged),
            "last_step": int(rows["step"].max()) if len(rows) else None,
        }
    timed = [r["steps_wall_s"] for r in per_run.values() if r["steps_wall_s"] is not None]
    return {
        "what": "sum of each run's logged perf/step_wall_s (steps 1 to the last); the setup "
        "and the step-0 validation are not logged by the runs and are not included",
        "runs": len(per_run),
        "runs_timed": len(timed),
        "total_s": round(float(sum(timed)), 1),
        "median_run_s": round(float(np.median(timed)), 1) if timed else None,
        "min_run_s": min(timed) if timed else None,
        "max_run_s": max(timed) if timed else None,
        "per_run": per_run,
    }


def run_time_section(wall: Mapping) -> list[str]:
    if not wall["runs_timed"]:
        return ["## Run time", "", "No run logged its wall time (`perf/step_wall_s`).", ""]
    return [
        "## Run time",
        "",
        f"{wall['runs_timed']} of {wall['runs']} runs logged their per-step wall time; it sums "
        f"to {wall['total_s']:,.0f} s ({wall['total_s'] / 3600:.1f} h), per run median "
        f"{wall['median_run_s']:,.0f} s (range {wall['min_run_s']:,.0f}–{wall['max_run_s']:,.0f} "
        "s). The setup and the step-0 validation of each run are not logged and not included; "
        "runs that ran at the same time are counted each in full (summary.json: `wall_time`).",
        "",
    ]


def _header(spec: Mapping, command: str | None, seconds: float | None, runs, df) -> list[str]:
    commit = _commit()
    return [
        f"# Collapse study: report (pre-registration version {spec.get('version')}, "
        f"{spec.get('date')})",
        "",
        f"Written by `{command or 'omgrpo study-report'}` at commit {commit or 'unknown'} on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        + (f"; wall time {seconds / 60:.1f} min." if seconds is not None else "."),
        f"{df['run'].nunique() if len(df) else 0} runs in {', '.join(map(str, runs))}.",
        "",
    ]


def _commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()


def write_study_report(
    runs: Sequence[str | Path],
    prereg: str | Path,
    out: str | Path,
    *,
    command: str | None = None,
    seconds: float | None = None,
    interim: bool = False,
    figures: bool = True,
) -> Path:
    """`out`/report.md, summary.json and figures/<world>.png for a pre-registered study;
    `interim`: the grid is incomplete, and the report says its verdicts are not interpreted;
    `figures=False` draws none (the report's figure list is then empty)."""
    spec = read_preregistration(prereg)
    out = Path(out)
    run_dirs = find_run_dirs(*runs)
    df = load_runs(*runs)
    verdicts = judge_predictions(df, spec)
    by_id = {v.id: v for v in verdicts}
    gates = _as_list(spec.get("stop_unless_confirmed"))
    failed = [g for g in gates if not by_id[g].verdict.startswith("confirmed")]
    events = time_to_event(df, spec)
    wall = wall_time(df)
    (out / "figures").mkdir(parents=True, exist_ok=True)  # only once the inputs are read
    drawn = _draw_figures(df, spec, out / "figures") if figures else []
    checks = base_checks(run_dirs)
    lines = _header(spec, command, seconds, runs, df)
    lines += _warnings(run_dirs if interim else None, [by_id[g] for g in failed])
    texts = prediction_texts(prereg)
    lines += ["## Predictions", "", verdict_table(_in_text_order(verdicts, spec, texts), texts), ""]
    lines += holm_note(spec)
    lines += errata_section(Path(prereg))
    lines += every_validation_section(verdicts)
    lines += time_to_event_section(events, spec)
    lines += nested_units_section(verdicts, spec)
    lines += run_time_section(wall) if _version(spec) >= 4 else []
    lines += what_happened(df)
    lines += process_quality_section(df, spec)
    lines += base_checks_section(checks)
    lines += mechanism_section(df)
    lines += ["## Figures", ""] + [f"![{f}](figures/{f})" for f in drawn]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    summary = {
        "preregistration": str(prereg),
        "command": command,
        "commit": _commit(),
        "seconds": seconds,
        "interim": interim,
        "stopped_by_positive_control": bool(failed),
        "verdicts": as_json(verdicts),
        "base_checks": checks,
        "mechanism": mechanism_table(df).to_dict("records"),
    }
    if events:
        summary["time_to_event"] = [
            {"world": w, "arm": a, "event": e, **row} for w, a, e, row in events
        ]
    summary["wall_time"] = wall
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return out / "report.md"


def _in_text_order(verdicts: list[Verdict], spec: Mapping, texts: Mapping) -> list[Verdict]:
    """With event predictions (judged after the others), the table follows the order of the
    pre-registration's own table (rows it does not name last); otherwise the block's order."""
    if not spec.get("event_predictions"):
        return verdicts
    order = {pid: i for i, pid in enumerate(texts)}
    return sorted(verdicts, key=lambda v: order.get(v.id, len(order)))


def _version(spec: Mapping) -> float:
    try:
        return float(spec.get("version") or 0)
    except (TypeError, ValueError):
        return 0.0
