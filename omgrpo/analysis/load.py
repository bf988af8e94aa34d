"""Runs → one tidy DataFrame (one row per run and step), seed statistics and a collapse verdict.

Sources: local run directories (the run store: `config.yaml` + `metrics.jsonl`, the source of
truth), an MLflow experiment, or a W&B project (online API only). Every source gives the same
columns:

    run, run_dir, run_uuid, experiment, variant, method, seed, scale, status, source  (identity)
    cfg.<section>.<field> ...                                                 (resolved config)
    step, <metric> ...                                                        (store names)

Metric columns keep the store's names (`val/acc`, `val/pass@4`, ...): names that MLflow
sanitised (`val/pass_at_4`) are mapped back. Config values that are lists or dicts become
their JSON text, so that every column can be grouped on.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from omgrpo.core.diagnostics import COLLAPSE_DEFAULTS, CollapseDetector
from omgrpo.errors import InputError, MissingDependency
from omgrpo.tracking import (
    RUN_DIR_TAG,
    RUN_UUID_TAG,
    flatten,
    resolve_wandb_mode,
    run_method,
    run_scale,
    sanitize_metric_name,
)
from omgrpo.tracking.store import RunStore, legacy_run_uuid

IDENTITY_COLUMNS = (
    "run",
    "run_dir",
    "run_uuid",
    "experiment",
    "variant",
    "method",
    "seed",
    "scale",
    "status",
    "source",
)
"""Columns that identify a run (constant over its rows)."""

CFG_PREFIX = "cfg."

# The metric contract (README "Metrics", DESIGN.md), used to map MLflow names back.
KNOWN_METRICS: tuple[str, ...] = (
    "train/step", "train/epoch", "train/skipped_steps",
    "reward/total", "reward/soft_vote", "reward/format", "reward/majority_vote", "reward/gt",
    "reward/self_certainty", "reward/entropy", "reward/coreward", "acc/train",
    "answers/unique_per_prompt", "answers/unique_per_batch", "answers/batch_mode",
    "answers/batch_mode_share", "answers/vote_entropy", "answers/extract_rate",
    "answers/top_vote_acc", "answers/confidently_wrong", "answers/label_flip_rate",
    "kl/answer", "kl/reasoning", "entropy/answer", "entropy/reasoning", "answer/frac",
    "loss/pg", "loss/kl", "loss/total", "clip/frac", "ratio/mean", "grad/norm", "lr",
    "response/length_mean",
    "car/position_bias", "car/select_correct", "car/incorrect_pair_first",
    "car/anchor_entropy_correct", "car/anchor_entropy_incorrect", "car/pool_size",
    "car/top_vote_acc", "car/top_vote_acc_without_car", "car/truncated", "car/unclosed",
    "car/num_pairs",
    "val/acc", "val/pass@k", *(f"val/pass@{k}" for k in (1, 2, 4, 8, 16, 32, 64, 128, 256)),
    "val/unique_answers", "val/extract_rate",
    "recovery/zero_pass_prompts", "recovery/cum_pass", "recovery/cum_avg",
    "collapse/detected_step",
    "time/gen", "time/car", "time/reward", "time/old_logprob", "time/ref_logprob", "time/adv",
    "time/update", "time/step", "mem/peak_gb", "perf/tokens_per_s",
)  # fmt: skip

LEGACY_PASS_AT_K = "val/pass@k"
"""verl runs from before both backends shared one metric contract: `val/pass@<k>` under a
literal `k` (`_numeric_pass_at_k`)."""
LEGACY_TOP_VOTE_WITHOUT_CAR = "car/top_vote_acc_without_car"
"""CAR runs from before the shared metric contract: the rollouts' vote under this name, the
pool's as `answers/top_vote_acc` (`_top_vote_names`)."""

_UNSANITIZE = {sanitize_metric_name(name): name for name in KNOWN_METRICS}

