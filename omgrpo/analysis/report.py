"""`write_report(run_dirs, out_dir)`: one markdown report of a set of runs.

out_dir/report.md      title, per-run table with a collapse verdict, the tables, the
                       benchmark tables when the runs have `omgrpo eval` summaries, the
                       figures that could be drawn (and why the others could not), and
                       every run's resolved config (collapsed)
out_dir/figures/       the figures, PNG + PDF
out_dir/problems.csv, problems_fates.csv
                       each validation problem's fate and the counts per run, where the runs
                       wrote `problems.parquet` (`omgrpo.analysis.problems`)
out_dir/summary.json   per run and per method (variant, over seeds): peak and final val acc,
                       final unique answers per prompt, final batch-mode share, collapse step;
                       per run the first and last value of each validation metric it logged
"""

from __future__ import annotations

import datetime as _dt
import json
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pandas as pd

from omgrpo.analysis.figures import TITLES, all_figures, problem_fates
from omgrpo.analysis.load import (
    DEGRADE_DROP,
    REWARD_WINDOW,
    collapse_step,
    config_text,
    find_run_dirs,
    load_rollouts,
    load_runs,
    read_status,
    verdict,
)
from omgrpo.analysis.paper_tables import eval_tables_section
from omgrpo.analysis.problems import (
    FATES_FILE,
    PROBLEMS_FILE,
    RIGHT,
    classify_problems,
    fate_counts,
    load_problems,
)
from omgrpo.analysis.provenance import provenance_lines
from omgrpo.analysis.tables import (
    TABLE_TITLES,
    Table,
    all_tables,
    markdown_table,
    run_summary,
)
from omgrpo.core.diagnostics import COLLAPSE_DEFAULTS
from omgrpo.staging import staged_files
from omgrpo.tracking.store import RunStore

FIGURE_CAPTION = (
    "Curves are means over seeds (the legend gives n). With n ≥ 3 the band is the 95% CI of "
    "the mean (Student t); with n = 2 thin lines show each seed instead; bands and axes stay "
    "within each metric's range (accuracies and shares in [0, 1], counts ≥ 0)."
)


def _fmt(value, percent: bool = False) -> str:
    if value is None or pd.isna(value):
        return "–"
    return f"{value * 100:.1f}%" if percent else f"{value:.2f}"


def write_report(
    run_dirs: str | Path | Iterable[str | Path], out_dir: str | Path, *, title: str | None = None
) -> Path:
    """Write `out_dir/report.md` (+ `out_dir/figures/`) for the runs in `run_dirs` (run
    directories or folders of them); returns the report's path. Every run found is named in
    the report, including runs that have not logged a step yet."""
    if isinstance(run_dirs, str | Path):
        run_dirs = [run_dirs]
    sources = [Path(p) for p in run_dirs]
    dirs = find_run_dirs(*sources)
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    df = load_runs(*sources)
    check_metric_values(df)
    rollouts = load_rollouts(sources)
    # all or nothing: written aside, moved into out_dir (its other files kept) at the end
    with staged_files(out_dir) as tmp:
        figures = all_figures(df, tmp / "figures", rollouts=rollouts)
        fates = problems_tables(dirs, tmp, figures)
        lines = _report_lines(df, dirs, sources, figures, out_dir, title, tmp, fates)
        (tmp / "report.md").write_text("\n".join(lines))
        (tmp / "summary.json").write_text(json.dumps(report_summary(df), indent=2) + "\n")
    from omgrpo.tracking.artifacts import log_report_artifacts

    log_report_artifacts(dirs, out_dir)  # to each run's MLflow run, where it has one
    return out_dir / "report.md"


def check_out_dir(out_dir: Path, flag: str = "--out") -> None:
    """An output folder that is a file is refused before any work (InputError)."""
    from omgrpo.errors import InputError

    if out_dir.exists() and not out_dir.is_dir():
        raise InputError("not a folder", file=out_dir, key=flag, expected="an output folder")


