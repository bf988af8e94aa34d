"""`omgrpo` command line: train, plan, sync, sweep, bench, eval, export, data, tables, figures,
report.

`omgrpo train [key=value ...] [--multirun]` is a Hydra app over `experiments/config.yaml`;
everything after `train` is passed to Hydra unchanged, so `--cfg job`, `--help` and
`--multirun` behave as in any Hydra application.
"""

from __future__ import annotations

import os
import sys

USAGE = """usage: omgrpo [--debug] <command> [args]

Bad input is refused with `omgrpo <command>: error: ...` and exit status 2 (the traceback only
with --debug, before or after the command, or OMGRPO_DEBUG=1); any other failure prints its
traceback: a bug to report.

commands:
  train [overrides...]   train (default: OM-GRPO on the toy world, CPU). Examples:
                           omgrpo train trainer.steps=20 run.root=runs
                           omgrpo train method=mv seed=1
                           omgrpo train experiment=paper model.path=/models/Qwen3-1.7B-Base \\
                             task.train_path=math_train.jsonl task.val_path=math500.jsonl
                           omgrpo train --cfg job      (print the composed config)
                           omgrpo train backend=verl experiment=paper_qwen3_1p7b --dry-run
                             (verl backend, docs/verl.md; --dry-run prints verl's composed
                             config without starting Ray)
  plan [overrides...] [--device-gb N] [--json]
                         expected peak memory of each stage of `omgrpo train` for the config
                         and model.path's config.json (no weights), and whether it fits a
                         device of N GiB (default: the visible GPU's); exit 1 when it does not,
                         naming the stage and the knobs that would make it fit
  plan backend=verl experiment=X actor_rollout_ref.model.path=DIR --device-gb N [--json]
                         per-GPU plan of a verl preset (vLLM, log-prob, update stages)
  plan --table           what fits where: the paper's backbones on 24 / 48 / 80 GiB
  base [--ship [--note TEXT]] [overrides...]
                         the toy base of a config (e.g. experiment=toy_shortcut): installed from
                         omgrpo/bases/ or trained, with its acceptance checks; --ship copies it
                         into omgrpo/bases/ with its recipe and sha256s (docs/toy-worlds.md)
  prm train [--ship [--note TEXT]] [overrides...]
                         the toy PRM of a config's toy base (e.g. experiment=toy_shortcut):
                         installed from omgrpo/bases/ or trained (a step classifier, minutes),
                         with its checks printed; --ship copies it into omgrpo/bases/
  sync RUN_DIR --to mlflow|wandb [--mlflow-uri URI] [--wandb-project P] [--wandb-mode M]
                         replay a run's local store (config, metrics, rollouts) into a tracker,
                         e.g. after its backend failed during training
  sweep sweeps/X.yaml [--jobs N] [--dry-run]
                         run a W&B sweep file's grid locally (resumable; finished runs skipped)
  sweep --agent SWEEP_ID --jobs N
                         N W&B agents, each with its share of the threads and GPUs
  bench car [--steps N] [--json] [--variants a_mv,c_om_grpo_car,...] [overrides...]
                         per-stage seconds of MV, OM-GRPO, OM-GRPO + CAR, and n = 16 / 64;
                         CAR's matmul FLOP/s against a dense matmul
  bench step [--steps N] [--json] [--baseline DIR] [--vs-trl] [--repeats N] [overrides...]
                         seconds per step by stage, rollout tokens/s and peak memory (MV, toy,
                         16x8 and 64x8); --baseline DIR: the same for the omgrpo tree in DIR;
                         --vs-trl: TRL's GRPOTrainer; --repeats: interleaved rounds, medians
  bench memory [--json] [--configs a,b] [--gen-tokens N]
                         the memory plan against the peak RSS of one step on the CPU (the
                         backbones' layers and head layout, widths / 16, the paper's lengths)
  bench generate [--json] [--configs a,b] [--device cpu|cuda] [--compare REF] [--toy]
                         decoder tokens/s and ms per decode step against the memory-bandwidth
                         limit, kernel-launching ops and host reads per step; REF: another tree
  eval RUNS_OR_MODELS... [--suite paper|toy|SUITE.yaml] [--checkpoint last|best|step_N|base]
                         [--backend native|vllm] [--tensor-parallel-size N]
                         [--gpu-memory-utilization F]
                         sample, grade and summarise benchmarks (avg@k, pass@k, maj@k, 95% CIs)
                         into <run>/eval/<suite>/ and the run's MLflow / W&B run (docs/eval.md);
                         the default suite is the run's own (toy for a toy run); a directory
                         `omgrpo export` wrote is evaluated as a model directory
  export RUN OUT [--checkpoint last|best|step_N]
                         a run's checkpoint as a Hugging Face model directory (safetensors,
                         tokenizer, generation config, omgrpo_export.json) for vLLM / transformers
  data convert SOURCE --out FILE.jsonl [--split S] [--config C] [--force]
                         a local benchmark copy (file or HF datasets cache) -> question/answer rows
  data prepare --backend verl --out DIR [FILES... | toy:train|val|test] [--suite S] [--force]
                         [KEY=VALUE...]
                         benchmark files (MATH, GSM8K, AIME, AMC) / toy splits -> verl parquet,
                         read with eval's loaders; bad rows named (file, row), nothing written
  tables RUNS_OR_EVALS... --out DIR
                         the paper's tables (markdown + LaTeX) from eval summaries
  figures RUNS... --out DIR
                         the paper's figures (PNG + PDF) from run directories
  report RUNS... --out reports/<name>/
                         report.md with tables, figures, configs and a verdict per run
  study-report RUNS... --prereg PREREGISTRATION.md --out DIR
                         a pre-registered study's predictions marked confirmed / refuted /
                         inconclusive (means, 95% CIs over seeds), figures, base checks
  compact RUNS...        each run's metrics.jsonl -> metrics.jsonl.xz (the same bytes, about 7x
                         smaller; every reader takes either): how studies commit their runs;
                         runs still running are left alone
"""