# Metrics that are fractions by definition: the rows of docs/metrics.md whose unit is
# "fraction" (accuracies, shares, rates), as the docs spell them (`<d>` a difficulty, `<kind>`
# a guess kind, `<k>` the k of pass@k); tests/analysis/test_analysis.py keeps the two equal.
FRACTION_METRICS: tuple[str, ...] = (
    "acc/train", "answers/batch_mode_share", "answers/extract_rate", "answers/top_vote_acc",
    "answers/wrong_majority", "answers/confidently_wrong", "answers/label_flip_rate",
    "reward_quality/reward_acc", "reward_quality/majority_ratio",
    "reward_quality/zero_spread_groups", "answers/consistency", "answers/guess_rate_<d>",
    "answers/bare_guess_rate", "answers/peak_share", "answers/guess_<kind>_<d>",
    "answers/line_acc_<d>", "answers/informativeness_<d>", "answers/support_<d>",
    "answers/chain_acc_<d>", "answers/consistent_acc_<d>", "answer/frac",
    "pg/answer_weight_share", "mask/frac", "mask/answer_overlap", "dapo/kept_rollouts",
    "dapo/truncated", "clip/frac", "mech/computed_lead", "mech/computed_lead_<d>",
    "prm/unscored_share", "car/position_bias", "car/select_correct", "car/incorrect_pair_first",
    "car/top_vote_acc", "car/unclosed", "val/acc", "val/pass@<k>", "val/acc_<d>",
    "val/extract_rate", "val/consistency", "val/guess_rate_<d>", "val/bare_guess_rate",
    "val/peak_share", "val/guess_<kind>_<d>", "val/line_acc_<d>", "val/informativeness_<d>",
    "val/support_<d>", "val/chain_acc_<d>", "val/consistent_acc_<d>", "recovery/cum_pass",
    "recovery/cum_avg",
    LEGACY_TOP_VOTE_WITHOUT_CAR,  # renamed on load (`_top_vote_names`); a fraction as well
)  # fmt: skip
ACCURACY_METRICS: tuple[str, ...] = ("val/acc", "val/acc_<d>", "val/pass@<k>")
"""The fractions that are never nan: validation grades every sample against its label (the
others are nan over an empty set by definition, e.g. `answers/label_flip_rate` before any
prompt was revisited, `acc/train` without labelled rollouts)."""

FRACTION_SLACK = 1e-6
"""How far outside [0, 1] `check_fractions` lets a fraction be: float32 rounding of a share
computed on a GPU (a sum over a part over a sum over the whole), never a damaged value."""

_PLACEHOLDERS = {"<d>": "[A-Za-z0-9]+", "<kind>": "[a-z_]+", "<k>": "(?:[0-9]+|k)"}


def _names_regex(names: Iterable[str]) -> re.Pattern[str]:
    parts = []
    for name in names:
        pattern = re.escape(name)
        for placeholder, part in _PLACEHOLDERS.items():
            pattern = pattern.replace(re.escape(placeholder), part)
        parts.append(pattern)
    return re.compile("|".join(f"(?:{p})" for p in parts))


_FRACTION_RE = _names_regex(FRACTION_METRICS)
_ACCURACY_RE = _names_regex(ACCURACY_METRICS)


@functools.lru_cache(maxsize=4096)
def fraction_kind(name: str) -> str | None:
    """What metric `name` is: "accuracy" (`ACCURACY_METRICS`: in [0, 1], never nan),
    "fraction" (`FRACTION_METRICS`: in [0, 1] or nan) or None (any other metric: a loss, a KL,
    a count, a reward)."""
    if _ACCURACY_RE.fullmatch(name):
        return "accuracy"
    return "fraction" if _FRACTION_RE.fullmatch(name) else None


def check_fractions(rows: Iterable[tuple[int, Mapping[str, Any]]], where: str | Path) -> None:
    """Refuse (InputError naming `where`, the step and the key) a logged value of a fraction
    metric (`fraction_kind`) outside [0, 1]: 1e308, -0.5, inf, text; and nan or null in an
    accuracy. A damaged or foreign metrics file otherwise went into a report's tables, a
    study's verdicts and the figures as a number (an accuracy of 1e308 is a mean of nothing)."""
    for step, row in rows:
        for key, value in row.items():
            kind = fraction_kind(key)
            if kind is None:
                continue
            missing = value is None or (isinstance(value, float) and math.isnan(value))
            if missing and kind == "fraction":
                continue  # a share over an empty set (docs/metrics.md)
            number = not isinstance(value, bool) and isinstance(value, numbers.Real)
            if not missing and number and -FRACTION_SLACK <= value <= 1 + FRACTION_SLACK:
                continue
            expected = "a fraction in [0, 1]"
            raise InputError(
                f"step {step}",
                file=where,
                key=key,
                found=value,
                expected=f"{expected}, never nan (an accuracy)" if kind == "accuracy" else expected,
            )


