"""The paper's tables from benchmark evaluations (`omgrpo eval` summaries), as markdown and
LaTeX (booktabs): `omgrpo tables RUNS_OR_EVALS... --out DIR`.

| table | rows | columns |
|---|---|---|
| `main` | GT, OM-GRPO, MV, Self-Certainty, Entropy, CoReward | avg@k per benchmark, Avg. |
| `pass_at_k` | the same | pass@k per benchmark (k = the benchmark's samples) |
| `ttt` | Before TTRL (`--checkpoint base`), then each method after | avg@k and pass@k, Avg. |
| `ablations` | OM-GRPO and its ablations (+ GT, MV) | avg@k per benchmark, Avg. |
| `car_vs_n` | OM-GRPO (CAR, n = 8) vs w/o CAR n = 8 / 16 / 64 | avg@k, Avg., s/step, total |

A cell is mean ± 95% CI half-width (Student t) over seeds; with one seed it is the value ±
half the bootstrap 95% interval over problems, marked †. Values are percent. A missing cell
names the command that fills it. Rows are (scale, experiment, variant) so runs of different
sweeps are not averaged together; test-time-training runs only enter the `ttt` table.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from omgrpo.analysis.load import aggregate_seeds
from omgrpo.analysis.provenance import provenance_lines
from omgrpo.analysis.tables import markdown_table
from omgrpo.errors import InputError
from omgrpo.staging import staged_files
from omgrpo.tracking.store import RunStore

LABELS = {
    "gt": "GT-Reward",
    "om_grpo": "OM-GRPO",
    "mv": "Majority Voting",
    "self_certainty": "Self-Certainty",
    "entropy": "Entropy",
    "coreward": "CoReward",
    "om_grpo_no_soft": "w/o Soft Reward",
    "om_grpo_no_car": "w/o CAR",
    "om_grpo_no_omu": "w/o OMU",
    "om_grpo_no_car_no_omu": "w/o CAR and OMU",
    "om_grpo_no_car_n8": "w/o CAR (n=8)",
    "om_grpo_no_car_n16": "w/o CAR (n=16)",
    "om_grpo_no_car_n64": "w/o CAR (n=64)",
}
MAIN = ("gt", "om_grpo", "mv", "self_certainty", "entropy", "coreward")
ABLATIONS = (
    "om_grpo",
    "om_grpo_no_soft",
    "om_grpo_no_car",
    "om_grpo_no_omu",
    "om_grpo_no_car_no_omu",
    "gt",
    "mv",
)
CAR_VS_N = ("om_grpo", "om_grpo_no_car_n8", "om_grpo_no_car_n16", "om_grpo_no_car_n64")
TTT = ("mv", "om_grpo")
SWEEP = {
    "main": "main_table",
    "pass_at_k": "main_table",
    "ablations": "ablations",
    "car_vs_n": "car_vs_n",
    "ttt": "ttt",
}
TITLES = {
    "main": "Main results (avg@k, %)",
    "pass_at_k": "Pass@k (%)",
    "ttt": "Test-time training: before -> after (%)",
    "ablations": "Ablations (avg@k, %)",
    "car_vs_n": "CAR vs more rollouts (avg@k, %, time per step)",
}
DAGGER = "†"


@dataclass
class EvalTable:
    name: str
    title: str
    frame: pd.DataFrame  # the displayed cells (strings)
    notes: list[str]

    @property
    def markdown(self) -> str:
        return markdown_table(self.frame) + "".join(f"\n\n{n}" for n in self.notes)

    @property
    def latex(self) -> str:
        return latex_table(self.frame, self.title, self.notes)


# ----------------------------------------------------------------------------------------
# Loading summaries
# ----------------------------------------------------------------------------------------
def find_summaries(*sources: str | Path) -> list[Path]:
    """`summary.json` files written by `omgrpo eval` in or under `sources` (run directories,
    evaluation directories, or folders of them)."""
    found = []
    for source in sources:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        candidates = [path] if path.is_file() else path.rglob("summary.json")
        for p in candidates:
            if _is_eval_summary(p):
                found.append(p.resolve())
            elif path.is_file():  # named on the command line: never skipped silently
                raise InputError(
                    "not an `omgrpo eval` summary",
                    file=p,
                    expected="keys suite, benchmarks, checkpoint",
                )
    return sorted(set(found))


def _is_eval_summary(path: Path) -> bool:
    """Whether `path` is an eval summary; a summary.json that does not parse (truncated, a
    run killed while writing it) is named (InputError), never skipped: skipping it dropped
    that seed from the tables without a word."""
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(
            f"unreadable ({e}); evaluate again (`omgrpo eval`) or remove it", file=path
        ) from e
    return isinstance(data, dict) and {"suite", "benchmarks", "checkpoint"} <= set(data)


def _check_fraction(value: Any, path: Path, key: str, nan: bool = False) -> None:
    """avg@k, pass@k and their interval's bounds are fractions: a value outside [0, 1] (1e308,
    -0.5, inf, text; nan except in an interval) is a damaged or foreign summary, refused naming
    it rather than averaged into a table."""
    number = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if number and math.isnan(value) and nan:
        return
    if not number or not 0 <= value <= 1:  # nan fails both comparisons
        raise InputError(file=path, key=key, found=value, expected="a fraction in [0, 1]")


def load_evals(*sources: str | Path) -> pd.DataFrame:
    """One row per (evaluation, benchmark): run identity, suite, checkpoint, benchmark, k,
    avg@k and pass@k with their bootstrap intervals, run directory."""
    rows = []
    for path in find_summaries(*sources):
        data = json.loads(path.read_text())
        run = data.get("run") or {}
        if not isinstance(run, dict) or not isinstance(data["benchmarks"], dict):
            raise InputError("malformed summary", file=path, key="run / benchmarks")
        if not isinstance(data["checkpoint"], dict) or "name" not in data["checkpoint"]:
            raise InputError("malformed summary", file=path, key="checkpoint")
        for bench, entry in data["benchmarks"].items():
            try:
                k = int(entry["k"])
                metrics, ci = entry["metrics"], entry["ci95"]
                for name in (f"avg@{k}", f"pass@{k}"):
                    if name not in metrics or name not in ci:
                        raise KeyError(name)
            except (KeyError, TypeError, ValueError) as e:
                raise InputError(
                    f"malformed entry ({type(e).__name__}: {e})",
                    file=path,
                    key=f"benchmarks.{bench}",
                    expected="k, metrics and ci95 with avg@k and pass@k",
                ) from e
            for name in (f"avg@{k}", f"pass@{k}"):
                _check_fraction(metrics[name], path, f"benchmarks.{bench}.metrics.{name}")
                interval = ci[name]
                if not isinstance(interval, list | tuple) or len(interval) != 2:
                    raise InputError(
                        file=path,
                        key=f"benchmarks.{bench}.ci95.{name}",
                        found=interval,
                        expected="[low, high], each in [0, 1]",
                    )
                for bound in interval:
                    _check_fraction(bound, path, f"benchmarks.{bench}.ci95.{name}", nan=True)
            rows.append(
                {
                    "summary": str(path),
                    "label": path.parent.name,
                    "suite": data["suite"],
                    "run_dir": data.get("target"),
                    "run": run.get("name") or run.get("model"),
                    "experiment": run.get("experiment"),
                    "variant": run.get("variant") or run.get("model"),
                    "method": run.get("method"),
                    "scale": run.get("scale", "model"),
                    "seed": run.get("seed"),
                    "ttt": bool(run.get("ttt")),
                    "checkpoint": data["checkpoint"]["name"],
                    "step": data["checkpoint"]["step"],
                    "benchmark": bench,
                    "k": k,
                    "avg": metrics[f"avg@{k}"],
                    "avg_ci": ci[f"avg@{k}"],
                    "pass": metrics[f"pass@{k}"],
                    "pass_ci": ci[f"pass@{k}"],
                }
            )
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    # The same evaluation can be found twice (its copy in an MLflow artifact store): keep one,
    # preferring the copy inside the evaluated run directory.
    df["_home"] = [
        str(Path(s).parent.parent.parent) == str(t) for s, t in zip(df["summary"], df["run_dir"])
    ]
    df = df.sort_values("_home", ascending=False, kind="stable")
    df = df.drop_duplicates(["run_dir", "label", "benchmark"]).drop(columns="_home")
    return df.sort_index().reset_index(drop=True)


# ----------------------------------------------------------------------------------------
# Cells
# ----------------------------------------------------------------------------------------
def _cell(values: pd.DataFrame, metric: str) -> tuple[str, float]:
    """(text, mean) of one cell from the rows of its seeds."""
    if len(values) == 1:
        lo, hi = values[f"{metric}_ci"].iloc[0]
        mean = float(values[metric].iloc[0])
        return f"{100 * mean:.2f} ± {100 * (hi - lo) / 2:.2f}{DAGGER}", mean
    agg = aggregate_seeds(values.assign(_g=0), metric, by=["_g"]).iloc[0]
    return f"{100 * agg['mean']:.2f} ± {100 * agg['ci95']:.2f}", float(agg["mean"])


def _eval_cmd(suite: str, checkpoint: str, runs: Iterable[str]) -> str:
    ck = "" if checkpoint == "last" else f" --checkpoint {checkpoint}"
    return f"missing: `omgrpo eval {' '.join(sorted(set(runs)))} --suite {suite}{ck}`"


def _sweep_cmd(table: str, suite: str) -> str:
    return f"missing: `omgrpo sweep sweeps/{SWEEP[table]}.yaml --eval {suite}`"


def _rows_table(
    df: pd.DataFrame,
    part: pd.DataFrame,
    name: str,
    methods: Sequence[str],
    metrics: Sequence[str],
    suite: str,
    checkpoint: str,
    extra: dict[str, dict[tuple, str]] | None = None,
) -> EvalTable:
    """Rows per (scale, experiment, variant) of `methods` (in that order) from `part`, a column
    per (benchmark of the suite's evaluations `df`, metric), the average over benchmarks of the
    first metric, and `extra` columns by row key."""
    benchmarks = list(dict.fromkeys(df["benchmark"])) if not df.empty else []
    columns = ["method", "seeds"]
    columns += [f"{b} {m}@{_k(df, b)}" for b in benchmarks for m in metrics]
    columns += ["Avg.", *(extra or {})]
    part = part[part["variant"].isin(methods)] if not part.empty else part
    rows: list[dict[str, str]] = []
    keys = (
        part[["scale", "experiment", "variant"]].drop_duplicates().itertuples(index=False)
        if not part.empty
        else []
    )
    keys = sorted(keys, key=lambda r: (str(r[0]), str(r[1]), methods.index(r[2])))
    show_exp = len({k[1] for k in keys}) > 1 or len({k[0] for k in keys}) > 1
    for key in keys:
        scale, experiment, variant = key
        sub = part[
            (part["scale"] == scale)
            & (part["experiment"] == experiment)
            & (part["variant"] == variant)
        ]
        label = LABELS.get(variant, variant)
        row = {"method": f"{label} ({scale}/{experiment})" if show_exp else label}
        row["seeds"] = str(sub["seed"].nunique())
        means = []
        for bench in benchmarks:
            cells = sub[sub["benchmark"] == bench]
            for metric in metrics:
                col = f"{bench} {metric}@{_k(df, bench)}"
                if cells.empty:
                    row[col] = _eval_cmd(suite, checkpoint, sub["run_dir"])
                    continue
                row[col], mean = _cell(cells, metric)
                if metric == metrics[0]:
                    means.append(mean)
        row["Avg."] = f"{100 * np.mean(means):.2f}" if len(means) == len(benchmarks) else ""
        for col, by_key in (extra or {}).items():
            row[col] = by_key.get(tuple(key), "")
        rows.append(row)
    present = {k[2] for k in keys}
    for variant in methods:
        if variant not in present:
            command = _sweep_cmd(name, suite)
            row = {c: command for c in columns[2 : -1 - len(extra or {})]} or {"Avg.": command}
            rows.append({"method": LABELS.get(variant, variant), "seeds": "0", **row})
    frame = pd.DataFrame(rows, columns=columns).fillna("")
    return EvalTable(name, TITLES[name], frame, _notes(suite, checkpoint))


def _k(df: pd.DataFrame, bench: str) -> int:
    return int(df.loc[df["benchmark"] == bench, "k"].iloc[0])


def _notes(suite: str, checkpoint: str) -> list[str]:
    return [
        f"Suite `{suite}`, checkpoint `{checkpoint}`. mean ± 95% CI half-width (Student t) over "
        f"seeds; {DAGGER} one seed: ± half the bootstrap 95% interval over problems."
    ]


# ----------------------------------------------------------------------------------------
# The tables
# ----------------------------------------------------------------------------------------
def _select(df: pd.DataFrame, suite: str, checkpoint: str, ttt: bool) -> pd.DataFrame:
    return df[(df["suite"] == suite) & (df["checkpoint"] == checkpoint) & (df["ttt"] == ttt)]


def main_table(df, suite, checkpoint="last") -> EvalTable:
    part = _select(df, suite, checkpoint, False)
    return _rows_table(_of(df, suite), part, "main", MAIN, ["avg"], suite, checkpoint)


def pass_at_k_table(df, suite, checkpoint="last") -> EvalTable:
    part = _select(df, suite, checkpoint, False)
    return _rows_table(_of(df, suite), part, "pass_at_k", MAIN, ["pass"], suite, checkpoint)


def ablations_table(df, suite, checkpoint="last") -> EvalTable:
    part = _select(df, suite, checkpoint, False)
    return _rows_table(_of(df, suite), part, "ablations", ABLATIONS, ["avg"], suite, checkpoint)


def _of(df: pd.DataFrame, suite: str) -> pd.DataFrame:
    return df[df["suite"] == suite]


def car_vs_n_table(df, suite, checkpoint="last") -> EvalTable:
    """avg@k next to the mean seconds per training step and the total training time, from the
    runs' metrics.jsonl (`time/step`), averaged over seeds."""
    part = _select(df, suite, checkpoint, False)
    step_s: dict[tuple, str] = {}
    total: dict[tuple, str] = {}
    if not part.empty:
        for key, sub in part.groupby(["scale", "experiment", "variant"]):
            per_run = [_step_times(d) for d in sub["run_dir"].dropna().unique()]
            per_run = [t for t in per_run if t is not None]
            if per_run:
                step_s[key] = f"{np.mean([t.mean() for t in per_run]):.2f}"
                total[key] = f"{np.mean([t.sum() for t in per_run]) / 60:.1f}"
    extra = {"time/step (s)": step_s, "train time (min)": total}
    return _rows_table(
        _of(df, suite), part, "car_vs_n", CAR_VS_N, ["avg"], suite, checkpoint, extra
    )


def _step_times(run_dir: str) -> pd.Series | None:
    m = RunStore(run_dir).read_metrics()  # a damaged metrics file is named, not left out
    if "time/step" not in m.columns:
        return None
    t = pd.to_numeric(m["time/step"], errors="coerce").dropna()
    return t if len(t) else None


def ttt_table(df, suite, checkpoint="last") -> EvalTable:
    """'Before TTRL' = the base model of the TTT runs (`--checkpoint base`, pooled over
    methods: they share it), then each method after training."""
    before = _select(df, suite, "base", True)
    after = _select(df, suite, checkpoint, True)
    metrics = ["avg", "pass"]
    table = _rows_table(_of(df, suite), after, "ttt", TTT, metrics, suite, checkpoint)
    if before.empty:
        runs = after["run_dir"] if not after.empty else pd.Series(["runs/ttt__*"])
        command = _eval_cmd(suite, "base", runs)
        row = {c: command for c in table.frame.columns[2:-1]} or {"Avg.": command}
        row |= {"method": "Before TTRL", "seeds": "0"}
    else:
        pooled = before.assign(variant="before", experiment="ttt", scale="")
        first = _rows_table(_of(df, suite), pooled, "ttt", ("before",), metrics, suite, "base")
        row = first.frame.iloc[0].to_dict() | {"method": "Before TTRL"}
    columns = list(table.frame.columns)
    table.frame = pd.concat([pd.DataFrame([row]), table.frame], ignore_index=True)
    table.frame = table.frame[columns].fillna("")
    return table


TABLES = {
    "main": main_table,
    "pass_at_k": pass_at_k_table,
    "ttt": ttt_table,
    "ablations": ablations_table,
    "car_vs_n": car_vs_n_table,
}


def all_eval_tables(df: pd.DataFrame, checkpoint: str = "last") -> dict[str, EvalTable]:
    """Every table, for each suite found (name `<table>` for one suite, `<suite>/<table>`
    for several)."""
    suites = list(dict.fromkeys(df["suite"])) if not df.empty else []
    out = {}
    for suite in suites:
        for name, fn in TABLES.items():
            key = name if len(suites) == 1 else f"{suite}/{name}"
            out[key] = fn(df, suite, checkpoint)
    return out


def write_tables(sources: Sequence[str | Path], out_dir: str | Path, checkpoint="last") -> Path:
    """`tables.md` (every table) and `<table>.md` / `<table>.tex` per table in `out_dir`."""
    df = load_evals(*sources)
    if df.empty:
        raise FileNotFoundError(
            f"no `omgrpo eval` summary (eval/*/summary.json) in {', '.join(map(str, sources))}; "
            "run `omgrpo eval RUN --suite toy|paper` first"
        )
    out = Path(out_dir)
    tables = all_eval_tables(df, checkpoint)
    with staged_files(out) as tmp:  # all or nothing; other files in `out` are kept
        for key, table in tables.items():
            stem = key.replace("/", "__")
            (tmp / f"{stem}.md").write_text(f"## {table.title}\n\n{table.markdown}\n")
            (tmp / f"{stem}.tex").write_text(table.latex + "\n")
        head = ["# Tables from benchmark evaluations", "", *provenance_section(df)]
        (tmp / "tables.md").write_text("\n".join([*head, *_markdown(tables)]))
    return out / "tables.md"


def provenance_section(df: pd.DataFrame) -> list[str]:
    """Provenance lines of the evaluated runs, one per suite (the runs its tables compare);
    warns when a suite's runs come from different commits."""
    lines = []
    for suite, part in df.groupby("suite", sort=False):
        dirs = [d for d in dict.fromkeys(part["run_dir"]) if isinstance(d, str) and d]
        lines += [f"- {line}" for line in provenance_lines({f"suite {suite}": dirs})]
    return ["Provenance of the evaluated runs:", "", *lines, ""] if lines else []


def eval_tables_section(sources: Sequence[str | Path], checkpoint: str = "last") -> list[str]:
    """Markdown lines of the benchmark tables for `omgrpo report` (nothing without evals)."""
    df = load_evals(*sources)
    if df.empty:
        return []
    tables = all_eval_tables(df, checkpoint)
    head = ["## Benchmark evaluations (`omgrpo eval`)", "", *provenance_section(df)]
    return [*head, *_markdown(tables, level="###")]


def _markdown(tables: dict[str, EvalTable], level: str = "##") -> list[str]:
    lines = []
    for key, table in tables.items():
        suffix = f" ({key})" if "/" in key else ""
        lines += [f"{level} {table.title}{suffix}", "", table.markdown, ""]
    return lines


# ----------------------------------------------------------------------------------------
# LaTeX
# ----------------------------------------------------------------------------------------
_TEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\^{}",
}


def _tex(text: str) -> str:
    text = "".join(_TEX.get(c, c) for c in str(text))
    return (
        text.replace("±", r"$\pm$")
        .replace(DAGGER, r"$^\dagger$")
        .replace("`", "")
        .replace("->", r"$\to$")
    )


def latex_table(frame: pd.DataFrame, title: str, notes: Sequence[str] = ()) -> str:
    """A booktabs table (needs `\\usepackage{booktabs}`)."""
    cols = "l" + "c" * (len(frame.columns) - 1)
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        rf"\caption{{{_tex(title)}}}",
        rf"\begin{{tabular}}{{{cols}}}",
        r"\toprule",
        " & ".join(_tex(c) for c in frame.columns) + r" \\",
        r"\midrule",
    ]
    for row in frame.itertuples(index=False):
        lines.append(" & ".join(_tex(v) for v in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += [rf"\par\footnotesize {_tex(n)}" for n in notes]
    lines.append(r"\end{table}")
    return "\n".join(lines)