def _report_lines(
    df: pd.DataFrame,
    dirs: Sequence[Path],
    sources: Sequence[Path],
    figures: Mapping[str, list[Path] | str],
    out_dir: Path,
    title: str | None,
    staged: Path,
    fates: pd.DataFrame | None = None,
) -> list[str]:
    """report.md's lines (`staged`: where the figures are until they move to out_dir; `fates`:
    the problem fate counts, `problems_tables`)."""
    tables = all_tables(df)
    lines: list[str] = []
    lines.append(f"# {title or 'omgrpo report: ' + out_dir.resolve().name}")
    lines.append("")
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines.append(
        f"{len(dirs)} run(s) from {', '.join(f'`{s}`' for s in sources)}; generated {now} by "
        "`omgrpo report`. Values are fractions of 1 unless marked %."
    )
    lines.append("")
    lines += _runs_section(df, dirs)
    lines += provenance_section(dirs)
    lines += what_happened(df)
    lines += base_checks_section(base_checks(dirs))  # the toy bases' acceptance checks
    lines += _tables_section(tables)
    lines += problems_section(fates)
    lines += eval_tables_section(sources)  # benchmark evaluations (omgrpo eval), if any
    lines += _figures_section(figures, staged)
    lines += _configs_section(dirs)
    return lines


def _runs_section(df: pd.DataFrame, dirs: Sequence[Path]) -> list[str]:
    """## Runs: one row per run directory (also runs without a logged step), with its verdict."""
    lines = ["## Runs", ""]
    summary = run_summary(df).set_index("run") if not df.empty else pd.DataFrame()
    rows = []
    for run_dir in dirs:
        status = read_status(run_dir)
        part = df[df["run_dir"] == str(run_dir)] if not df.empty else df
        name = str(part["run"].iloc[0]) if len(part) else _run_name(run_dir)
        s = summary.loc[name] if name in summary.index else None
        total = status.get("total_steps")
        steps = "0" if s is None else str(int(s["steps"]))
        rows.append(
            {
                "run": f"`{name}`",
                "method": "–" if s is None else s["method"],
                "seed": "–" if s is None else str(s["seed"]),
                "steps": steps + (f"/{total}" if total else ""),
                "state": status.get("state", "?"),
                "final val/acc": _fmt(None if s is None else s["final val/acc"], True),
                "peak val/acc": _fmt(None if s is None else s["peak val/acc"], True),
                "final unique/prompt": _fmt(None if s is None else s["final unique/prompt"]),
                "final batch-mode share": _fmt(None if s is None else s["final batch-mode share"]),
                "verdict": verdict(part, status) if len(part) else "no steps logged yet",
            }
        )
    lines.append(markdown_table(pd.DataFrame(rows)))
    lines += [
        "",
        "Verdict: `collapse/detected_step` when the trainer logged it, else "
        "`omgrpo.core.diagnostics.CollapseDetector` "
        f"(≤ {COLLAPSE_DEFAULTS['max_unique_per_prompt']:g} answers per prompt and the batch's top "
        f"answer in ≥ {COLLAPSE_DEFAULTS['min_mode_share']:.0%} of rollouts for "
        f"{COLLAPSE_DEFAULTS['patience']} consecutive steps) replayed over the metrics; a run "
        f"that did not collapse but whose val/acc fell by more than {DEGRADE_DROP:.2f} from its "
        "first evaluation to its last is `reward hacked` when its training reward "
        f"(`reward/total`, first vs last {REWARD_WINDOW} steps) rose, else `degraded` "
        "(`omgrpo.analysis.load.degradation`).",
        "",
    ]
    return lines


def _tables_section(tables: Mapping[str, Table | str]) -> list[str]:
    """## Tables: each table, or why it is not available."""
    lines = ["## Tables", ""]
    for name, table in tables.items():
        if isinstance(table, Table):
            lines += [f"### {table.title}", "", table.markdown, ""]
        else:
            lines += [f"### {TABLE_TITLES.get(name, name)}", "", f"Not available: {table}", ""]
    return lines