_PASS_AT = re.compile(r"^(?P<head>.*/pass)_at_(?P<k>\w+)$")


class NoRunsError(InputError, FileNotFoundError):
    """A source (folder, MLflow experiment, W&B project) that is missing or holds no run: bad
    input (exit 2, named), and still a FileNotFoundError for callers that catch one."""


# -- discovering run directories ---------------------------------------------------------------
def is_run_dir(path: Path) -> bool:
    path = Path(path)
    return (path / "config.yaml").is_file() and RunStore(path).has_metrics()  # or compacted


_SKIP_DIRS = {"checkpoints", "rollouts", "wandb", ".hydra", "mlruns", "mlartifacts", "figures"}


def find_run_dirs(*sources: str | Path) -> list[Path]:
    """Run directories in `sources`: each a run directory or a folder searched recursively
    (run directories are not searched inside). Sorted, without duplicates. Raises
    `NoRunsError` (an InputError naming the path) for a missing path, a file, or a source
    without any run."""
    found: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        if not path.exists():
            raise NoRunsError("no such file or directory", file=path)
        if not path.is_dir():
            raise NoRunsError(
                "not a directory: pass a run directory (with config.yaml and metrics.jsonl) "
                "or a folder of run directories",
                file=path,
            )
        runs = [path] if is_run_dir(path) else _walk_runs(path)
        if not runs:
            raise NoRunsError(
                "no run found (a run directory holds config.yaml and metrics.jsonl; create "
                "runs with `omgrpo train run.root=...`)",
                file=path,
            )
        found += runs
    out: list[Path] = []
    seen: set[Path] = set()
    for run in found:
        key = run.resolve()
        if key not in seen:
            seen.add(key)
            out.append(run)
    return sorted(out, key=lambda p: str(p))


def _walk_runs(folder: Path) -> list[Path]:
    runs = []
    for root, dirs, _files in os.walk(folder):
        here = Path(root)
        if is_run_dir(here):
            runs.append(here)
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
    return runs


# -- loading -----------------------------------------------------------------------------------
def load_runs(
    *sources: str | Path,
    mlflow_experiment: str | None = None,
    mlflow_uri: str | None = None,
    wandb_project: str | None = None,
) -> pd.DataFrame:
    """One DataFrame with a row per (run, step) from every source given.

    `sources`: run directories or folders holding them (searched recursively).
    `mlflow_experiment`: an MLflow experiment name (the run group, e.g. `toy`), read from
    `mlflow_uri` (default: $MLFLOW_TRACKING_URI, else `sqlite:///runs/mlflow.db`).
    `wandb_project`: `entity/project` or `project`, read through the online W&B API.
    Columns: see the module docstring; rows sorted by run and step.
    """
    if not sources and mlflow_experiment is None and wandb_project is None:
        raise InputError("load_runs needs run directories, an MLflow experiment or a W&B project")
    frames = [_store_frame(run_dir) for run_dir in find_run_dirs(*sources)] if sources else []
    if mlflow_experiment is not None:
        frames += _mlflow_frames(mlflow_experiment, mlflow_uri)
    if wandb_project is not None:
        frames += _wandb_frames(wandb_project)
    return _combine(frames)