def main(argv: list[str] | None = None) -> int:
    """Run a verb. Bad input (`omgrpo.errors.InputError`, a missing or existing file, a file
    that does not parse, a config that does not compose) is printed as `omgrpo <verb>: error:
    ...` and exits 2; its traceback only with `--debug` (before or after the verb) or
    OMGRPO_DEBUG=1. Any other exception is a bug: its traceback, and a line asking to report
    it."""
    argv, debug = take_debug(list(sys.argv[1:] if argv is None else argv))
    verb = _verb_name(argv)
    before = os.environ.get("OMGRPO_DEBUG")
    if debug:  # read by omgrpo.errors.debug_enabled, and by the processes a verb starts
        os.environ["OMGRPO_DEBUG"] = "1"
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        raise
    except SystemExit as e:  # argparse's usage errors (2, printed) and --help (0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except Exception as e:  # the one place that reports every failure
        return report_failure(verb, e)
    finally:
        if debug and before is None:
            os.environ.pop("OMGRPO_DEBUG", None)
        elif debug:
            os.environ["OMGRPO_DEBUG"] = before


def take_debug(argv: list[str]) -> tuple[list[str], bool]:
    """`argv` without its `--debug` flags (anywhere before a `--`, so `omgrpo eval RUN --debug`
    works as `omgrpo --debug eval RUN`), and whether there was one."""
    cut = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:cut] if a != "--debug"]
    return head + argv[cut:], len(head) < cut


def _verb_name(argv: list[str]) -> str:
    """`omgrpo eval`, `omgrpo data convert`: the prefix of the error lines."""
    if not argv:
        return "omgrpo"
    if argv[0] in {"data", "prm"} and len(argv) > 1 and not argv[1].startswith("-"):
        return f"omgrpo {argv[0]} {argv[1]}"
    backends = [a for a in argv[1:] if a.startswith("backend=") and a != "backend=native"]
    if argv[0] in {"train", "plan"} and backends:  # `omgrpo train backend=verl: error: ...`
        return f"omgrpo {argv[0]} {backends[-1]}"
    return f"omgrpo {argv[0]}"


