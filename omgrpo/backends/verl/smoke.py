"""`python -m omgrpo.backends.verl.smoke --model PATH`: check a verl install in minutes.

Runs `omgrpo train backend=verl` twice on toy-world problems (written as verl parquet) with a
real model on one GPU and vLLM: OM-GRPO with CAR for 2 steps with the collapse stop forced
(the detector is set to fire at step 2, so a 3-step run must end after step 2), then one step
of majority voting (w = 1). Then it checks what verl's file logger recorded (`check_run`):
omgrpo's metrics reached verl's logger, rewards and advantages were not all zero, the answer
masks reached the loss (`answer/frac` > 0) and the answer tokens' share of the PG weight is
exactly 0 at w = 0 and > 0 at w = 1. `scripts/gpu_smoke.sh` wraps it; the CPU test
(`tests/backends/verl/test_verl_e2e.py`) runs the same checks on a toy model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from omgrpo.backends.verl.data import write_toy_parquet

__all__ = ["COLLAPSE_AT_STEP_2", "OMGRPO_METRICS", "check_run", "main", "read_metrics"]

OMGRPO_METRICS = (
    "reward/total", "answers/unique_per_prompt", "answers/extract_rate", "answers/top_vote_acc",
    "acc/train", "kl/answer", "kl/reasoning", "entropy/answer", "entropy/reasoning",
    "answer/frac", "pg/answer_weight_share", "collapse/detected_step",
)  # fmt: skip
"""omgrpo's names that every training step must log through verl (CAR adds `CAR_METRICS`)."""

CAR_METRICS = ("car/pool_size", "car/unclosed", "car/top_vote_acc", "timing_s/car")

COLLAPSE_AT_STEP_2 = [
    "omgrpo.collapse.stop=true",
    "omgrpo.collapse.max_unique_per_prompt=1e9",
    "omgrpo.collapse.min_mode_share=0",
    "omgrpo.collapse.patience=2",
]
"""Overrides under which any step counts as collapsed: the detector fires at step 2."""


def read_metrics(path: Path) -> dict[int, dict[str, Any]]:
    """verl's file logger (`trainer.logger=[...,file]`): {step: metrics}; JSON null -> nan."""
    steps = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            steps[row["step"]] = {k: math.nan if v is None else v for k, v in row["data"].items()}
    return steps


def check_run(
    steps: dict[int, dict[str, Any]],
    *,
    expect_steps: int,
    answer_weight: float,
    car: bool,
    reward_parts: tuple[str, ...],
    collapse_step: int | None = None,
) -> list[str]:
    """What is wrong with a run's logged steps (empty: all checks passed).

    Every step must log omgrpo's metrics (`OMGRPO_METRICS`, `reward/<part>`, with CAR
    `CAR_METRICS`), boxed answers (`answers/extract_rate` > 0) and answer tokens seen by the loss
    (`answer/frac` > 0). At least one step must have non-zero advantages of both signs, and in
    every such step the answer tokens' share of the per-token PG weight |A| must be exactly 0 at
    w = 0 and > 0 otherwise (a step whose groups all drew equal rewards, which sampling can give
    a later step of a tiny batch, has no PG weight to share). With `collapse_step`, the collapse
    detector must have fired there (`collapse/detected_step`).
    """
    problems = []
    informative = 0
    if sorted(steps) != list(range(1, expect_steps + 1)):
        problems.append(f"logged steps {sorted(steps)}, expected 1..{expect_steps}")
    wanted = set(OMGRPO_METRICS) | {f"reward/{p}" for p in reward_parts}
    wanted |= set(CAR_METRICS) if car else set()
    for step, m in sorted(steps.items()):
        missing = sorted(wanted - set(m))
        if missing:
            problems.append(f"step {step}: omgrpo metrics missing from verl's log: {missing}")
            continue
        if not m["answers/extract_rate"] > 0:
            problems.append(f"step {step}: no rollout reached a boxed answer")
        if not m["answer/frac"] > 0:
            problems.append(f"step {step}: the loss saw no answer tokens (answer/frac 0 or nan)")
        if m.get("critic/advantages/max", 0) > 0 > m.get("critic/advantages/min", 0):
            informative += 1
            share = m["pg/answer_weight_share"]
            if answer_weight == 0 and share != 0.0:
                problems.append(
                    f"step {step}: w = 0 but answer tokens hold {share} of the PG weight"
                )
            if answer_weight > 0 and not share > 0:
                problems.append(
                    f"step {step}: w = {answer_weight} but answer PG weight share {share}"
                )
        if car and not m["timing_s/car"] > 0:
            problems.append(f"step {step}: timing_s/car = {m['timing_s/car']}")
        detected = m["collapse/detected_step"]
        if collapse_step is not None and step >= collapse_step and detected != collapse_step:
            problems.append(f"step {step}: collapse/detected_step {detected}, not {collapse_step}")
    if steps and not informative:
        problems.append("advantages all zero in every step (rewards equal in every group)")
    return problems