def problems_tables(
    dirs: Sequence[Path], out_dir: Path, figures: dict[str, list[Path] | str]
) -> pd.DataFrame | None:
    """Each problem's fate (`omgrpo.analysis.problems`) over the runs that wrote
    `problems.parquet`: `out_dir/problems.csv` (per run and problem), `problems_fates.csv`
    (counts per run) and the figure `problem_fates` (added to `figures`, or why not); returns
    the counts (None: no run wrote the table)."""
    history = load_problems(dirs) if dirs else pd.DataFrame()
    if history.empty:
        figures["problem_fates"] = (
            "no run has problems.parquet (the trainers write it at each validation since issue 39)"
        )
        return None
    fates = classify_problems(history)
    counts = fate_counts(fates)
    fates.to_csv(out_dir / PROBLEMS_FILE, index=False)
    counts.to_csv(out_dir / FATES_FILE, index=False)
    figures["problem_fates"] = problem_fates(counts, out_dir / "figures")
    return counts


def problems_section(counts: pd.DataFrame | None) -> list[str]:
    """## Problems: the fate counts per run, and how a fate is defined."""
    if counts is None:
        return []
    return [
        "## Problems",
        "",
        "Each validation problem's fate from the run's first to its last validation "
        f"(`problems.parquet`): right = accuracy ≥ {RIGHT:g} over its k samples; learned "
        "(wrong → right), forgotten (right → wrong), sharpened (right at both, higher modal-answer "
        "share), always (right at both, not sharpened), never (wrong at both). Per problem: "
        f"[{PROBLEMS_FILE}]({PROBLEMS_FILE}); counts: [{FATES_FILE}]({FATES_FILE}).",
        "",
        markdown_table(counts),
        "",
    ]


def _figures_section(figures: Mapping[str, list[Path] | str], out_dir: Path) -> list[str]:
    """## Figures: each figure drawn (PNG inline, PDF linked), then those not drawn and why."""
    lines = ["## Figures", "", FIGURE_CAPTION, ""]
    missing = {}
    for name, result in figures.items():
        if isinstance(result, str):
            missing[name] = result
            continue
        png = next(p for p in result if p.suffix == ".png")
        pdf = next(p for p in result if p.suffix == ".pdf")
        rel_png = os.path.relpath(png, out_dir)
        rel_pdf = os.path.relpath(pdf, out_dir)
        lines += [
            f"### {TITLES.get(name, name)}",
            "",
            f"![{name}]({rel_png})",
            "",
            f"[PDF]({rel_pdf})",
            "",
        ]
    if missing:
        lines += ["### Figures not drawn", ""]
        for name, reason in missing.items():
            lines.append(f"- **{TITLES.get(name, name)}** (`{name}`): {reason}")
        lines.append("")
    return lines


def provenance_section(dirs: Sequence[Path]) -> list[str]:
    """## Provenance: one line per experiment (run group); a warning line when the runs come
    from different commits (the report's tables compare them all)."""
    groups: dict[str, list[Path]] = {}
    for run_dir in dirs:
        try:
            experiment = (_read_config(run_dir).get("run") or {}).get("experiment")
        except (OSError, ValueError):
            experiment = None
        groups.setdefault(str(experiment or "runs"), []).append(run_dir)
    lines = provenance_lines(groups)
    return ["## Provenance", "", *(f"- {line}" for line in lines), ""]


def _configs_section(dirs: Sequence[Path]) -> list[str]:
    """## Configs: each run's config.yaml, folded."""
    lines = ["## Configs", ""]
    for run_dir in dirs:
        lines += [
            "<details>",
            f"<summary><code>{_run_name(run_dir)}</code> ({run_dir})</summary>",
            "",
            "```yaml",
            config_text(run_dir).rstrip(),
            "```",
            "",
            "</details>",
            "",
        ]
    return lines