def expected_error(e: BaseException) -> bool:
    """Bad input rather than a bug: InputError (and the older errors of its kind: checkpoint,
    benchmark data and sweep errors), a file that is missing, exists, or is the wrong kind, a
    JSON / YAML file that does not parse, and a Hydra config that does not compose. A plain
    ValueError, KeyError or TypeError is not: it is a bug to report (verbs raise InputError)."""
    from omgrpo.errors import InputError

    if isinstance(e, InputError | FileNotFoundError | FileExistsError):
        return True
    if isinstance(e, NotADirectoryError | IsADirectoryError | PermissionError):
        return True
    import json

    if isinstance(e, json.JSONDecodeError):
        return True
    for module, name in (("yaml", "YAMLError"), ("hydra.errors", "HydraException")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            return True
    from omgrpo.eval.checkpoints import CheckpointError
    from omgrpo.eval.data import BenchmarkDataError
    from omgrpo.sweep import SweepError

    return isinstance(e, CheckpointError | BenchmarkDataError | SweepError)


def report_failure(verb: str, e: BaseException) -> int:
    """Print an exception that reached `main`: bad input in a few lines (exit 2), else the
    traceback and a request to report the bug (exit 1)."""
    import traceback

    from omgrpo import __version__
    from omgrpo.errors import debug_enabled, short_message

    if expected_error(e):
        if debug_enabled():
            traceback.print_exception(e, file=sys.stderr)
        message = short_message(e)
        if isinstance(e, OSError) and e.filename and str(e.filename) not in message:
            message = f"{e.filename}: {message}"
        print(f"{verb}: error: {message}", file=sys.stderr)
        return 2
    traceback.print_exception(e, file=sys.stderr)
    print(
        f"{verb}: internal error ({type(e).__name__}): this is a bug in omgrpo {__version__}; "
        "please report it with the command line and the traceback above",
        file=sys.stderr,
    )
    return 1


# verbs that load a model (transformers' generation code): transformers is told first that
# scikit-learn is absent (omgrpo.models.hf_import)
MODEL_VERBS = {"train", "base", "prm", "eval", "export", "bench"}


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command in MODEL_VERBS:
        from omgrpo.models.hf_import import hide_sklearn_from_transformers

        hide_sklearn_from_transformers()
    if command == "train":
        return _train(rest)
    if command == "plan":
        return _plan(rest)
    if command == "base":
        return _base(rest)
    if command == "prm":
        return _prm(rest)
    if command == "sync":
        return _sync(rest)
    if command == "compact":
        return _compact(rest)
    if command == "sweep":
        from omgrpo.sweep import main as sweep_main

        return sweep_main(rest)
    if command == "bench":
        from omgrpo.tools.bench import main as bench_main

        return bench_main(rest)
    if command in {"eval", "data", "export"}:
        from omgrpo.eval import cli as eval_cli

        return getattr(eval_cli, f"{command}_main")(rest)
    if command in {"figures", "report", "tables", "study-report"}:
        from omgrpo.analysis import cli as analysis_cli

        return getattr(analysis_cli, f"{command.replace('-', '_')}_main")(rest)
    print(f"omgrpo: unknown command '{command}'\n\n{USAGE}", file=sys.stderr)
    return 2


def _train(overrides: list[str]) -> int:
    """`backend=NAME` picks the trainer: the folder omgrpo/backends/NAME/, whose `launch.main`
    takes the command line (so a new backend is one new folder)."""
    import importlib

    backends = [o.partition("=")[2] for o in overrides if o.startswith("backend=")]
    backend = backends[-1] if backends else "native"
    available = available_backends()
    if backend not in available:
        from omgrpo.errors import InputError

        raise InputError(f"unknown backend '{backend}' ({', '.join(available)})")
    return importlib.import_module(f"omgrpo.backends.{backend}.launch").main(overrides)


def available_backends() -> list[str]:
    """The backends under omgrpo/backends/ (folders with a `launch.py`), native first."""
    from pathlib import Path

    found = {p.parent.name for p in (Path(__file__).parent / "backends").glob("*/launch.py")}
    return sorted(found, key=lambda name: (name != "native", name))


def _plan(args: list[str]) -> int:
    """`omgrpo plan`: 0 fits, 1 does not fit, 2 cannot plan (no model.path, no device size)."""
    if "--table" in args or "backend=verl" in args:  # what fits where; verl's per-GPU plan
        from omgrpo.tools.plan_table import main as plan_table_main

        return plan_table_main(args)
    import argparse
    import json

    import torch

    from omgrpo.config import check_values, compose
    from omgrpo.errors import InputError, check_number
    from omgrpo.models.memory import GIB, check_model_config, format_plan, plan_memory

    parser = argparse.ArgumentParser(prog="omgrpo plan", description="Memory plan of a config.")
    parser.add_argument("--device-gb", type=float, help="device memory in GiB (default: the GPU's)")
    parser.add_argument("--json", action="store_true", help="the plan as JSON")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `omgrpo train`")
    ns = parser.parse_intermixed_args(args)  # overrides before or after the flags
    if ns.device_gb is not None:
        check_number(ns.device_gb, "--device-gb", minimum=0, exclusive_minimum=True)
    cfg = compose(ns.overrides)
    check_values(cfg)
    if not cfg.model.path:
        raise InputError(
            "set model.path to a directory with the model's config.json (no weights needed); "
            "the toy model (model.path null) is a few MB and is not planned",
            key="model.path",
        )
    check_model_config(cfg.model.path)
    if ns.device_gb is not None:
        device_bytes = int(ns.device_gb * GIB)
    elif torch.cuda.is_available():
        device_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        raise InputError("no GPU visible; give the device memory with --device-gb N")
    device_type = "cpu" if cfg.model.device == "cpu" else "cuda"
    plan = plan_memory(cfg, cfg.model.path, device_bytes, device_type)
    print(json.dumps(plan.to_json(), indent=2) if ns.json else format_plan(plan))
    return 0 if plan.fits else 1


def _base(args: list[str]) -> int:
    import argparse
    from pathlib import Path

    from omgrpo.models.base_key import toy_base_recipe
    from omgrpo.models.basecheck import format_checks, read_base_checks
    from omgrpo.models.bases import ship_base
    from omgrpo.models.loading import base_model_dir
    from omgrpo.tasks.registry import load_task

    parser = argparse.ArgumentParser(prog="omgrpo base", description="A config's toy base.")
    parser.add_argument("--ship", action="store_true", help="copy it into omgrpo/bases/")
    parser.add_argument("--note", help="provenance note stored in the manifest (with --ship)")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `omgrpo train`")
    ns = parser.parse_args(args)
    ship, overrides = ns.ship, ns.overrides
    cfg = _toy_config("omgrpo base", overrides, ns)
    base = Path(base_model_dir(cfg.model, cfg.task, load_task(cfg.task)))
    checks = read_base_checks(base)
    print(f"base: {base}")
    print(format_checks(checks) if checks else "base checks: none stored (check_problems=0?)")
    if ship:
        command = " ".join(["omgrpo base", *overrides])
        recipe = toy_base_recipe(cfg.model, cfg.task)
        dest = ship_base(base, recipe, command, note=ns.note)
        print(f"shipped: {dest}")
    return 0


def _prm(args: list[str]) -> int:
    """`omgrpo prm train`: the toy PRM of a config, with its checks (docs/prm.md)."""
    import argparse

    from omgrpo.models.bases import write_shipped
    from omgrpo.models.loading import base_model_dir
    from omgrpo.models.toy_prm import (
        ensure_toy_prm,
        format_prm_checks,
        read_prm_checks,
        toy_prm_recipe,
    )
    from omgrpo.tasks.registry import load_task

    parser = argparse.ArgumentParser(prog="omgrpo prm", description="The toy PRM of a config.")
    parser.add_argument("action", choices=["train"])
    parser.add_argument("--ship", action="store_true", help="copy it into omgrpo/bases/")
    parser.add_argument("--note", help="provenance note stored in the manifest (with --ship)")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `omgrpo train`")
    ns = parser.parse_args(args)
    cfg = _toy_config("omgrpo prm", ns.overrides, ns)
    splits = load_task(cfg.task)
    seen = {p.question for split in (splits.train, splits.val, splits.test) for p in split}
    prm_dir = ensure_toy_prm(cfg, base_model_dir(cfg.model, cfg.task, splits), seen)
    checks = read_prm_checks(prm_dir)
    print(f"toy PRM: {prm_dir}")
    print(format_prm_checks(checks) if checks else "toy PRM checks: none stored")
    if ns.ship:
        if checks is None or not checks["passed"]:
            print(f"omgrpo prm: {prm_dir} did not pass its checks; not shipped", file=sys.stderr)
            return 1
        key = prm_dir.name.removeprefix("toy-prm-")
        recipe = toy_prm_recipe(cfg.model, cfg.task, cfg.reward.prm.toy)
        command = " ".join(["omgrpo prm train", *ns.overrides])
        print(f"shipped: {write_shipped(prm_dir, key, recipe, command, note=ns.note)}")
    return 0


def _toy_config(prog: str, overrides: list[str], ns):
    """`omgrpo base` / `omgrpo prm train`'s config: composed, its values in range, a toy model
    on the toy task; --note only with --ship (InputError otherwise)."""
    from omgrpo.config import check_values, compose
    from omgrpo.errors import InputError

    if ns.note is not None and not ns.ship:
        raise InputError("--note is stored with --ship only", key="--note", found=ns.note)
    cfg = compose(overrides)
    check_values(cfg)
    if cfg.model.path or cfg.task.name != "toy":
        what = "toy bases" if prog == "omgrpo base" else "the toy PRM"
        raise InputError(
            f"{prog} makes {what} only",
            found={"model.path": cfg.model.path, "task": cfg.task.name},
            expected="model.path unset and the toy task",
        )
    return cfg


def _sync(args: list[str]) -> int:
    import argparse

    from omgrpo.tracking.store import RunStore
    from omgrpo.tracking.sync import BACKENDS, sync_run

    parser = argparse.ArgumentParser(prog="omgrpo sync", description="Replay a run into a tracker.")
    parser.add_argument("run_dir", help="a run directory (runs/<name>)")
    parser.add_argument("--to", required=True, choices=BACKENDS)
    parser.add_argument(
        "--mlflow-uri",
        help="MLflow tracking URI (default: the run's, else sqlite:///<runs root>/mlflow.db)",
    )
    parser.add_argument("--wandb-project", help="W&B project (default: the run's)")
    parser.add_argument("--wandb-mode", choices=["online", "offline"], help="W&B mode")
    ns = parser.parse_args(args)
    tracking = dict(RunStore(ns.run_dir).read_config().get("tracking") or {})
    for key, value in (
        ("mlflow_uri", ns.mlflow_uri),
        ("wandb_project", ns.wandb_project),
        ("wandb_mode", ns.wandb_mode),
    ):
        if value is not None:
            tracking[key] = value
    try:
        run_id = sync_run(ns.run_dir, ns.to, tracking)
    except Exception as e:  # the tracker refused: a bad URI, a server that is down
        if not type(e).__module__.startswith(("mlflow", "wandb")):
            raise
        from omgrpo.errors import InputError

        where = tracking.get("mlflow_uri") if ns.to == "mlflow" else tracking.get("wandb_project")
        raise InputError(
            f"{ns.to} refused the sync ({type(e).__name__}: {str(e).splitlines()[0][:300]})",
            key="--mlflow-uri" if ns.to == "mlflow" else "--wandb-project",
            found=where,
        ) from e
    print(f"synced {ns.run_dir} to {ns.to}: run id {run_id}")
    return 0


def _compact(args: list[str]) -> int:
    import argparse

    from omgrpo.analysis.load import find_run_dirs
    from omgrpo.tracking.store import RunStore

    parser = argparse.ArgumentParser(
        prog="omgrpo compact",
        description="Replace each finished run's metrics.jsonl by metrics.jsonl.xz (lossless).",
    )
    parser.add_argument("runs", nargs="+", help="run directories or folders of them")
    ns = parser.parse_args(args)
    run_dirs = find_run_dirs(*ns.runs)  # a missing path, no run: FileNotFoundError, exit 2
    done, running = 0, []
    for run_dir in run_dirs:
        store = RunStore(run_dir)
        if store.read_status().get("state") == "running":
            running.append(run_dir.name)  # its trainer appends to metrics.jsonl
            continue
        done += store.compact_metrics()
    already = len(run_dirs) - done - len(running)
    print(f"compacted {done} of {len(run_dirs)} runs; {already} were compact already")
    if running:
        print(f"left alone, still running: {', '.join(running)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
