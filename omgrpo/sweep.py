"""`omgrpo sweep`: run a W&B sweep file's grid locally, in parallel and resumably.

    omgrpo sweep sweeps/main_table.yaml [--jobs N] [--dry-run] [--retry-failed] [overrides...]
    omgrpo sweep --agent ENTITY/PROJECT/SWEEP_ID [--jobs N] [--count K] [--dry-run]

The sweep files in `sweeps/` are ordinary W&B sweep configs (`method: grid`, `parameters`
whose names are Hydra override keys, `command: ${env} ${interpreter} -m omgrpo train
${args_no_hyphens}`), so the same file drives `wandb sweep` + `wandb agent` on W&B's server and
this runner without any server. Each grid point becomes `python -m omgrpo train k=v ...` in a
subprocess:

- the run name is taken from the composed config (`omgrpo.config.compose`), so it is exactly
  the trainer's `<run.experiment>__<run.variant>__s<seed>`;
- `run.experiment` defaults to the sweep file's name (the run group), unless the sweep or the
  extra overrides set it, or the grid varies `experiment` (then each preset's own
  `run.experiment` keeps the runs apart, as it does under a W&B agent);
- a run whose `<run.root>/<run.name>/status.json` says `finished` or `collapsed` is skipped; so
  is one that says `failed` (it raised: the error is in status.json and the log; rerunning
  would most likely fail again) unless `--retry-failed`; any other partially written run
  (killed, or still `running` after a kill -9) is re-run with `run.resume=auto` (the default:
  the trainer continues it from its newest checkpoint, and would skip it too had it finished
  meanwhile, as it does a W&B agent's rerun);
- stdout and stderr of each run go to `<run.root>/<run.name>.log` (appended);
- `--jobs N` runs N at once, job slot i of N with its share of the machine (`job_split`):
  `OMP_NUM_THREADS = max(1, cores // N)` and, for native runs, `trainer.threads` the same
  unless set; the i-th of N equal slices of the visible GPUs in `CUDA_VISIBLE_DEVICES` (its
  size in `OMGRPO_JOB_GPUS`, which a verl run takes as `trainer.n_gpus_per_node` unless set).
  The MLflow store is created once beforehand (parallel first migrations would race) and each
  toy base the runs need is trained once beforehand (on one thread, as everywhere);
- `backend=verl` (in the sweep file or as an extra override, with a verl `experiment`): each
  point is composed with the verl backend (`compose_verl`), named by its
  `trainer.experiment_name`, with its run store at `<run.root>/<name>` (verl's checkpoints in
  its `checkpoints/`); as a native run, a finished one is skipped on a rerun and an unfinished
  one continues from its newest checkpoint (`run.resume=auto`);
- `--agent SWEEP_ID --jobs N` starts N `wandb agent SWEEP_ID` processes instead, agent i with
  the environment of job slot i (the threads and GPUs above), which the runs it starts
  inherit;
- `WANDB_MODE=offline` unless set; a failed run never stops the others; exit code 1 if any
  failed, listing their logs;
- `--eval SUITE [--eval-checkpoint last,best,base] [--tables DIR]`: after training, every
  finished run is evaluated (`omgrpo eval`, resumable, output appended to the run's log) and
  the paper's tables are written to DIR (`omgrpo tables`), so a sweep ends in its table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omgrpo.errors import InputError
from omgrpo.tracking.naming import SWEEP_ENV
from omgrpo.tracking.store import DONE_STATES

__all__ = [
    "PlannedRun",
    "SweepError",
    "agent_commands",
    "expand_grid",
    "job_split",
    "load_sweep",
    "main",
    "plan_runs",
]

FAILED_STATE = "failed"
SCALAR_TYPES = (str, int, float, bool)


class SweepError(InputError):
    """A malformed sweep file or grid (the message names the file and the key)."""


# ----------------------------------------------------------------------------------------
# Parsing and expansion
# ----------------------------------------------------------------------------------------
def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and validate a W&B sweep file for local grid runs; returns the parsed dict.

    Raises SweepError naming the file and the offending key: not a mapping, `method` missing or
    not `grid`, no `parameters`, a parameter without `values` (a non-empty list) or `value`, or
    a value that is not a scalar (nested blocks do not work with Hydra overrides).
    """
    from omgrpo.errors import read_yaml

    path = Path(path)
    if not path.exists():
        raise SweepError(f"{path}: no such sweep file")
    try:  # not a file, not UTF-8, not YAML: named with the line and column
        sweep = read_yaml(path, "a W&B sweep YAML file")
    except InputError as e:
        raise SweepError(str(e)) from e
    if not isinstance(sweep, dict):
        raise SweepError(f"{path}: a sweep file must be a mapping with 'method' and 'parameters'")
    method = sweep.get("method")
    if method is None:
        raise SweepError(f"{path}: missing key 'method' (only 'grid' runs locally)")
    if method != "grid":
        raise SweepError(
            f"{path}: method: {method!r} is not supported locally; only 'grid' can be expanded "
            "(run random/bayes sweeps with `wandb sweep` + `wandb agent`)"
        )
    params = sweep.get("parameters")
    if not isinstance(params, dict) or not params:
        raise SweepError(
            f"{path}: missing or empty key 'parameters' (a mapping of override key -> "
            "{values: [...]} or {value: x})"
        )
    for key, spec in params.items():
        where = f"{path}: parameters.{key}"
        if not isinstance(spec, dict):
            raise SweepError(f"{where}: must be a mapping with 'values' (a list) or 'value'")
        if "values" in spec:
            values = spec["values"]
            if not isinstance(values, list) or not values:
                raise SweepError(f"{where}.values: must be a non-empty list")
        elif "value" in spec:
            values = [spec["value"]]
        else:
            extra = f" (found {', '.join(map(str, spec))})" if spec else ""
            raise SweepError(
                f"{where}: needs 'values' (a list) or 'value'{extra}; distributions and nested "
                "parameter blocks cannot be expanded into a grid"
            )
        for value in values:
            if value is not None and not isinstance(value, SCALAR_TYPES):
                raise SweepError(
                    f"{where}: value {value!r} is not a scalar; nested values do not work as "
                    "Hydra overrides (use a flat key such as optim.lr)"
                )
    return sweep