# Validation metrics the report describes in words, in this order (README "Metrics").
NARRATED = {
    "val/acc": "accuracy",
    "val/acc_easy": "easy",
    "val/acc_hard": "hard",
    "val/guess_rate_hard": "hard-problem guess rate",
    "val/bare_guess_rate": "bare-guess rate",
    "val/peak_share": 'share boxing "1"',
}


def trajectories(run_df: pd.DataFrame) -> dict[str, dict[str, float | None]]:
    """{metric: {"start", "final"}}: the first and last logged value of each `NARRATED`
    validation metric in one run's rows."""
    out = {}
    for metric in NARRATED:
        if metric not in run_df.columns:
            continue
        values = run_df[["step", metric]].dropna().sort_values("step")[metric]
        if len(values):
            out[metric] = {"start": _number(values.iloc[0]), "final": _number(values.iloc[-1])}
    return out


def what_happened(df: pd.DataFrame) -> list[str]:
    """Markdown: one sentence per run saying, from its logs, how its validation metrics moved
    from the first evaluation to the last, and whether it collapsed."""
    if df.empty:
        return []
    lines = ["## What happened", ""]
    summary = run_summary(df).sort_values("final val/acc", ascending=False)
    rows_of = dict(tuple(df.groupby("run", sort=False)))
    for _, row in summary.iterrows():
        part = rows_of.get(row["run"], df.iloc[:0])
        moves = [
            f"{NARRATED[m]} {v['start']:.2f} → {v['final']:.2f}"
            for m, v in trajectories(part).items()
            if v["start"] is not None and v["final"] is not None
        ]
        last = part.dropna(subset=["val/acc"])["step"].max() if "val/acc" in part else None
        span = f", validation at step 0 → {int(last)}" if moves and pd.notna(last) else ""
        lines.append(
            f"- `{row['run']}` ({row['method']}, seed {row['seed']}{span}): "
            + ("; ".join(moves) or "no validation logged")
            + f"; {verdict(part)}."
        )
    lines += [
        "",
        "Runs are ordered by final validation accuracy. The guess rate counts samples whose "
        "boxed answer differs from the value their own reasoning computed last.",
        "",
    ]
    return lines


def base_checks(run_dirs: Sequence[Path]) -> dict[str, dict | None]:
    """Base directory -> its stored acceptance checks (`checks.json`; None: never checked), for
    the toy bases the runs started from: in the model cache, else in the copy shipped with
    omgrpo (so a fresh clone's report shows a shipped base's checks before its first run)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from omgrpo.config import Config
    from omgrpo.errors import InputError, short_message
    from omgrpo.models.base_key import toy_base_key
    from omgrpo.models.basecheck import read_base_checks
    from omgrpo.models.bases import SHIPPED_DIR

    schema = OmegaConf.structured(Config)
    out: dict[str, dict | None] = {}
    for run_dir in run_dirs:
        path = Path(run_dir) / "config.yaml"
        raw = OmegaConf.create(RunStore(run_dir).read_config())
        if raw.get("backend") == "verl":  # a model directory, not a toy base of the cache
            continue
        try:  # on today's schema: configs written before a field existed get its default
            cfg = OmegaConf.merge(schema, raw)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None)
            raise InputError(
                f"does not fit omgrpo's config ({short_message(e)})", file=path, key=key
            ) from e
        if cfg.model.path or cfg.task.name != "toy":
            continue
        name = f"toy-base-{toy_base_key(cfg.model, cfg.task)}"
        base = Path(cfg.model.cache_dir) / name
        label = f"{cfg.run.experiment} (warm-start seed {cfg.model.warm_start.seed}): {base}"
        if label not in out:
            found = next((d for d in (base, SHIPPED_DIR / name) if d.exists()), None)
            out[label] = read_base_checks(found) if found is not None else None
    return out


def base_checks_section(checks: dict[str, dict | None]) -> list[str]:
    """Markdown lines: each toy base's acceptance checks (`omgrpo.models.basecheck.format_checks`)."""
    from omgrpo.models.basecheck import format_checks

    if not checks:
        return []
    lines = ["## Base checks", ""]
    for label, stored in checks.items():
        text = (
            format_checks(stored)
            if stored
            else "no checks.json beside the base (not on this machine, or never checked)"
        )
        lines += [label, "", "```", text, "```", ""]
    return lines


