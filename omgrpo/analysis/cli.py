"""`omgrpo figures RUNS... --out DIR`, `omgrpo report RUNS... --out reports/<name>/` and
`omgrpo tables RUNS_OR_EVALS... --out DIR`.

All return an exit status: 0 on success. Bad input (no such path, no run in it, a damaged run
file, unknown figure name, unreadable tracker) raises InputError (or FileNotFoundError), which
`omgrpo.cli.main` prints with exit status 2; outputs are written all or nothing
(`omgrpo.staging`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omgrpo.analysis.load import NoRunsError


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)


def _fail(prog: str, message: str) -> int:
    """Print `PROG: error: MESSAGE` (with the traceback of the exception being handled, if
    any, under --debug / OMGRPO_DEBUG=1) and return 2."""
    from omgrpo.errors import debug_enabled

    if debug_enabled() and sys.exc_info()[1] is not None:
        import traceback

        traceback.print_exc(file=sys.stderr)
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def figures_main(argv: list[str]) -> int:
    from omgrpo.analysis.figures import FIGURES, TITLES, all_figures
    from omgrpo.analysis.load import find_run_dirs, load_rollouts, load_runs
    from omgrpo.analysis.report import check_metric_values, check_out_dir
    from omgrpo.errors import InputError
    from omgrpo.staging import staged_files

    prog = "omgrpo figures"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Draw the paper's figures (PNG + PDF) from runs. A figure whose runs are "
        "missing is skipped with the presets that would produce them.",
        epilog="figures: " + ", ".join(FIGURES),
    )
    parser.add_argument("runs", nargs="*", help="run directories or folders of them (e.g. runs/)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument(
        "--only", action="append", choices=list(FIGURES), metavar="NAME",
        help="draw only this figure (repeatable)",
    )  # fmt: skip
    parser.add_argument("--mlflow-experiment", help="also load this MLflow experiment")
    parser.add_argument(
        "--mlflow-uri", help="MLflow tracking URI (default sqlite:///runs/mlflow.db)"
    )
    parser.add_argument("--wandb-project", help="also load this W&B project (online API)")
    ns = _parse(parser, argv)
    if isinstance(ns, int):
        return ns
    if not ns.runs and not ns.mlflow_experiment and not ns.wandb_project:
        raise InputError("give run directories (or --mlflow-experiment / --wandb-project)")
    out = Path(ns.out)
    check_out_dir(out)
    df = load_runs(  # a source that cannot be read (a W&B project offline, ...): InputError
        *ns.runs,
        mlflow_experiment=ns.mlflow_experiment,
        mlflow_uri=ns.mlflow_uri,
        wandb_project=ns.wandb_project,
    )
    check_metric_values(df)
    rollouts = load_rollouts(ns.runs) if ns.runs else None
    n_runs = len(find_run_dirs(*ns.runs)) if ns.runs else df["run"].nunique()
    with staged_files(out) as tmp:  # all or nothing; other files in `out` are kept
        staged = all_figures(df, tmp, rollouts=rollouts, only=ns.only)
    results = {
        name: r if isinstance(r, str) else [out / p.relative_to(tmp) for p in r]
        for name, r in staged.items()
    }
    drawn = 0
    for name, result in results.items():
        if isinstance(result, str):
            print(f"  skipped {name}: {result}")
        else:
            drawn += 1
            print(f"  {TITLES.get(name, name)}: {', '.join(str(p) for p in result)}")
    print(f"{drawn} of {len(results)} figures from {n_runs} run(s) in {out}/")
    return 0


def report_main(argv: list[str]) -> int:
    from omgrpo.analysis.report import write_report

    prog = "omgrpo report"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write report.md (runs with a collapse verdict, tables, figures, configs) "
        "and figures/ for a set of runs.",
    )
    parser.add_argument("runs", nargs="+", help="run directories or folders of them (e.g. runs/)")
    parser.add_argument(
        "--out",
        help="output folder (default: reports/<name of the first RUNS argument>/)",
    )
    parser.add_argument("--title", help="report title")
    ns = _parse(parser, argv)
    if isinstance(ns, int):
        return ns
    out = (
        Path(ns.out) if ns.out else Path("reports") / (Path(ns.runs[0]).resolve().name or "report")
    )
    path = write_report(ns.runs, out, title=ns.title)
    section = path.read_text().split("## Provenance\n", 1)[-1].split("\n## ", 1)[0]
    print("provenance:\n" + section.strip())
    print(f"report: {path}  (figures in {path.parent / 'figures'}/)")
    return 0


def tables_main(argv: list[str]) -> int:
    from omgrpo.analysis.paper_tables import write_tables

    prog = "omgrpo tables"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="The paper's tables (main avg@k, pass@k, TTT, ablations, CAR vs n) as "
        "markdown and LaTeX from `omgrpo eval` summaries: mean ± 95%% CI over seeds.",
    )
    parser.add_argument("sources", nargs="+", help="run dirs, eval dirs, or folders of them")
    parser.add_argument("--out", required=True, help="output folder (tables.md, *.md, *.tex)")
    parser.add_argument(
        "--checkpoint", default="last", help="which evaluations: last (default), best, step_N"
    )
    ns = _parse(parser, argv)
    if isinstance(ns, int):
        return ns
    path = write_tables(ns.sources, ns.out, ns.checkpoint)
    print(path.read_text())
    print(f"tables: {path} (+ .md / .tex per table in {path.parent}/)")
    return 0


def study_report_main(argv: list[str]) -> int:
    from omgrpo.analysis.study import write_study_report

    prog = "omgrpo study-report"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Mark a pre-registered study's predictions confirmed / refuted / "
        "inconclusive from its runs, with figures and the bases' checks; where the "
        "pre-registration's YAML block asks for them (omgrpo/analysis/study.py), verdicts at "
        "every validation, time to event, a Holm column and per-base rows. A key the block "
        "may not hold is refused (exit 2). summary.json records the runs' wall time.",
    )
    parser.add_argument("runs", nargs="+", help="run directories or folders of them")
    parser.add_argument("--prereg", required=True, help="the PREREGISTRATION.md file")
    parser.add_argument("--out", required=True, help="output folder (report.md, summary.json)")
    parser.add_argument("--command", help="the command that ran the study (for the record)")
    parser.add_argument("--seconds", type=float, help="the study's wall time (for the record)")
    parser.add_argument(
        "--interim",
        action="store_true",
        help="the grid is not complete: the report says so and its verdicts are not interpreted",
    )
    ns = _parse(parser, argv)
    if isinstance(ns, int):
        return ns
    if ns.seconds is not None:
        from omgrpo.errors import check_number

        check_number(ns.seconds, "--seconds", minimum=0)
    try:
        path = write_study_report(
            ns.runs,
            ns.prereg,
            ns.out,
            command=ns.command,
            seconds=ns.seconds,
            interim=ns.interim,
        )
    except (FileNotFoundError, NoRunsError, ValueError) as e:
        return _fail(prog, str(e))
    print(f"study report: {path}")
    return 0
