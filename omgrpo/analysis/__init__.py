"""Analysis of omgrpo runs: load runs into one tidy DataFrame, then redraw the paper's figures
and tables from it.

    from omgrpo.analysis import load_runs, aggregate_seeds, figures, tables, write_report

    df = load_runs("runs/")                      # one row per (run, step), metrics as columns
    figures.training_dynamics(df, Path("out"))   # PNG + PDF; MissingRunsError says what to run
    figures.all_figures(df, Path("out"))         # every figure that the runs allow
    write_report(["runs/"], Path("reports/study"))

Also from trackers: `load_runs(mlflow_experiment="toy", mlflow_uri="sqlite:///runs/mlflow.db")`,
`load_runs(wandb_project="entity/omgrpo")` (online W&B only). Command line: `omgrpo figures`,
`omgrpo report`. Notebooks: `analysis/*.ipynb`.
"""

from omgrpo.analysis.figures import FIGURES, MissingRunsError, all_figures
from omgrpo.analysis.load import (
    IDENTITY_COLUMNS,
    KNOWN_METRICS,
    NoRunsError,
    aggregate_seeds,
    collapse_step,
    degradation,
    find_run_dirs,
    load_rollouts,
    load_runs,
    metric_columns,
    verdict,
)
from omgrpo.analysis.report import write_report
from omgrpo.analysis.tables import TABLES, all_tables

__all__ = [
    "FIGURES",
    "IDENTITY_COLUMNS",
    "KNOWN_METRICS",
    "TABLES",
    "MissingRunsError",
    "NoRunsError",
    "aggregate_seeds",
    "all_figures",
    "all_tables",
    "collapse_step",
    "degradation",
    "find_run_dirs",
    "load_rollouts",
    "load_runs",
    "metric_columns",
    "verdict",
    "write_report",
]