def format_value(value: Any) -> str:
    """A parameter value as Hydra override text (`null`, `true`/`false`, numbers, strings)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def expand_grid(sweep: dict[str, Any]) -> list[list[str]]:
    """The cartesian product of the parameters, one `key=value` override list per grid point
    (parameter order as in the file, the first one varying slowest; `value` is a constant)."""
    axes = []
    for key, spec in sweep["parameters"].items():
        values = spec["values"] if "values" in spec else [spec["value"]]
        axes.append([f"{key}={format_value(v)}" for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


def override_key(override: str) -> str:
    """`+a.b=1` / `++a.b=1` / `~a.b` / `a.b=1` -> `a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*lists: list[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces the earlier one
    (in place, so the order stays readable)."""
    out: list[str] = []
    index: dict[str, int] = {}
    for overrides in lists:
        for ov in overrides:
            key = override_key(ov)
            if key in index:
                out[index[key]] = ov
            else:
                index[key] = len(out)
                out.append(ov)
    return out


# ----------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------
@dataclass
class PlannedRun:
    name: str
    root: Path
    overrides: list[str]
    state: str  # "new", "resume" or "skip"
    status: dict[str, Any] = field(default_factory=dict)
    mlflow_uri: str | None = None
    config: Any = field(default=None, repr=False)
    """The composed config (before run.resume / trainer.threads are added)."""
    backend: str = "native"

    @property
    def dir(self) -> Path:
        return self.root / self.name

    @property
    def log(self) -> Path:
        return self.root / f"{self.name}.log"


def status_if_readable(run_dir: Path) -> dict[str, Any]:
    """status.json of a run, {} if absent or unreadable (the sweep polls runs that are
    writing it; `RunStore.read_status` raises on a broken file instead)."""
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def plan_runs(
    path: str | Path, extra: list[str] | None = None, retry_failed: bool = False
) -> list[PlannedRun]:
    """Expand a sweep file into runs: overrides, composed name, and what to do with each
    (failed runs are skipped unless `retry_failed`)."""
    from omgrpo.config import compose
    from omgrpo.tracking import default_mlflow_uri, resolve_tracking_config

    path = Path(path)
    sweep = load_sweep(path)
    extra = list(extra or [])
    grid = expand_grid(sweep)
    merged = [merge_overrides(combo, extra) for combo in grid]
    keys = {override_key(ov) for overrides in merged for ov in overrides}
    experiments = {
        ov for overrides in merged for ov in overrides if override_key(ov) == "experiment"
    }
    defaults = []
    if "run.experiment" not in keys and len(experiments) <= 1:
        defaults.append(f"run.experiment={path.stem}")

    runs: list[PlannedRun] = []
    seen: dict[str, list[str]] = {}
    for combo in grid:
        overrides = merge_overrides(combo, defaults, extra)
        backend = backend_of(overrides)
        uri = None
        try:
            if backend == "verl":
                cfg = compose_verl_run(overrides)
                name = str(cfg.trainer.experiment_name)  # its run store: <root>/<name>
                root = Path(str(cfg.omgrpo.run.root))
            else:
                cfg = compose(overrides)
                name, root = str(cfg.run.name), Path(str(cfg.run.root))
                tracking = cfg.tracking
                if tracking.mlflow:
                    resolved = resolve_tracking_config(tracking).mlflow_uri
                    uri = str(resolved or default_mlflow_uri(root))
        except Exception as e:
            raise SweepError(f"{path}: run {' '.join(overrides)} does not compose: {e}") from e
        if backend == "native":
            check_run(path, overrides, cfg)
        key = str(root / name)
        if key in seen:
            raise SweepError(
                f"{path}: two grid points get the same run directory {key}:\n  "
                f"{' '.join(seen[key])}\n  {' '.join(overrides)}\n"
                "add the varying key to the run name (run.experiment / run.variant) or give "
                "them different run.root values"
            )
        seen[key] = overrides
        status = status_if_readable(root / name)  # both backends write status.json
        if status.get("state") in DONE_STATES or (
            status.get("state") == FAILED_STATE and not retry_failed
        ):
            state = "skip"
        elif (root / name).exists():
            state = "resume"
            overrides = merge_overrides(combo, defaults, ["run.resume=auto"], extra)
        else:
            state = "new"
        runs.append(PlannedRun(name, root, overrides, state, status, uri, cfg, backend))
    return runs


def check_run(path: Path, overrides: list[str], cfg: Any) -> None:
    """A native grid point's values in range (`config.check_values`: trainer.steps=0 or
    rollout.n=0 failed each run only once it started) and a run name that stays inside its
    run.root (`..` wrote runs beside it); SweepError naming the file and the run."""
    from omgrpo.config import check_values

    try:
        check_values(cfg)
    except InputError as e:
        raise SweepError(f"{path}: run {' '.join(overrides)}: {e}") from e
    name = str(cfg.run.name)
    if not name.strip() or Path(name).is_absolute() or ".." in Path(name).parts:
        raise SweepError(
            f"{path}: run {' '.join(overrides)}: run.name {name!r} would leave run.root "
            "(a name, or a path inside run.root, without '..')"
        )


def backend_of(overrides: list[str]) -> str:
    """The backend an override list trains with (`backend=...`, as `omgrpo train` reads it)."""
    backends = [ov.partition("=")[2] for ov in overrides if override_key(ov) == "backend"]
    return backends[-1] if backends else "native"


def compose_verl_run(overrides: list[str]):
    """The verl config `omgrpo train backend=verl ...` composes from these overrides."""
    from omgrpo.backends.verl.config import compose_verl
    from omgrpo.backends.verl.launch import parse

    experiment, rest, _, _ = parse(overrides)
    if experiment is None:
        raise ValueError("backend=verl needs experiment=<verl preset>")
    return compose_verl(experiment, rest)


# ----------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _prepare_mlflow(runs: list[PlannedRun], say) -> None:
    """Create every MLflow store the runs will write to, once, before they start in parallel."""
    uris = sorted({r.mlflow_uri for r in runs if r.mlflow_uri})
    if not uris:
        return
    from omgrpo.tracking import mlflow_client

    for uri in uris:
        if uri.startswith("sqlite:///"):
            Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        try:
            mlflow_client(uri)
        except Exception as e:  # the runs will warn and carry on without MLflow
            say(f"warning: could not prepare the MLflow store {uri}: {e}")


def visible_devices(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs a job may use: `CUDA_VISIBLE_DEVICES` if set (empty: none), else the ones torch
    sees (none without CUDA)."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch build with CUDA: no GPUs
        return []


def job_split(slot: int, jobs: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables that give job slot `slot` of `jobs` running at once (local
    `--jobs` runs or W&B agents) its share of the machine: `OMP_NUM_THREADS` (and
    `MKL_NUM_THREADS`) = max(1, cores // jobs) unless `env` sets them, and, when there are
    GPUs, the slot's slice of them in `CUDA_VISIBLE_DEVICES` (equal contiguous slices; with
    fewer GPUs than jobs, slots share them round-robin) and its size in `OMGRPO_JOB_GPUS`.
    Nothing for a single job."""
    env = os.environ if env is None else env
    if jobs <= 1:
        return {}
    threads = str(max(1, _cores() // jobs))
    out = {var: threads for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if var not in env}
    devices = visible_devices(env)
    if devices:
        if len(devices) >= jobs:
            size = len(devices) // jobs
            share = devices[slot * size : (slot + 1) * size]
        else:
            share = [devices[slot % len(devices)]]
        from omgrpo.backends.verl.config import JOB_GPUS_VAR  # the verl run reads it

        out["CUDA_VISIBLE_DEVICES"] = ",".join(share)
        out[JOB_GPUS_VAR] = str(len(share))
    return out


def agent_commands(sweep_id: str, jobs: int, count: int | None = None) -> list[tuple[dict, list]]:
    """(environment additions, command) of each of `jobs` W&B agents for `sweep_id`."""
    cmd = [sys.executable, "-m", "wandb", "agent", sweep_id]
    if count is not None:
        cmd += ["--count", str(count)]
    return [(job_split(slot, jobs), list(cmd)) for slot in range(jobs)]


def _run_agents(sweep_id: str, jobs: int, count: int | None, dry_run: bool) -> int:
    """Start the agents (`agent_commands`) and wait for them; the worst exit code."""
    agents = agent_commands(sweep_id, jobs, count)
    for slot, (extra, cmd) in enumerate(agents):
        split = " ".join(f"{k}={v}" for k, v in extra.items())
        print(f"agent {slot}: {split + ' ' if split else ''}{' '.join(cmd)}")
    if dry_run:
        return 0
    procs = [subprocess.Popen(cmd, env={**os.environ, **extra}) for extra, cmd in agents]
    try:
        return max(p.wait() for p in procs)
    finally:
        for p in procs:  # interrupted: do not leave agents behind
            if p.poll() is None:
                p.terminate()


def _prepare_toy_bases(runs: list[PlannedRun], say) -> None:
    """Train each toy base the runs need once, before they start in parallel (otherwise each
    parallel run would train the same base at the same time); a base trains on one thread
    wherever it is trained (`omgrpo.models.toy.ensure_toy_base`)."""
    from omgrpo.models.base_key import toy_base_key

    needed: dict[str, Any] = {}
    for run in runs:
        cfg = run.config
        if cfg is None or run.backend != "native" or cfg.model.path or cfg.task.name != "toy":
            continue
        key = toy_base_key(cfg.model, cfg.task)
        if not (Path(str(cfg.model.cache_dir)) / f"toy-base-{key}" / "config.json").exists():
            needed.setdefault(key, cfg)
    if not needed:
        return
    from omgrpo.models.loading import base_model_dir
    from omgrpo.tasks import load_task

    for key, cfg in needed.items():
        steps = cfg.model.warm_start.steps
        say(
            f"  preparing the shared toy base {key} once (shipped with omgrpo, or {steps} SFT steps)"
        )
        base_model_dir(cfg.model, cfg.task, load_task(cfg.task))


def _run_one(run: PlannedRun, env: dict[str, str]) -> tuple[str, float]:
    """Run one training subprocess; returns (outcome, seconds). outcome: done or failed: ..."""
    cmd = [sys.executable, "-m", "omgrpo", "train", *run.overrides]
    run.root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with run.log.open("a") as log:
        log.write(
            f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} omgrpo sweep ({run.state}): "
            f"{' '.join(cmd)}\n"
        )
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        return f"failed: exit code {proc.returncode}", seconds
    state = status_if_readable(run.dir).get("state")
    if state not in DONE_STATES:
        return f"failed: exited 0 but status is {state!r}", seconds
    return "done", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="omgrpo sweep",
        description="Run a W&B sweep file's grid locally (resumable; finished runs skipped).",
    )
    parser.add_argument(
        "sweep_file", nargs="?", help="a W&B sweep YAML with method: grid (sweeps/*.yaml)"
    )
    parser.add_argument("--jobs", "-j", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument(
        "--agent",
        metavar="SWEEP_ID",
        help="start --jobs `wandb agent SWEEP_ID` processes, each with its share of the "
        "threads and GPUs, instead of running a sweep file locally",
    )
    parser.add_argument("--count", type=int, help="with --agent: runs per agent (wandb's --count)")
    parser.add_argument("--dry-run", action="store_true", help="print the expanded runs and exit")
    parser.add_argument(
        "--retry-failed",
        action="store_true",
        help="also rerun (resume) runs whose status.json says failed (skipped by default)",
    )
    parser.add_argument(
        "--eval", metavar="SUITE", help="evaluate finished runs on this suite (paper, toy, YAML)"
    )
    parser.add_argument(
        "--eval-checkpoint",
        default="last",
        help="comma-separated checkpoints to evaluate (last, best, base, step_N; default last)",
    )
    parser.add_argument("--tables", metavar="DIR", help="with --eval: write the tables here")
    parser.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides for every run (key=value)"
    )
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if args.count is not None and args.count < 1:
        parser.error("--count must be >= 1")
    if args.agent:
        if args.sweep_file or args.overrides:
            parser.error("--agent takes no sweep file or overrides (the sweep server has them)")
        return _run_agents(args.agent, args.jobs, args.count, args.dry_run)
    if not args.sweep_file:
        parser.error("name a sweep file, or --agent SWEEP_ID")

    try:
        runs = plan_runs(args.sweep_file, args.overrides, retry_failed=args.retry_failed)
        checkpoints = check_eval_args(args.eval, args.eval_checkpoint, args.tables)
    except SweepError as e:
        print(f"omgrpo sweep: error: {e}", file=sys.stderr)
        return 2

    sweep_name = Path(args.sweep_file).stem
    todo = [r for r in runs if r.state != "skip"]
    if args.jobs > 1:
        threads = max(1, _cores() // args.jobs)
        for r in todo:
            if r.backend == "native" and not any(
                override_key(ov) == "trainer.threads" for ov in r.overrides
            ):
                r.overrides.append(f"trainer.threads={threads}")

    if args.dry_run:
        _print_plan(sweep_name, runs, todo, args.jobs)
        return 0

    status = _execute(sweep_name, runs, todo, args.jobs)
    if args.eval:
        status = max(status, _evaluate(runs, args.eval, checkpoints, args.jobs))
        if args.tables:
            status = max(status, _tables(runs, args.tables, checkpoints))
    return status


def check_eval_args(suite: str | None, checkpoints: str, tables: str | None) -> list[str]:
    """--eval's suite read and checked, each of --eval-checkpoint's names valid and --tables
    a folder (or new) before any run starts: they were found wrong only after the whole grid
    had trained. Returns the checkpoint names; SweepError naming the flag."""
    import re

    from omgrpo.eval.suite import load_suite

    names = [c.strip() for c in checkpoints.split(",") if c.strip()]
    if tables and not suite:
        raise SweepError("--tables needs --eval SUITE (the tables are of its evaluations)")
    if not suite:
        return names
    try:
        load_suite(suite)
    except (InputError, FileNotFoundError) as e:
        raise SweepError(f"--eval: {e}") from e
    bad = [
        c for c in names if c not in {"last", "best", "base"} and not re.fullmatch(r"step_\d+", c)
    ]
    if bad or not names:
        raise SweepError(
            f"--eval-checkpoint: {bad or checkpoints!r}: expected last, best, base or step_N"
        )
    if tables and Path(tables).exists() and not Path(tables).is_dir():
        raise SweepError(f"--tables {tables}: not a folder")
    return names


def _print_plan(sweep_name: str, runs: list[PlannedRun], todo: list[PlannedRun], jobs: int) -> None:
    """`--dry-run`: the job slots' shares of the machine and each run with its overrides."""
    print(f"sweep {sweep_name}: {len(runs)} runs ({len(todo)} to run)")
    for slot in range(jobs if jobs > 1 else 0):
        split = " ".join(f"{k}={v}" for k, v in job_split(slot, jobs).items())
        print(f"  job slot {slot}: {split}")
    for r in runs:
        label = {"new": "run", "resume": "resume", "skip": "skip"}[r.state]
        detail = f" ({r.status.get('state')})" if r.state == "skip" else ""
        print(f"  [{label}{detail}] {r.name}: {' '.join(r.overrides)}")


def _tables(runs: list[PlannedRun], out: str, checkpoints: list[str]) -> int:
    """`--tables DIR`: the paper's tables of the runs; 1 if there were none to write."""
    from omgrpo.analysis.paper_tables import write_tables

    try:
        tabled = next((c for c in checkpoints if c != "base"), "last")
        dirs = [r.dir for r in runs if r.dir.exists()]
        path = write_tables(dirs, out, tabled)
        print(f"tables: {path}")
    except FileNotFoundError as e:
        print(f"omgrpo sweep: no tables: {e}", file=sys.stderr)
        return 1
    return 0


def _evaluate(runs: list[PlannedRun], suite: str, checkpoints: list[str], jobs: int) -> int:
    """`omgrpo eval` on every finished run (a subprocess each, `jobs` at once, output
    appended to the run's log); finished evaluations are kept. Returns 1 if any failed."""
    done = [r for r in runs if status_if_readable(r.dir).get("state") in DONE_STATES]
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}

    def one(run: PlannedRun, checkpoint: str) -> tuple[PlannedRun, str, int]:
        cmd = [
            sys.executable,
            "-m",
            "omgrpo",
            "eval",
            str(run.dir),
            "--suite",
            suite,
            "--checkpoint",
            checkpoint,
        ]
        with run.log.open("a") as log:
            log.write(f"=== omgrpo sweep: {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
        return run, checkpoint, proc.returncode

    print(f"evaluating {len(done)} finished run(s) on suite {suite} ({', '.join(checkpoints)})")
    failed = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, r, c) for r in done for c in checkpoints]
        for future in as_completed(futures):
            run, checkpoint, code = future.result()
            word = "evaluated" if code == 0 else f"EVAL FAILED (exit {code}, log: {run.log})"
            print(f"  {word} {run.name} [{checkpoint}]", flush=True)
            failed += code != 0
    return 1 if failed else 0


def _print_skipped(runs: list[PlannedRun], say) -> None:
    for r in runs:
        if r.state == "skip":
            error = r.status.get("error") or {}
            why = f": {error.get('type')}: {error.get('message')}" if error else ""
            hint = "; --retry-failed reruns it" if r.status.get("state") == FAILED_STATE else ""
            say(f"  skipped {r.name} ({r.status.get('state')}{why}{hint})")


def _execute(sweep_name: str, runs: list[PlannedRun], todo: list[PlannedRun], jobs: int) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    counts = {"done": 0, "skipped": len(runs) - len(todo), "failed": 0, "running": 0}
    failed: list[tuple[PlannedRun, str]] = []
    lock = threading.Lock()

    env = {"WANDB_MODE": "offline", "MLFLOW_DISABLE_TELEMETRY": "true", **os.environ}
    env[SWEEP_ENV] = sweep_name  # each run's MLflow tag `sweep`

    def summary() -> str:
        return ", ".join(f"{counts[k]} {k}" for k in ("done", "skipped", "failed", "running"))

    console.print(
        f"sweep {sweep_name}: {len(runs)} runs, {counts['skipped']} already finished or failed "
        f"(skipped), {len(todo)} to run with {jobs} at once"
    )
    _print_skipped(runs, console.print)

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[summary]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(sweep_name, total=len(runs), summary=summary())
        progress.update(task, completed=counts["skipped"])
        if todo:
            if jobs > 1:
                _prepare_mlflow(todo, progress.console.print)
                _prepare_toy_bases(todo, progress.console.print)

            slots: queue.Queue[int] = queue.Queue()
            for slot in range(jobs):
                slots.put(slot)

            def work(run: PlannedRun) -> tuple[str, float]:
                with lock:
                    counts["running"] += 1
                    progress.update(task, summary=summary())
                verb = "resuming" if run.state == "resume" else "starting"
                progress.console.print(f"  {verb} {run.name}  (log: {run.log})")
                slot = slots.get()  # free while this run has it: its threads and GPUs
                try:
                    return _run_one(run, {**env, **job_split(slot, jobs, env)})
                except Exception as e:  # e.g. the log cannot be written
                    return f"failed: {e}", 0.0
                finally:
                    slots.put(slot)

            with ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(work, r): r for r in todo}
                for future in as_completed(futures):
                    run = futures[future]
                    outcome, seconds = future.result()
                    with lock:
                        counts["running"] -= 1
                        if outcome == "done":
                            counts["done"] += 1
                            progress.console.print(f"  done {run.name} ({seconds:.0f} s)")
                        else:
                            counts["failed"] += 1
                            failed.append((run, outcome))
                            progress.console.print(
                                f"  [red]FAILED[/red] {run.name} ({outcome}); log: {run.log}"
                            )
                        progress.update(task, advance=1, summary=summary())

    print(f"sweep {sweep_name}: {len(runs)} runs: {summary().replace(', 0 running', '')}")
    if failed:
        print("failed runs (logs):", file=sys.stderr)
        for run, outcome in failed:
            print(f"  {run.name}: {outcome}\n    {run.log}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