def run_train(
    out: Path, args: list[str], env: dict[str, str] | None = None, timeout: float | None = None
) -> int:
    """`omgrpo train backend=verl <args>` in a fresh process, logging metrics to
    out/metrics.jsonl and its output to out/train.log; returns the exit code (raises
    `subprocess.TimeoutExpired` after `timeout` seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if env is None else env)
    env["VERL_FILE_LOGGER_PATH"] = str(out / "metrics.jsonl")
    cmd = [sys.executable, "-m", "omgrpo", "train", "backend=verl", *args]
    cmd.append("trainer.logger=[console,file]")
    with open(out / "train.log", "w") as log:
        proc = subprocess.run(
            cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        )
    return proc.returncode


def gpu_overrides(model: str, train: Path, val: Path, steps: int) -> list[str]:
    """Overrides of a preset for a small run on one GPU (8 prompts x G = 4, 512 response
    tokens, vLLM)."""
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=8",
        "data.max_response_length=512",
        "omgrpo.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local HF checkpoint, e.g. Qwen3-0.6B")
    parser.add_argument("--out", default="verl-smoke", help="output directory")
    parser.add_argument("--experiment", default="paper_qwen3_1p7b", help="verl preset")
    parser.add_argument("overrides", nargs="*", help="extra verl / omgrpo overrides")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    train, val = write_toy_parquet(out / "data", n_train=32, n_val=8)
    runs = {
        # name: (overrides, expected steps, w, CAR, reward parts)
        "om_grpo": (COLLAPSE_AT_STEP_2, 3, 2, 0.0, True, ("soft_vote", "format"), 2),
        "mv": (["method=mv"], 1, 1, 1.0, False, ("majority_vote",), None),
    }
    failed = False
    for name, (extra, total, expect, w, car, parts, collapse) in runs.items():
        overrides = [f"experiment={args.experiment}", *gpu_overrides(args.model, train, val, total)]
        overrides += extra + args.overrides
        print(f"verl smoke: {name}: omgrpo train backend=verl {' '.join(overrides)}", flush=True)
        rc = run_train(out / name, overrides)
        if rc != 0:
            print(f"verl smoke: {name}: FAILED, exit code {rc} (see {out / name / 'train.log'})")
            failed = True
            continue
        steps = read_metrics(out / name / "metrics.jsonl")
        problems = check_run(
            steps,
            expect_steps=expect,
            answer_weight=w,
            car=car,
            reward_parts=parts,
            collapse_step=collapse,
        )
        for p in problems:
            print(f"verl smoke: {name}: FAILED: {p}")
        failed |= bool(problems)
        if not problems:
            for step, m in sorted(steps.items()):
                keys = ("reward/total", "answer/frac", "pg/answer_weight_share", "kl/answer")
                shown = " ".join(f"{k}={m[k]:.4g}" for k in keys)
                print(f"verl smoke: {name}: step {step}: {shown}")
            print(f"verl smoke: {name}: passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