def load_rollouts(run_dirs: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """Every stored rollout (`rollouts/step_*.parquet`) of the runs in `run_dirs` (run
    directories or folders of them), with the identity columns `run`, `experiment`,
    `variant`, `method`, `seed` in front. Empty (with those columns) if no run logged any."""
    if isinstance(run_dirs, str | Path):
        run_dirs = [run_dirs]
    frames = []
    for run_dir in find_run_dirs(*run_dirs):
        tables = [_read_parquet(f) for _, f in RunStore(run_dir).rollout_files()]
        table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
        if table.empty:
            continue
        ident = _identity(_read_config(run_dir), run_dir)
        for i, col in enumerate(("run", "experiment", "variant", "method", "seed")):
            table.insert(i, col, ident[col])
        frames.append(table)
    if not frames:
        return pd.DataFrame(columns=["run", "experiment", "variant", "method", "seed", "step"])
    return pd.concat(frames, ignore_index=True)


def _read_parquet(path: Path) -> pd.DataFrame:
    """A run's Parquet table; one that cannot be read (truncated, not Parquet) is an InputError
    naming it (pyarrow's own error names no file)."""
    try:
        return pd.read_parquet(path)
    except Exception as e:  # pyarrow.ArrowInvalid, OSError, ...: a damaged file
        first = (str(e).splitlines() or [""])[0][:200]
        raise InputError(
            f"not a readable Parquet file ({type(e).__name__}: {first})", file=path
        ) from e


def metric_columns(df: pd.DataFrame) -> list[str]:
    """The metric columns of a `load_runs` frame (everything but identity, config and step)."""
    return [c for c in df.columns if c not in IDENTITY_COLUMNS and c != "step" and not _is_cfg(c)]


def _is_cfg(col: str) -> bool:
    return col.startswith(CFG_PREFIX)


def _read_config(run_dir: Path) -> dict[str, Any]:
    return RunStore(run_dir).read_config() or {}


def _identity(
    config: Mapping[str, Any], run_dir: Path | str | None, run_uuid: str | None = None
) -> dict[str, Any]:
    run = config.get("run") or {}
    name = run.get("name") or (Path(run_dir).name if run_dir else "unnamed")
    seed = config.get("seed")
    return {
        "run": str(name),
        "run_dir": str(run_dir) if run_dir is not None else None,
        "run_uuid": run_uuid,
        "experiment": str(run.get("experiment") or "unknown"),
        "variant": str(run.get("variant") or run_method(config)),
        "method": run_method(config),
        "seed": int(seed) if isinstance(seed, int | float) and not isinstance(seed, bool) else -1,
        "scale": run_scale(config),
    }


def _cfg_columns(config: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in flatten(config).items():
        if isinstance(value, list | tuple | dict):
            value = json.dumps(value, default=str)
        out[CFG_PREFIX + key] = value
    return out


def _frame(
    identity: dict[str, Any],
    config: Mapping[str, Any],
    metrics: pd.DataFrame,
    status: str | None,
    source: str,
) -> pd.DataFrame:
    """A run's rows: identity + config columns (constant), `step`, then the metrics."""
    metrics = _top_vote_names(_numeric_pass_at_k(metrics.copy(), config))
    if "train/step" in metrics.columns:
        metrics = metrics.rename(columns={"train/step": "step"})
    if "step" not in metrics.columns:
        metrics["step"] = pd.Series(dtype="int64")
    metrics = metrics.dropna(subset=["step"])
    metrics["step"] = metrics["step"].astype("int64")
    # A resumed run may have logged a step twice: keep the last row.
    metrics = metrics.drop_duplicates("step", keep="last").sort_values("step")
    metrics = metrics.reset_index(drop=True)
    const = {**identity, "status": status, "source": source, **_cfg_columns(config)}
    head = pd.DataFrame({k: [v] * len(metrics) for k, v in const.items()}, index=metrics.index)
    return pd.concat([head, metrics], axis=1)


# Samples per validation prompt in a run's config: native `eval.k`, verl's validation `n`.
_VAL_K_KEYS = ("eval.k", "actor_rollout_ref.rollout.val_kwargs.n")


def _numeric_pass_at_k(metrics: pd.DataFrame, config: Mapping[str, Any]) -> pd.DataFrame:
    """Runs of the verl backend from before the shared metric contract logged `val/pass@k`
    under that literal name (verl's bootstrap best@k); both backends now log `val/pass@<k>`.
    The old column becomes `val/pass@<k>` with k from the run's config (kept as it is when the
    config has no k)."""
    if LEGACY_PASS_AT_K not in metrics.columns:
        return metrics
    flat = flatten(config)
    k = next((flat[key] for key in _VAL_K_KEYS if isinstance(flat.get(key), int)), None)
    if k is None:
        return metrics
    name = f"val/pass@{k}"
    old = metrics.pop(LEGACY_PASS_AT_K)
    metrics[name] = metrics[name].combine_first(old) if name in metrics.columns else old
    return metrics


def _top_vote_names(metrics: pd.DataFrame) -> pd.DataFrame:
    """`answers/top_vote_acc` is the rollouts' majority vote in every run since the backends
    shared one metric contract, and CAR's augmented pool votes as `car/top_vote_acc`. Before, a
    CAR step logged the pool's vote as `answers/top_vote_acc` and the rollouts' as
    `car/top_vote_acc_without_car`: such rows are renamed to today's names."""
    if LEGACY_TOP_VOTE_WITHOUT_CAR not in metrics.columns:
        return metrics
    old = metrics.pop(LEGACY_TOP_VOTE_WITHOUT_CAR)
    car_rows = old.notna()
    pool = metrics.get("answers/top_vote_acc", pd.Series(float("nan"), index=metrics.index))
    metrics["car/top_vote_acc"] = pool.where(car_rows)
    metrics["answers/top_vote_acc"] = old.where(car_rows, pool)
    return metrics


def _store_frame(run_dir: Path) -> pd.DataFrame:
    """A run directory's rows; its metrics checked (`check_fractions`) as they are read: the one
    place `report`, `figures`, `study-report` (and the calibration and warning tools) read a
    run's metrics through."""
    store = RunStore(run_dir)
    config = _read_config(run_dir)
    status = store.read_status().get("state")
    ident = _identity(config, run_dir, store.peek_uuid())
    rows = store.metric_rows()
    path = store.metrics_path if store.metrics_path.exists() else store.compact_metrics_path
    check_fractions(rows, path)
    metrics = pd.DataFrame([{"train/step": step, **row} for step, row in rows])
    return _frame(ident, config, metrics, status, "store")


def _combine(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame(columns=[*IDENTITY_COLUMNS, "step"])
    # Two different runs with the same name (other roots, a store run and its MLflow copy, or
    # two machines' runs at one path: other UUIDs): keep them apart, so that per-run
    # statistics never mix them.
    names: dict[str, set[tuple[str, str, str]]] = {}
    for f in frames:
        key = (f["source"].iloc[0], str(f["run_dir"].iloc[0]), str(f["run_uuid"].iloc[0]))
        names.setdefault(f["run"].iloc[0], set()).add(key)
    for i, f in enumerate(frames):
        name, source, run_dir = f["run"].iloc[0], f["source"].iloc[0], f["run_dir"].iloc[0]
        if len(names[name]) > 1:
            same_dir = sum(k[:2] == (source, str(run_dir)) for k in names[name]) > 1
            tail = f" {str(f['run_uuid'].iloc[0])[:8]}" if same_dir else ""
            frames[i] = f.assign(run=f"{name} [{source}: {run_dir}{tail}]")
    df = pd.concat(frames, ignore_index=True, sort=False)
    cfg = sorted(c for c in df.columns if _is_cfg(c))
    metrics = [c for c in df.columns if c not in IDENTITY_COLUMNS and c != "step" and c not in cfg]
    df = df[[*IDENTITY_COLUMNS, *cfg, "step", *metrics]]
    return df.sort_values(["run", "source", "step"], kind="stable").reset_index(drop=True)


def run_roots(df: pd.DataFrame) -> pd.Series:
    """Per row: "" unless two runs share experiment, variant and seed (the same study run from
    two run roots, e.g. a rerun), then the run's root folder (or source) to keep them apart
    instead of averaging them as if they were seeds."""
    if df.empty:
        return pd.Series("", index=df.index, dtype=object)
    runs = df.drop_duplicates("run")[["run", "run_dir", "source", "experiment", "variant", "seed"]]
    clash = runs.duplicated(["experiment", "variant", "seed"], keep=False)
    if not clash.any():
        return pd.Series("", index=df.index, dtype=object)
    root = {
        r.run: (Path(str(r.run_dir)).parent.name if r.run_dir else "") or str(r.source)
        for r in runs.itertuples(index=False)
    }
    keyed = runs.assign(root=runs["run"].map(root))
    groups = keyed.groupby(["experiment", "variant"])["root"].transform("nunique")
    needs = dict(zip(keyed["run"], (groups > 1).to_numpy()))
    return df["run"].map(lambda r: root[r] if needs.get(r) else "").astype(object)


# -- MLflow ------------------------------------------------------------------------------------
def unsanitize_metric_name(key: str) -> str:
    """The store name of an MLflow metric key (inverse of `sanitize_metric_name` on the metric
    contract; `val/pass_at_4` -> `val/pass@4`); unknown keys are returned unchanged."""
    if key in _UNSANITIZE:
        return _UNSANITIZE[key]
    match = _PASS_AT.match(key)
    return f"{match['head']}@{match['k']}" if match else key


@contextlib.contextmanager
def _tracking_uri(uri: str):
    import mlflow
    from mlflow.tracking._tracking_service import utils

    # Restore exactly what was there: an unset URI must stay unset (so $MLFLOW_TRACKING_URI
    # keeps working for the caller), not be pinned to the default it resolved to.
    # set_tracking_uri also exports $MLFLOW_TRACKING_URI, which training honours: restore it.
    before, env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield mlflow
    finally:
        utils._tracking_uri = before
        if env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env


def _mlflow_frames(experiment: str, uri: str | None) -> list[pd.DataFrame]:
    from omgrpo.tracking import default_mlflow_uri, mlflow_client, sqlite_db_path

    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or default_mlflow_uri(Path("runs"))
    db = sqlite_db_path(uri)
    if db is not None and not db.is_file():
        raise NoRunsError(f"MLflow database {db} not found (from --mlflow-uri {uri})")
    try:
        client = mlflow_client(uri)
        exp = client.get_experiment_by_name(experiment)
        names = sorted(e.name for e in client.search_experiments()) if exp is None else []
        if exp is not None:
            with _tracking_uri(uri) as mlflow:
                runs = mlflow.search_runs(
                    experiment_ids=[exp.experiment_id], output_format="pandas"
                )
    except Exception as e:  # the store refused: a bad URI, a server that is down
        if not type(e).__module__.startswith(("mlflow", "sqlalchemy", "requests")):
            raise
        raise InputError(
            f"MLflow cannot read it ({type(e).__name__}: {str(e).splitlines()[0][:300]})",
            key="--mlflow-uri",
            found=uri,
        ) from e
    if exp is None:
        raise NoRunsError(f"MLflow experiment {experiment!r} not found in {uri}; it has: {names}")
    if runs.empty:
        raise NoRunsError(f"MLflow experiment {experiment!r} in {uri} has no run")
    frames = []
    for _, row in runs.iterrows():
        run_id = row["run_id"]
        params = {
            c[len("params.") :]: row[c]
            for c in runs.columns
            if c.startswith("params.") and isinstance(row[c], str)
        }
        config = _unflatten({k: _parse_param(v) for k, v in params.items()})
        tags = {c[len("tags.") :]: row[c] for c in runs.columns if c.startswith("tags.")}
        keys = [
            c[len("metrics.") :]
            for c in runs.columns
            if c.startswith("metrics.") and pd.notna(row[c])
        ]
        points: dict[int, dict[str, float]] = {}
        for key in keys:
            name = unsanitize_metric_name(key)
            history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
            for m in history:
                points.setdefault(int(m.step), {})[name] = m.value
        check_fractions(sorted(points.items()), f"MLflow run {run_id} in {uri}")
        metrics = pd.DataFrame([{"train/step": s, **v} for s, v in sorted(points.items())])
        run_dir = tags.get(RUN_DIR_TAG)
        run_uuid = tags.get(RUN_UUID_TAG) or (legacy_run_uuid(run_dir) if run_dir else None)
        ident = _identity(config, run_dir, run_uuid)
        if isinstance(tags.get("mlflow.runName"), str) and not (config.get("run") or {}).get(
            "name"
        ):
            ident["run"] = tags["mlflow.runName"]
        status = str(row.get("status") or "").lower() or None
        frames.append(_frame(ident, config, metrics, status, "mlflow"))
    return frames


def _parse_param(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # a scalar and a section of the same name
                child = node[part] = {"": child}
            node = child
        node[parts[-1]] = value
    return out


# -- W&B ---------------------------------------------------------------------------------------
def _wandb_frames(project: str) -> list[pd.DataFrame]:
    try:
        import wandb
    except ImportError as e:
        raise MissingDependency(
            "loading a W&B project needs the `wandb` package (pip install wandb)",
            key="--wandb-project",
            found=project,
        ) from e
    mode = resolve_wandb_mode(None)
    if mode != "online":
        raise InputError(
            f"loading the W&B project {project!r} needs the online W&B API, but W&B is "
            f"{mode!r} here (no API key, or WANDB_MODE={os.environ.get('WANDB_MODE')!r}). "
            "Run `wandb login` or set WANDB_API_KEY; offline runs are in the local run store: "
            "load_runs('runs/') (or upload them with `omgrpo sync RUN --to wandb`)",
            key="--wandb-project",
        )
    try:
        api = wandb.Api(timeout=60)
        runs = list(api.runs(project))
    except Exception as e:  # no such project, no network, a refused key
        raise InputError(
            f"cannot read the W&B project {project!r} ({type(e).__name__}: {e})",
            key="--wandb-project",
        ) from e
    if not runs:
        raise NoRunsError(f"W&B project {project!r} has no run")
    frames = []
    for run in runs:
        config = {k: v for k, v in dict(run.config).items() if not str(k).startswith("_")}
        points: dict[int, dict[str, Any]] = {}
        for row in run.scan_history():
            step = row.get("train/step", row.get("_step"))
            if step is None:
                continue
            # one row per step; a step logged again (a resumed run) keeps its latest values
            values = {k: v for k, v in row.items() if not k.startswith("_")}
            points.setdefault(int(step), {}).update(values)
        check_fractions(sorted(points.items()), f"W&B run {project}/{run.id}")
        rows = [{**values, "train/step": step} for step, values in sorted(points.items())]
        ident = _identity(config, None, config.get("omgrpo_run_uuid"))
        if not (config.get("run") or {}).get("name"):
            ident["run"] = run.name
        frames.append(_frame(ident, config, pd.DataFrame(rows), str(run.state), "wandb"))
    return frames


# -- statistics --------------------------------------------------------------------------------
@functools.cache  # figures ask once per (step, arm) row: 24k calls for a study's 8 figures
def t_critical(dof: int, confidence: float = 0.95) -> float:
    """Two-sided Student-t critical value t_{(1+confidence)/2, dof}; NaN without a dof."""
    from scipy import stats

    if dof < 1:
        return math.nan
    return float(stats.t.ppf(0.5 + confidence / 2, dof))


def aggregate_seeds(
    df: pd.DataFrame, metric: str, by: Sequence[str] = ("experiment", "variant", "step")
) -> pd.DataFrame:
    """Mean, std (ddof 1), n, min, max and 95% CI half-width (`ci95`, Student t) of `metric`
    over the rows of each `by` group (by default: over seeds, per experiment, variant and step).
    Rows where the metric is NaN are left out; n = 1 gives std and ci95 NaN. Figures and tables
    show ci95 only from 3 seeds on (`omgrpo.analysis.figures.MIN_SEEDS_FOR_CI`)."""
    by = list(by)
    missing = [c for c in [*by, metric] if c not in df.columns]
    if missing:
        raise KeyError(f"aggregate_seeds: no column(s) {missing} in the frame")
    data = df[[*by, metric]].copy()
    data[metric] = pd.to_numeric(data[metric], errors="coerce")
    data = data.dropna(subset=[metric])
    if data.empty:
        return pd.DataFrame(columns=[*by, "mean", "std", "n", "min", "max", "ci95"])
    out = (
        data.groupby(by, sort=True, dropna=False)[metric]
        .agg(mean="mean", std="std", n="count", min="min", max="max")
        .reset_index()
    )
    out["n"] = out["n"].astype("int64")
    t = np.array([t_critical(int(n) - 1) for n in out["n"]], dtype=float)
    out["ci95"] = t * out["std"].to_numpy(dtype=float) / np.sqrt(out["n"].to_numpy(dtype=float))
    out.loc[out["n"] < 2, ["std", "ci95"]] = np.nan
    return out


# -- collapse verdict --------------------------------------------------------------------------
def collapse_step(
    run_df: pd.DataFrame, thresholds: Mapping[str, float] | None = None
) -> int | None:
    """The step at which the run collapsed, or None.

    `collapse/detected_step` when the trainer logged it; else `omgrpo.core.diagnostics.
    CollapseDetector` replayed over the logged `answers/unique_per_prompt` and
    `answers/batch_mode_share` (thresholds from the run's `cfg.collapse.*`, default 1.5 / 0.5
    / patience 3; `thresholds`, e.g. a pre-registration's, replace them key by key)."""
    if "collapse/detected_step" in run_df.columns:
        logged = pd.to_numeric(run_df["collapse/detected_step"], errors="coerce").dropna()
        if len(logged):
            return int(logged.iloc[0])
    need = ["answers/unique_per_prompt", "answers/batch_mode_share"]
    if any(c not in run_df.columns for c in need):
        return None
    params = {}
    for key, default in COLLAPSE_DEFAULTS.items():  # for runs that did not record theirs
        col = f"{CFG_PREFIX}collapse.{key}"
        value = (
            run_df[col].dropna().iloc[0] if col in run_df and run_df[col].notna().any() else None
        )
        if thresholds is not None and thresholds.get(key) is not None:
            value = thresholds[key]
        params[key] = type(default)(value) if value is not None else default
    detector = CollapseDetector(
        params["max_unique_per_prompt"], params["min_mode_share"], params["patience"]
    )
    rows = run_df.sort_values("step") if "step" in run_df.columns else run_df
    for step, unique, share in zip(rows["step"], rows[need[0]], rows[need[1]]):
        unique, share = pd.to_numeric(unique), pd.to_numeric(share)
        if pd.isna(unique) or pd.isna(share):
            continue  # a validation-only row (step 0): the trainer feeds training steps only
        metrics = {need[0]: float(unique), need[1]: float(share)}
        if detector.update(int(step), metrics):
            return int(step)
    return None


DEGRADE_DROP = 0.10
"""`degradation`: validation accuracy must fall by more than this (absolute, from the run's
first evaluation to its last) to call a run degraded or reward hacked. A round figure, chosen
with the rule, when the PRM baselines were added, after the PRM sweep's seed 0 had run
(docs/prm.md): there it flags the `prm`, `prm_om`, `prm_mean` and `prm_product` arms (drops 0.25
to 0.65) and not MV, OM-GRPO without CAR or `prm_last` (0.035, 0.082, 0.031)."""

REWARD_WINDOW = 3
"""`degradation` compares the mean `reward/total` of the first and the last this many training
steps (fewer, n // 2, in a run of under 6 steps)."""


def degradation(run_df: pd.DataFrame, drop: float = DEGRADE_DROP) -> str | None:
    """`"reward hacked (...)"` when `val/acc` fell by more than `drop` from its first evaluation
    to its last while the training reward (`reward/total`, mean of the first vs the last
    `REWARD_WINDOW` training steps) rose; `"degraded (...)"` when it fell that much and the
    reward did not rise (or was not logged); None otherwise (fewer than two evaluations
    included). The parentheses give the figures. The collapse detector looks only at answer
    agreement, so a run whose policy learns what its reward likes while its answers spread
    out (the toy PRM's arms, docs/prm.md) would otherwise be called stable."""
    rows = run_df.sort_values("step") if "step" in run_df.columns else run_df
    if "val/acc" not in rows.columns:
        return None
    acc = pd.to_numeric(rows["val/acc"], errors="coerce").dropna()
    if len(acc) < 2 or not acc.iloc[0] - acc.iloc[-1] > drop:
        return None
    fell = f"val/acc {acc.iloc[0]:.3f} → {acc.iloc[-1]:.3f}"
    reward = (
        pd.to_numeric(rows["reward/total"], errors="coerce").dropna()
        if "reward/total" in rows.columns
        else pd.Series(dtype=float)
    )
    window = min(REWARD_WINDOW, len(reward) // 2)
    if window < 1:
        return f"degraded ({fell}; reward/total not logged)"
    first, last = float(reward.iloc[:window].mean()), float(reward.iloc[-window:].mean())
    moved = f"reward/total {first:.3f} → {last:.3f}"
    if last > first:
        return f"reward hacked ({fell} while {moved})"
    return f"degraded ({fell}; {moved})"


def verdict(run_df: pd.DataFrame, status: Mapping[str, Any] | str | None = None) -> str:
    """`"collapsed at step N"` (see `collapse_step`), else, when the run's status (status.json
    dict or its `state`) says it failed, `"failed at step N"` (the step that failed, where the
    trainer knows it: `failed_step`) or `"failed after step N"` (the last step that completed),
    else `"reward hacked (...)"` or `"degraded (...)"` (see `degradation`), else `"stable"`.

    The one definition of a run's verdict: `omgrpo report` (runs table, "What happened") and
    `omgrpo study-report` use it."""
    step = collapse_step(run_df)
    if step is not None:
        return f"collapsed at step {step}"
    state = status.get("state") if isinstance(status, Mapping) else status
    if state == "failed":
        info = status if isinstance(status, Mapping) else {}
        reason = info.get("reason")
        text = "failed"
        if info.get("failed_step") is not None:
            text += f" at step {info['failed_step']}"
        elif info.get("step") is not None:
            text += f" after step {info['step']}"
        return text + (f" ({reason})" if reason else "")
    return degradation(run_df) or "stable"


def read_status(run_dir: str | Path | None) -> dict[str, Any]:
    """status.json of a run directory ({} if absent)."""
    if not run_dir:
        return {}
    return RunStore(run_dir).read_status()


def config_text(run_dir: str | Path) -> str:
    """A run's config.yaml as written (or dumped from the parsed config)."""
    path = Path(run_dir) / "config.yaml"
    return path.read_text() if path.is_file() else yaml.safe_dump({}, sort_keys=False)
