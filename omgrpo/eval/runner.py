"""`evaluate(target, suite, ...)`: sample, grade and summarise a model on a benchmark suite.

Output, per evaluation directory (`<run>/eval/<suite>/` for the last checkpoint,
`<run>/eval/<suite>-<checkpoint>/` otherwise, or `--out`):

    <benchmark>.parquet   every sample: prompt_id, sample, question, text, answer, gold,
                          correct, answer_class
    <benchmark>.json      that benchmark's metrics, settings and checkpoint (the resume marker)
    summary.json          every benchmark's avg@k, pass@1..k, maj@k, extraction rate with
                          bootstrap 95% CIs, the grader version, sampling settings, the
                          checkpoint and why it was chosen, the run's identity

A benchmark whose `<benchmark>.json` matches the current settings, checkpoint and grader is
not evaluated again (resume after an interruption; finished benchmarks are kept).
"""

from __future__ import annotations

import datetime as _dt
import gc
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from omgrpo.core import answers as grader
from omgrpo.core.answers import Grader
from omgrpo.core.task import Problem
from omgrpo.errors import InputError, inside
from omgrpo.eval.checkpoints import Choice, choose_checkpoint
from omgrpo.eval.data import load_benchmark
from omgrpo.eval.metrics import summarize
from omgrpo.eval.sampler import NativeSampler, Sampler, VLLMSampler, require_vllm
from omgrpo.eval.suite import TOY_SOURCE, BenchmarkSpec, Suite, default_suite_name, load_suite
from omgrpo.staging import staged_file
from omgrpo.tracking.store import RunStore

CHUNK_PROBLEMS = 32  # problems sampled at once; progress is reported after each chunk


@dataclass
class Target:
    """What is evaluated: a run directory (its checkpoints) or a Hugging Face model dir."""

    path: Path
    config: dict[str, Any] | None  # the run's resolved config; None for a model directory
    export: dict[str, Any] | None = None  # omgrpo_export.json of a directory `omgrpo export` wrote

    @property
    def is_run(self) -> bool:
        return self.config is not None

    @property
    def run_config(self) -> dict[str, Any] | None:
        """The config of the run the weights come from (a run's, or an export's), if known."""
        return self.config if self.is_run else (self.export or {}).get("config")


def resolve_target(path: str | Path) -> Target:
    """A run directory, or a model directory (an export's files checked against the sha256 in
    its omgrpo_export.json: a damaged file is named before anything loads)."""
    from omgrpo.backends.native.export import verify_export

    path = Path(path)
    if (path / "config.yaml").exists():
        return Target(path, RunStore(path).read_config())
    if (path / "config.json").exists():
        return Target(path, None, verify_export(path))
    raise FileNotFoundError(
        f"{path}: neither a run directory (config.yaml) nor a Hugging Face model directory "
        "(config.json)"
    )


