"""The guess route's mechanism per arm, from the runs' `mech/*` metrics (study v2).

The native trainer logs them with `diagnostics.mechanism_every`
(`omgrpo.backends.native.mechanism`, docs/metrics.md). Here they become, per arm (a world's
`experiment` and a method's `variant`, over its seeds):

- `mechanism_table`: through which tokens the step's updates moved P(box "1") -- the mean per
  probe step of the answer-token part, the other-token part and the momentum part of that
  change -- and the gates at the first and the last probe;
- `gates_table`: the two gates at every probe step;
- `mechanism_section`: both as the Markdown section of a study report.

Each value is first averaged over a run's probe steps (or taken at its first / last probe),
then over the arm's runs. Where the runs log per-difficulty values (`<metric>_hard`) the
`difficulty` ones are used: the guess route opens on the hard problems.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

__all__ = ["gates_table", "mechanism_section", "mechanism_table", "route"]

PARTS = ("answer", "other", "history")
ARM = ["experiment", "variant"]
PROBE = "mech/p_box1"  # logged at every probe step


def _name(df: pd.DataFrame, metric: str, difficulty: str | None) -> str:
    """`mech/<metric>_<difficulty>` when the frame has it, else `mech/<metric>`."""
    split = f"mech/{metric}_{difficulty}"
    return split if difficulty and split in df.columns else f"mech/{metric}"


def route(answer: float, other: float) -> str:
    """Which tokens' gradient raised P(box "1"): the part with the larger positive mean change
    per probe step (`answer tokens`, `other tokens`), `none` when neither raised it."""
    if not answer > 0 and not other > 0:
        return "none"
    return "answer tokens" if answer >= other or math.isnan(other) else "other tokens"


def _probes(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of probe steps, sorted by run and step (empty without `mech/*`)."""
    if PROBE not in df.columns:
        return df.iloc[0:0]
    return df[df[PROBE].notna()].sort_values(["run", "step"])


def mechanism_table(df: pd.DataFrame, difficulty: str | None = "hard") -> pd.DataFrame:
    """One row per arm whose runs logged `mech/*`: `runs`; `probes` (per run, mean); the mean
    change of P(box "1") per probe step, `d_box1_<part>` for `full` and each part, and
    `answer_share` = answer / (|answer| + |other|); `route` (`route`); P(box "1"), the guess
    gate, the truncation gate and the computed-lead share at the first and the last probe
    (`<metric>_first`, `<metric>_last`); `leak_cos` (mean over probes) and `kl_answer` (at
    the last probe)."""
    rows = _probes(df)
    if rows.empty:
        return pd.DataFrame()
    names = {m: _name(rows, m, difficulty) for m in ("p_box1", "gate_first", "gate_stop")}
    names["computed_lead"] = _name(rows, "computed_lead", difficulty)
    deltas = {p: _name(rows, f"d_box1_{p}", difficulty) for p in ("full", *PARTS)}
    per_run = []
    for (experiment, variant, run), part in rows.groupby([*ARM, "run"], sort=True):
        rec = {"experiment": experiment, "variant": variant, "run": run, "probes": len(part)}
        rec |= {f"d_box1_{p}": part[c].mean() for p, c in deltas.items() if c in part}
        for m, c in names.items():
            values = part[c].dropna() if c in part else pd.Series(dtype=float)
            rec[f"{m}_first"] = values.iloc[0] if len(values) else np.nan
            rec[f"{m}_last"] = values.iloc[-1] if len(values) else np.nan
        rec["leak_cos"] = part["mech/leak_cos"].mean() if "mech/leak_cos" in part else np.nan
        kl = part["mech/kl_answer"].dropna() if "mech/kl_answer" in part else []
        rec["kl_answer"] = kl.iloc[-1] if len(kl) else np.nan
        per_run.append(rec)
    runs = pd.DataFrame(per_run)
    out = runs.groupby(ARM, sort=True).mean(numeric_only=True)
    out.insert(0, "runs", runs.groupby(ARM, sort=True)["run"].nunique())
    answer, other = out.get("d_box1_answer"), out.get("d_box1_other")
    if answer is not None and other is not None:
        out["answer_share"] = answer / (answer.abs() + other.abs())
        out["route"] = [route(a, o) for a, o in zip(answer, other)]
    return out.reset_index()


def gates_table(df: pd.DataFrame, difficulty: str | None = "hard") -> pd.DataFrame:
    """Rows: arms; columns: probe steps; cells: "guess gate / truncation gate" (mean over the
    arm's runs at that step)."""
    rows = _probes(df)
    if rows.empty:
        return pd.DataFrame()
    first, stop = _name(rows, "gate_first", difficulty), _name(rows, "gate_stop", difficulty)
    means = rows.groupby([*ARM, "step"], sort=True)[[first, stop]].mean()
    cells = means.apply(lambda r: f"{_fmt(r[first])} / {_fmt(r[stop])}", axis=1)
    return cells.unstack("step").reset_index()


def _fmt(x: float, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:+.4f}" if signed else f"{x:.2f}"


def _markdown(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in body),
    ]


def mechanism_section(df: pd.DataFrame, difficulty: str | None = "hard") -> list[str]:
    """Markdown lines: the "Mechanism" section of a study report (nothing when no run logged
    `mech/*`)."""
    table = mechanism_table(df, difficulty)
    if table.empty:
        return []
    body = [
        [
            f"{r.experiment} / {r.variant}",
            str(int(r.runs)),
            *(_fmt(getattr(r, f"d_box1_{p}", math.nan), signed=True) for p in ("full", *PARTS)),
            str(getattr(r, "route", "–")),
            *(
                f"{_fmt(getattr(r, f'{m}_first'))} → {_fmt(getattr(r, f'{m}_last'))}"
                for m in ("p_box1", "gate_first", "gate_stop", "computed_lead")
            ),
            _fmt(r.leak_cos, signed=True),
        ]
        for r in table.itertuples()
    ]
    header = ["arm", "runs", "ΔP full", "ΔP answer", "ΔP other", "ΔP momentum", "route"]
    header += ["P(box 1)", "guess gate", "truncation gate", "computed 1…", "leak cos"]
    gates = gates_table(df, difficulty)
    steps = [c for c in gates.columns if c not in ARM]
    gate_rows = [
        [f"{r['experiment']} / {r['variant']}", *map(str, r[steps])] for _, r in gates.iterrows()
    ]
    scope = f"{difficulty} problems" if difficulty else "all problems"
    return [
        "## Mechanism",
        "",
        f'Through which tokens each arm\'s updates moved P(box "1") ({scope} where logged; '
        '`mech/*`, docs/metrics.md). ΔP: the mean change of P(box exactly "1") per probe step '
        "at fixed held-out prefixes (question + the base's own reasoning up to `\\boxed{`), "
        "split into the parts of the real AdamW step from the answer-span tokens' gradient, "
        "the other tokens' gradient and the momentum of earlier steps (their parts carried "
        "on, so the route is read from the step's own two parts); route: the part that "
        'raised it more. Gates (teacher-forced on gold reasoning) and P(box "1") at the first '
        '→ last probe: the guess gate p(first digit "1") where the gold value starts '
        'otherwise, the truncation gate p(stop after a leading "1") where it goes on; '
        'computed 1…: share of rollouts whose last computed value starts with "1".',
        "",
        *_markdown(header, body),
        "",
        "Guess gate / truncation gate at each probe step:",
        "",
        *_markdown(["arm", *map(str, steps)], gate_rows),
        "",
    ]