_SUMMARY_FIELDS = {
    "peak_val_acc": "peak val/acc",
    "final_val_acc": "final val/acc",
    "final_unique_per_prompt": "final unique/prompt",
    "final_batch_mode_share": "final batch-mode share",
}


NUMERIC_PREFIXES = ("val/", "train/")
"""Metrics that are numbers by construction: a text, list or mapping in them is a damaged or
foreign metrics file, named by `check_metric_values` (other metrics, such as the batch's
modal answer `answers/batch_mode`, may be text)."""


def check_metric_values(df: pd.DataFrame) -> None:
    """Refuse (InputError, naming the run's metrics file, the metric and the value) a value of
    a `val/*` or `train/*` metric that is not a number (before: text failed deep inside the
    report, a mapping raised a TypeError, and the figures dropped them silently)."""
    from omgrpo.errors import InputError

    for column in df.columns:
        if not column.startswith(NUMERIC_PREFIXES) or df[column].dtype != object:
            continue
        values = df[column].dropna()
        bad = values[[isinstance(v, bool) or not isinstance(v, numbers.Real) for v in values]]
        if len(bad):
            row = df.loc[bad.index[0]]
            where = row.get("run_dir") or row.get("run")
            raise InputError(
                f"step {row.get('step')}",
                file=f"{where} (metrics)",
                key=column,
                found=bad.iloc[0],
                expected="a number",
            )


def _number(value) -> float | None:
    return None if value is None or pd.isna(value) else round(float(value), 4)


def report_summary(df: pd.DataFrame) -> dict:
    """The numbers behind the report's verdicts, for scripts and CI: per run (identity, steps,
    peak/final val acc, final unique answers per prompt, final batch-mode share, collapse step
    or null) and per method (`variant`), the same over its seeds as per-seed lists and means."""
    runs = []
    if not df.empty:
        for _, row in run_summary(df).iterrows():
            part = df[df["run"] == row["run"]]
            entry = {
                "run": str(row["run"]),
                "variant": str(row["variant"]),
                "seed": None if pd.isna(row["seed"]) else int(row["seed"]),
                "steps": int(row["steps"]),
                **{key: _number(row[col]) for key, col in _SUMMARY_FIELDS.items()},
                "collapse_step": collapse_step(part),
                "verdict": verdict(part),
                "val": trajectories(part),
            }
            runs.append(entry)
    methods: dict[str, dict] = {}
    for entry in runs:
        m = methods.setdefault(entry["variant"], {"runs": [], "seeds": []})
        m["runs"].append(entry["run"])
        m["seeds"].append(entry["seed"])
        for key in [*_SUMMARY_FIELDS, "collapse_step"]:
            m.setdefault(key, []).append(entry[key])
    for m in methods.values():
        for key in _SUMMARY_FIELDS:
            values = [v for v in m[key] if v is not None]
            m[f"{key}_mean"] = round(sum(values) / len(values), 4) if values else None
        m["collapsed_runs"] = sum(step is not None for step in m["collapse_step"])
    return {"runs": runs, "methods": methods}


def _run_name(run_dir: Path) -> str:
    from omgrpo.tracking.store import RunStore

    try:
        config = RunStore(run_dir).read_config() or {}
    except Exception:
        config = {}
    return str((config.get("run") or {}).get("name") or Path(run_dir).name)


def _read_config(run_dir: Path) -> dict:
    from omgrpo.tracking.store import RunStore

    return RunStore(run_dir).read_config() or {}