def grader_version() -> dict[str, Any]:
    """The grader's declared version (if any) and a hash of its package's source, so summaries
    graded by different code are told apart."""
    digest = hashlib.sha256()
    for path in sorted(Path(grader.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return {
        "module": "omgrpo.core.answers",
        "version": getattr(grader, "GRADER_VERSION", None),
        "source_sha256": digest.hexdigest()[:16],
        "math_verify": Grader().math_verify,
    }


def eval_dir(target: Target, suite: Suite, checkpoint: str, out: str | Path | None) -> Path:
    if out is not None:
        return Path(out)
    label = suite.name if checkpoint == "last" else f"{suite.name}-{checkpoint}"
    if target.is_run:
        return target.path / "eval" / label
    return Path("evals") / target.path.name / label


# ----------------------------------------------------------------------------------------
# Loading the model
# ----------------------------------------------------------------------------------------
def _task_config(target: Target):
    """The task whose toy test split `toy:test` means: the run's (an exported directory's run
    too); else the toy preset's."""
    from omegaconf import OmegaConf

    if target.run_config is not None:
        return OmegaConf.create(target.run_config).task
    from omgrpo.config import compose

    return compose(["experiment=toy"]).task


def load_policy(target: Target, choice: Choice, device: str = "auto"):
    """(model, tokenizer, model directory) with the chosen checkpoint's weights loaded."""
    from omegaconf import OmegaConf

    from omgrpo.backends.native.checkpoint import checkpoint_model
    from omgrpo.backends.native.export import read_checkpoint_state
    from omgrpo.models.loading import (
        base_model_dir,
        load_model,
        load_tokenizer,
        resolve_device,
        resolve_dtype,
    )
    from omgrpo.tasks import load_task

    if not target.is_run:
        dev = resolve_device(device)
        base = str(target.path)
        return load_model(base, dev, resolve_dtype("auto", dev)), load_tokenizer(base), base
    cfg = OmegaConf.create(target.config)
    dev = resolve_device(cfg.model.device if device == "auto" else device)
    base = base_model_dir(cfg.model, cfg.task, load_task(cfg.task))
    dtype = resolve_dtype(cfg.model.dtype, dev)
    if choice.path is None:
        model = load_model(base, dev, dtype)
    else:
        state = read_checkpoint_state(choice.path)  # verified: names a damaged file
        model = checkpoint_model(state, base, dev, dtype)  # a LoRA run's adapters merged
    return model.eval(), load_tokenizer(base), base


def build_sampler(
    target: Target,
    choice: Choice,
    backend: str,
    *,
    device: str,
    batch_size: int,
    llm_kwargs: dict[str, Any],
    scratch: ExitStack,
    scratch_dir: Path,
) -> Sampler:
    """The sampler for `backend`. vLLM loads the weights itself from a HF directory, so on
    that path this process never holds a torch copy next to vLLM's (`vllm_model_dir`)."""
    if backend == "native":
        model, tokenizer, _ = load_policy(target, choice, device)
        return NativeSampler(model, tokenizer, batch_size)
    if backend == "vllm":
        from omgrpo.models.loading import load_tokenizer

        require_vllm()  # before exporting a checkpoint for nothing
        model_dir = vllm_model_dir(target, choice, scratch, scratch_dir)
        return VLLMSampler(model_dir, load_tokenizer(model_dir), **llm_kwargs)
    raise InputError(key="--backend", found=backend, expected="native or vllm")


def vllm_model_dir(target: Target, choice: Choice, scratch: ExitStack, scratch_dir: Path) -> str:
    """The HF directory vLLM reads: a model directory as it is, a run's base, or a run's
    checkpoint exported (on the CPU, freed before this returns) into a temporary folder under
    `scratch_dir` (the evaluation's own folder: a 7B export does not fit every /tmp), removed
    when `scratch` closes."""
    from omgrpo.backends.native.export import export_checkpoint, run_base_dir

    if not target.is_run:
        return str(target.path)
    if choice.path is None:
        return run_base_dir(target.config)
    tmp = scratch.enter_context(tempfile.TemporaryDirectory(prefix=".vllm-", dir=scratch_dir))
    out = export_checkpoint(
        choice.path, Path(tmp) / "model", run_dir=target.path, label=choice.name, why=choice.why
    )
    gc.collect()
    return str(out)


# ----------------------------------------------------------------------------------------
# One benchmark
# ----------------------------------------------------------------------------------------
def benchmark_problems(spec: BenchmarkSpec, target: Target) -> list[Problem]:
    if spec.path == TOY_SOURCE:
        from omgrpo.tasks.registry import TASKS

        problems = TASKS["toy"](_task_config(target)).test
        return problems[: spec.limit] if spec.limit else problems
    return load_benchmark(
        spec.path, spec.question_key, spec.answer_key, spec.answer_format, limit=spec.limit
    )


def _problems_named(spec: BenchmarkSpec, target: Target, suite: Suite) -> list[Problem]:
    """`benchmark_problems`, a missing file named with its suite and benchmark."""
    try:
        return benchmark_problems(spec, target)
    except FileNotFoundError as e:
        raise InputError(
            str(e), key=f"suite '{suite.name}', benchmarks.{spec.name}.path", found=spec.path
        ) from e


def sample_and_grade(
    sampler: Sampler,
    problems: list[Problem],
    spec: BenchmarkSpec,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> pd.DataFrame:
    """One row per sample: the response, its boxed answer, whether it equals the gold answer
    (`omgrpo.core.answers.equivalent`) and its answer class among the problem's k samples.
    Each problem is graded by its own default `Grader` (its own time budget)."""
    rows = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        for start in range(0, len(problems), CHUNK_PROBLEMS):
            chunk = problems[start : start + CHUNK_PROBLEMS]
            for problem, texts in zip(chunk, sampler.generate(chunk, spec)):
                boxed = [grader.extract_boxed(t) for t in texts]
                found = [b.content if b else None for b in boxed]
                judge = Grader()
                classes = grader.cluster(found, judge)
                for i, (text, answer, cls) in enumerate(zip(texts, found, classes)):
                    rows.append(
                        {
                            "prompt_id": problem.id,
                            "sample": i,
                            "question": problem.question,
                            "text": text,
                            "answer": answer,
                            "gold": problem.answer,
                            "correct": answer is not None
                            and grader.equivalent(answer, problem.answer, judge),
                            "answer_class": cls,
                        }
                    )
            progress(min(start + CHUNK_PROBLEMS, len(problems)), len(problems))
    table = pd.DataFrame(rows)
    table["answer_class"] = table["answer_class"].astype("Int64")
    return table


def summarize_table(table: pd.DataFrame, seed: int = 0) -> dict[str, Any]:
    """Metrics and bootstrap CIs of a samples table (problems in order of appearance)."""
    groups = [g.sort_values("sample") for _, g in table.groupby("prompt_id", sort=False)]
    correct = [g["correct"].astype(bool).tolist() for g in groups]
    classes = [[None if pd.isna(c) else int(c) for c in g["answer_class"]] for g in groups]
    return {"n_problems": len(groups), **summarize(correct, classes, seed=seed)}


# ----------------------------------------------------------------------------------------
# The suite
# ----------------------------------------------------------------------------------------
def _progress_printer(name: str) -> Callable[[int, int], None]:
    """A tqdm bar on a terminal; one plain line per chunk otherwise (logs, CI, sweeps)."""
    start = time.perf_counter()
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        bar = tqdm(desc=name, unit="problem", dynamic_ncols=True)

        def update(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()
            if done >= total:
                bar.close()

        return update

    def line(done: int, total: int) -> None:
        print(
            f"  {name}: {done}/{total} problems ({time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    return line


def evaluate(
    target_path: str | Path,
    suite: Suite | None = None,
    *,
    checkpoint: str = "last",
    select_metric: str = "val/acc",
    select_split: str = "val",
    backend: str = "native",
    batch_size: int = 256,
    device: str = "auto",
    tensor_parallel_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    out: str | Path | None = None,
    track: bool = True,
    say: Callable[[str], None] = print,
) -> Path:
    """Evaluate a run's checkpoint (or a model directory) on every benchmark of `suite` (None:
    the run's own, `default_suite_name`); returns the evaluation directory (with summary.json).
    `tensor_parallel_size` / `gpu_memory_utilization` go to `vllm.LLM` (None: vLLM's default)."""
    llm_kwargs = _vllm_kwargs(backend, tensor_parallel_size, gpu_memory_utilization)
    target = resolve_target(target_path)
    suite = _checked_suite(suite, target)
    choice = _checkpoint_choice(target, suite, checkpoint, select_metric, select_split)
    out_dir = eval_dir(target, suite, checkpoint, out)
    version = grader_version()
    # every benchmark still to do is read and checked before anything is written or loaded
    earlier = {
        spec.name: _earlier_result(out_dir, spec, choice, version, say) for spec in suite.benchmarks
    }
    todo = {
        spec.name: _problems_named(spec, target, suite)
        for spec in suite.benchmarks
        if earlier[spec.name] is None
    }
    if todo and choice.path is not None:  # a damaged checkpoint is named before any write
        from omgrpo.backends.native.checkpoint import verify_checkpoint

        verify_checkpoint(choice.path)
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"evaluating {target.path} ({choice.why}) on suite '{suite.name}' -> {out_dir}")

    sampler = None
    results: dict[str, Any] = {}
    with ExitStack() as scratch:  # a checkpoint exported for vLLM lives until the suite is done
        for spec in suite.benchmarks:
            done = earlier[spec.name]
            if done is not None:
                say(f"  {spec.name}: done before, kept ({out_dir / f'{spec.name}.json'})")
                results[spec.name] = done
                continue
            problems = todo[spec.name]
            if sampler is None:  # loaded once, and only when a benchmark is not done yet
                sampler = build_sampler(
                    target,
                    choice,
                    backend,
                    device=device,
                    batch_size=batch_size,
                    llm_kwargs=llm_kwargs,
                    scratch=scratch,
                    scratch_dir=out_dir,
                )
            results[spec.name] = _run_benchmark(
                sampler, spec, problems, out_dir, choice, version, say
            )
    summary = {
        "suite": suite.name,
        "target": str(target.path),
        "run": _identity(target),
        "checkpoint": choice.record(),
        "grader": version,
        "benchmarks": results,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    with staged_file(out_dir / "summary.json") as tmp:  # whole or the earlier one, never half
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    if track and target.is_run:
        log_to_trackers(target, out_dir, summary, say)
    return out_dir


def _vllm_kwargs(backend: str, tensor_parallel_size, gpu_memory_utilization) -> dict:
    """The `vllm.LLM` settings given (None: vLLM's default); refused without vLLM."""
    llm_kwargs = {
        k: v
        for k, v in (
            ("tensor_parallel_size", tensor_parallel_size),
            ("gpu_memory_utilization", gpu_memory_utilization),
        )
        if v is not None
    }
    if llm_kwargs and backend != "vllm":
        raise InputError("--tensor-parallel-size / --gpu-memory-utilization need --backend vllm")
    return llm_kwargs


def _checked_suite(suite: Suite | None, target: Target) -> Suite:
    """The suite to run (None: the run's own), refused when empty or when a benchmark's name
    would leave the output folder."""
    if suite is None:
        suite = load_suite(default_suite_name(target.run_config))
    if not suite.benchmarks:  # an empty suite would overwrite a summary with nothing
        raise InputError(f"suite '{suite.name}' has no benchmarks")
    for spec in suite.benchmarks:  # file names in the output folder: never outside it
        inside(".", spec.name, f"suite '{suite.name}': benchmark name")
    return suite


def _checkpoint_choice(
    target: Target, suite: Suite, checkpoint: str, select_metric: str, select_split: str
) -> Choice:
    """The checkpoint to evaluate: one of a run's (`choose_checkpoint`), or a model directory
    as it is."""
    if target.is_run:
        test_paths = tuple(b.path for b in suite.benchmarks if b.path != TOY_SOURCE)
        return choose_checkpoint(
            target.path, checkpoint, target.config, select_metric, select_split, test_paths
        )
    if checkpoint != "last":
        raise InputError(
            f"{target.path} is a model directory: --checkpoint must be 'last'",
            key="--checkpoint",
            found=checkpoint,
        )
    return Choice("model", 0, None, f"the model directory {target.path}")


def _earlier_result(
    out_dir: Path,
    spec: BenchmarkSpec,
    choice: Choice,
    version: dict[str, Any],
    say: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """A benchmark's entry from an earlier evaluation into `out_dir`, if it was made with the
    same settings, checkpoint and grader and its table is there; else None (evaluate again).
    An unreadable entry (a run killed while writing it) is evaluated again, and said so."""
    marker = out_dir / f"{spec.name}.json"
    if not marker.exists():
        return None
    try:
        done = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        say(f"  {spec.name}: {marker} is unreadable ({e}); evaluated again")
        return None
    if not isinstance(done, dict):
        say(f"  {spec.name}: {marker} is not an entry; evaluated again")
        return None
    from omgrpo.backends.native.checkpoint import file_sha256

    table = out_dir / f"{spec.name}.parquet"
    same = (
        done.get("settings") == spec.settings()
        and done.get("checkpoint", {}).get("path") == choice.path
        and done.get("checkpoint", {}).get("step") == choice.step
        and done.get("grader") == version
        and table.exists()
    )
    if same and done.get("table_sha256") not in (None, file_sha256(table)):
        say(f"  {spec.name}: {table} does not match its entry {marker}; evaluated again")
        return None
    return done if same else None


def _run_benchmark(
    sampler: Sampler,
    spec: BenchmarkSpec,
    problems: list[Problem],
    out_dir: Path,
    choice: Choice,
    version: dict[str, Any],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Sample and grade one benchmark; writes its table (`<name>.parquet`) and entry
    (`<name>.json`, metrics with CIs and how they were made) and returns the entry."""
    from omgrpo.backends.native.checkpoint import file_sha256

    start = time.perf_counter()
    table = sample_and_grade(sampler, problems, spec, _progress_printer(spec.name))
    seconds = time.perf_counter() - start
    with staged_file(out_dir / f"{spec.name}.parquet") as tmp:  # the table before its entry
        table.to_parquet(tmp, index=False)
        table_sha256 = file_sha256(tmp)
    entry = {
        "benchmark": spec.name,
        "k": spec.k,
        **summarize_table(table, seed=spec.seed),
        "settings": spec.settings(),
        "checkpoint": choice.record(),
        "grader": version,
        "backend": sampler.name,
        "seconds": round(seconds, 2),
        "table_sha256": table_sha256,  # a later run keeps the entry only with this table
    }
    with staged_file(out_dir / f"{spec.name}.json") as tmp:
        tmp.write_text(json.dumps(entry, indent=2) + "\n")
    m = entry["metrics"]
    say(
        f"  {spec.name}: avg@{spec.k} {m[f'avg@{spec.k}']:.4f}  pass@{spec.k} "
        f"{m[f'pass@{spec.k}']:.4f}  maj@{spec.k} {m[f'maj@{spec.k}']:.4f}  "
        f"extracted {m['extract_rate']:.3f}  ({len(problems)} problems, {seconds:.1f} s)"
    )
    return entry


def _identity(target: Target) -> dict[str, Any]:
    from omgrpo.tracking import run_method, run_scale

    if not target.is_run:
        exported = target.export or {}
        keep = ("run", "run_dir", "checkpoint", "step", "config_sha256")
        origin = {k: exported[k] for k in keep if k in exported}
        return {"model": str(target.path), **({"exported_from": origin} if origin else {})}
    run = target.config.get("run") or {}
    return {
        "name": run.get("name", target.path.name),
        "experiment": run.get("experiment"),
        "variant": run.get("variant"),
        "method": run_method(target.config),
        "scale": run_scale(target.config),
        "seed": target.config.get("seed"),
        "ttt": bool((target.config.get("task") or {}).get("ttt")),
    }


def metric_rows(summary: dict[str, Any], label: str) -> dict[str, float]:
    """Flat tracker metrics: `eval/<label>/<benchmark>/<metric>` (+ `_ci_low` / `_ci_high`)."""
    out = {}
    for bench, entry in summary["benchmarks"].items():
        for name, value in entry["metrics"].items():
            out[f"eval/{label}/{bench}/{name}"] = value
        for name, (lo, hi) in entry["ci95"].items():
            out[f"eval/{label}/{bench}/{name}_ci_low"] = lo
            out[f"eval/{label}/{bench}/{name}_ci_high"] = hi
    return out


def log_to_trackers(target: Target, out_dir: Path, summary: dict, say) -> None:
    """Add the metrics (at the checkpoint's step) and the evaluation files to the run's MLflow
    / W&B run (`omgrpo.tracking`: continuing the run of this directory, with the run store's
    history replayed where a backend opens a new one); a failing backend only warns."""
    from omgrpo.tracking import build_trackers

    config = target.config
    tracking = config.get("tracking") or {}
    if not (tracking.get("mlflow") or tracking.get("wandb")):
        return
    steps = RunStore(target.path).read_metrics()
    last = int(steps["train/step"].max()) if "train/step" in steps else 0
    tracker = build_trackers(tracking, target.path.parent)
    run = config.get("run") or {}
    tracker.start(
        target.path,
        config,
        name=run.get("name", target.path.name),
        group=run.get("experiment"),
        tags=list(run.get("tags") or []),
        resume_step=last,
    )
    with tracker:
        tracker.log_metrics(summary["checkpoint"]["step"], metric_rows(summary, out_dir.name))
        tracker.log_artifact(out_dir)
    say(f"  logged to {', '.join(tracker.active) or 'no tracker (all failed)'}")
