"""Each DAPO-family option trains on the native trainer: a tiny two-step toy run per option
logs its `dapo/*` metrics and a finite update (`omgrpo.core.dapo`, docs/configuration.md)."""

import math

import pytest

from omgrpo.backends.native.trainer import train
from omgrpo.config import compose
from omgrpo.tracking.store import RunStore

pytestmark = pytest.mark.slow

OPTIONS = {
    "clip_higher": (["algorithm.clip_low=0.2", "algorithm.clip_high=0.28"], []),
    "seq_mean_token_mean": (["algorithm.agg=seq-mean-token-mean"], []),
    "seq_mean_token_sum": (["algorithm.agg=seq-mean-token-sum"], []),
    "dynamic_sampling": (
        ["algorithm.dynamic_sampling=true"],
        ["dapo/dropped_groups", "dapo/kept_rollouts"],
    ),
    "overlong_filter": (["algorithm.overlong_filter=true"], ["dapo/truncated"]),
    "overlong_buffer": (
        ["algorithm.overlong_buffer=8", "algorithm.overlong_penalty_factor=0.5"],
        ["dapo/overlong_penalty"],
    ),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_dapo_option_trains(tiny_overrides, option):
    overrides, logged = OPTIONS[option]
    cfg = compose(
        [*tiny_overrides, *overrides, "trainer.steps=2", "eval.every=0", f"run.name={option}"]
    )
    run = train(cfg)
    rows = RunStore(run).read_metrics()
    rows = rows[rows["step"] > 0] if "step" in rows else rows
    assert len(rows) >= 2
    last = rows.iloc[-1]
    assert math.isfinite(last["loss/total"]) and math.isfinite(last["grad/norm"])
    assert last["train/skipped_steps"] == 0
    for key in logged:
        assert key in rows and rows[key].notna().all(), key
    if option == "overlong_buffer":
        assert (rows["dapo/overlong_penalty"] <= 0).all()
    if option == "dynamic_sampling":
        assert (rows["dapo/dropped_groups"] >= 0).all() and (rows["dapo/dropped_groups"] <= 2).all()
