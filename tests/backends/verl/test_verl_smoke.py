"""The GPU smoke test's pieces that run without a GPU: its checks on hand-made logged metrics,
its toy data in verl's format and its launch overrides through verl's own config checks.
(`tests/test_verl_e2e.py` applies the same checks to real verl runs on the CPU.)"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from omgrpo.backends.verl.config import compose_verl
from omgrpo.backends.verl.data import write_toy_parquet
from omgrpo.backends.verl.launch import check_verl
from omgrpo.backends.verl.smoke import (
    CAR_METRICS,
    COLLAPSE_AT_STEP_2,
    OMGRPO_METRICS,
    check_run,
    gpu_overrides,
    read_metrics,
)


def good_step(step: int, share: float) -> dict[str, float]:
    m = {k: 0.5 for k in (*OMGRPO_METRICS, *CAR_METRICS, "reward/soft_vote")}
    m.update({"pg/answer_weight_share": share, "collapse/detected_step": math.nan})
    m.update({"critic/advantages/max": 1.2, "critic/advantages/min": -0.7})
    if step == 2:
        m["collapse/detected_step"] = 2
    return m


def check(steps, w=0.0, expect=2):
    return check_run(
        steps,
        expect_steps=expect,
        answer_weight=w,
        car=True,
        reward_parts=("soft_vote",),
        collapse_step=2,
    )


def test_check_run_passes_a_good_run():
    assert check({1: good_step(1, 0.0), 2: good_step(2, 0.0)}) == []
    assert check({1: good_step(1, 0.3), 2: good_step(2, 0.1)}, w=1.0) == []


@pytest.mark.parametrize(
    ("change", "w", "message"),
    [
        ({"pg/answer_weight_share": 1e-9}, 0.0, "w = 0 but answer tokens hold"),
        ({"pg/answer_weight_share": 0.0}, 1.0, "w = 1.0 but answer PG weight share"),
        ({"pg/answer_weight_share": math.nan}, 1.0, "w = 1.0 but answer PG weight share"),
        ({"answer/frac": 0.0}, 0.0, "the loss saw no answer tokens"),
        ({"answers/extract_rate": 0.0}, 0.0, "no rollout reached a boxed answer"),
        ({"timing_s/car": 0.0}, 0.0, "timing_s/car"),
        ({"collapse/detected_step": math.nan}, 0.0, "collapse/detected_step nan"),
    ],
)
def test_check_run_names_what_is_wrong(change, w, message):
    steps = {1: good_step(1, w / 2), 2: {**good_step(2, w / 2), **change}}
    problems = check(steps, w=w)
    assert len(problems) == 1 and message in problems[0], problems


def test_check_run_needs_one_step_with_advantages_and_checks_only_those():
    """A later step whose groups all drew equal rewards (all advantages 0, so the answer share
    of the PG weight is 0/0) is not a failure; a run without any such signal is."""
    flat = {"critic/advantages/max": 0.0, "critic/advantages/min": 0.0}
    undefined = {**flat, "pg/answer_weight_share": math.nan}
    assert check({1: good_step(1, 0.0), 2: {**good_step(2, 0.0), **undefined}}) == []
    problems = check({1: {**good_step(1, 0.0), **flat}, 2: {**good_step(2, 0.0), **flat}})
    assert problems == ["advantages all zero in every step (rewards equal in every group)"]


def test_check_run_missing_metrics_and_steps():
    step = good_step(1, 0.0)
    del step["kl/answer"], step["timing_s/car"]
    problems = check({1: step})
    assert "logged steps [1], expected 1..2" in problems[0]
    assert "missing from verl's log: ['kl/answer', 'timing_s/car']" in problems[1]


def test_read_metrics_turns_null_into_nan(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "data": {"a": 1.5, "b": null}}\n\n')
    steps = read_metrics(path)
    assert steps[1]["a"] == 1.5 and math.isnan(steps[1]["b"])


def test_toy_parquet_is_verls_row_format(tmp_path):
    train, val = write_toy_parquet(tmp_path, n_train=3, n_val=2)
    rows = pd.read_parquet(train).to_dict(orient="records")
    assert len(rows) == 3 and len(pd.read_parquet(val)) == 2
    row = rows[1]
    assert row["data_source"] == "toy" and row["extra_info"]["index"] == 1
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert "\\boxed{}" in row["prompt"][0]["content"]
    assert row["reward_model"]["ground_truth"].isdigit()


@pytest.mark.parametrize("extra", [COLLAPSE_AT_STEP_2, ["method=mv"]])
@pytest.mark.slow
def test_gpu_overrides_pass_verls_checks(tmp_path, extra):
    train, val = write_toy_parquet(tmp_path, n_train=32, n_val=8)
    cfg = compose_verl("paper_qwen3_1p7b", gpu_overrides("/models/m", train, val, 3) + extra)
    check_verl(cfg)
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.trainer.n_gpus_per_node == 1
    assert cfg.actor_rollout_ref.rollout.n == 4 and cfg.trainer.total_training_steps == 3
