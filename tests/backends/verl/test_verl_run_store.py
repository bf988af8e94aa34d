"""The verl run's omgrpo run store, without Ray: the backend joins the `Tracking` verl's `fit`
builds (real `verl.utils.tracking.Tracking`), `fit` records the run's status, and a step's
rollout table carries the A_i read before answer weighting (fake TransferQueue, as in
test_verl_trainer). The CPU end-to-end test checks the same store after real verl steps."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from test_verl_trainer import LAUNCH, FakeTQ, metrics_rows, stored_rows
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1 import PPOTrainerSync
from verl.utils.tracking import Tracking

from omgrpo.backends.verl import trainer as trainer_mod
from omgrpo.backends.verl.config import compose_verl
from omgrpo.backends.verl.run_store import BACKEND_NAME
from omgrpo.backends.verl.trainer import OmgrpoTrainer, row_advantages
from omgrpo.tracking.store import RunStore


def make(tmp_path, *overrides: str) -> OmgrpoTrainer:
    cfg = compose_verl("paper_qwen3_1p7b", [*LAUNCH, f"run.root={tmp_path}", *overrides])
    trainer = OmgrpoTrainer(cfg)
    trainer.total_training_steps = 2
    trainer.global_steps = 0  # verl's init() sets it (the step of the checkpoint it loaded)
    return trainer


def fake_fit(steps: list[dict], fail_at: int | None = None):
    """verl's fit as far as the store sees it: build Tracking, log each step, count one past."""

    def fit(self, agent_loop_manager):
        self.logger = Tracking("omgrpo", "x", default_backend=["console"], config={})
        for metrics in steps:
            self.global_steps += 1
            if self.global_steps == fail_at:
                raise RuntimeError("worker died")
            self.logger.log(data=metrics, step=self.global_steps)
        self.global_steps += 1

    return fit


@pytest.mark.slow
def test_fit_writes_the_run_store_through_verls_tracking(tmp_path, monkeypatch):
    trainer = make(tmp_path, "seed=3")
    rows = [{"reward/total": np.float32(0.5), "note": "text", "val/acc": math.nan}, {"a": 2}]
    monkeypatch.setattr(PPOTrainerSync, "fit", fake_fit(rows))
    trainer.fit(None)
    assert trainer.logger.logger[BACKEND_NAME] is trainer.run_store  # beside verl's console
    assert "console" in trainer.logger.logger
    store = RunStore(tmp_path / "paper_qwen3_1p7b__om_grpo__s3")
    config = store.read_config()
    assert (config["backend"], config["seed"], config["run"]["name"]) == (
        "verl",
        3,
        "paper_qwen3_1p7b__om_grpo__s3",
    )
    assert config["model"]["path"] == "/models/m" and config["verl"]["data"]["seed"] == 3
    logged = store.metric_rows()
    assert logged[0][0] == 1 and logged[0][1]["reward/total"] == 0.5
    assert "note" not in logged[0][1] and math.isnan(logged[0][1]["val/acc"])
    assert logged[1] == (2, {"a": 2})
    status = store.read_status()
    assert (status["state"], status["step"], status["total_steps"]) == ("finished", 2, 2)
    assert len(store.peek_uuid()) == 32 and "versions" in store.read_provenance()


@pytest.mark.slow
def test_a_failed_fit_is_recorded_and_a_resume_keeps_the_identity(tmp_path, monkeypatch):
    trainer = make(tmp_path)
    monkeypatch.setattr(PPOTrainerSync, "fit", fake_fit([{"a": 1}, {"a": 2}], fail_at=2))
    with pytest.raises(RuntimeError, match="worker died"):
        trainer.fit(None)
    store = RunStore(tmp_path / "paper_qwen3_1p7b__om_grpo__s0")
    status = store.read_status()
    assert (status["state"], status["step"], status["error"]["type"]) == (
        "failed",
        1,
        "RuntimeError",
    )
    uuid = store.peek_uuid()
    # verl resumed from its step-1 checkpoint: same identity, the rows after step 1 dropped
    again = make(tmp_path)
    again.global_steps = 1
    monkeypatch.setattr(PPOTrainerSync, "fit", fake_fit([{"a": 22}]))
    again.fit(None)
    assert store.peek_uuid() == uuid
    assert store.metric_rows() == [(1, {"a": 1}), (2, {"a": 22})]
    assert store.read_status()["state"] == "finished"


@pytest.mark.slow
def test_the_step_rollout_table_holds_each_rows_advantage(tmp_path, monkeypatch):
    trainer = make(tmp_path, "omgrpo.algorithm.answer_weight=0.25")
    fake = FakeTQ(stored_rows())
    monkeypatch.setattr(trainer_mod, "tq", fake)
    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", lambda self, b, metrics: b)
    keys = list(fake.rows)
    # the A_i of verl's GRPO step, read before the answer tokens are weighted
    trainer._compute_advantage(KVBatchMeta(keys=keys, tags=[{} for _ in keys]), {})
    assert [trainer._row_advantages[k] for k in keys] == [1.0, -1.0, 0.5, -0.5, 0.0]

    # the metrics step of two rollouts of one prompt (keys of the metrics fixture)
    trainer._row_advantages = {"u_0_0": 0.7, "u_1_0": -0.7}
    rows = metrics_rows()
    for k, text in (("u_0_0", "so \\boxed{4}"), ("u_1_0", "so \\boxed{5}")):
        rows[k]["extra_fields"][trainer_mod.RECORD_KEY]["text"] = text
    monkeypatch.setattr(trainer_mod, "tq", FakeTQ(rows))
    monkeypatch.setattr(PPOTrainerSync, "_compute_metrics", lambda *a, **k: None)
    trainer.run_store = trainer_mod.RunStoreBackend(RunStore(tmp_path / "r"), 2, None)
    batch = KVBatchMeta(keys=list(rows), tags=[{"is_padding": k == "pad_0_0"} for k in rows])
    trainer._compute_metrics(batch, {}, {}, global_steps=1, epoch=0)
    trainer.run_store.log({"reward/total": 2.0}, step=1)
    table = pd.read_parquet(tmp_path / "r" / "rollouts" / "step_000001.parquet")
    assert table["prompt_id"].tolist() == ["toy/1", "toy/1"]
    assert table["answer"].tolist() == ["4", "5"] and table["correct"].tolist() == [True, False]
    assert table["advantage"].tolist() == pytest.approx([0.7, -0.7])
    assert table["reward"].tolist() == [2.0, 2.0] and table["reward_soft_vote"].tolist() == [1, 1]
    assert table["text"].tolist() == ["so \\boxed{4}", "so \\boxed{5}"]


def test_row_advantages_average_over_response_tokens_only():
    data = {
        "advantages": torch.nested.as_nested_tensor(
            [torch.tensor([2.0, 2.0, 9.0]), torch.tensor([5.0])], layout=torch.jagged
        ),
        "response_mask": torch.nested.as_nested_tensor(
            [torch.tensor([1, 1, 0]), torch.tensor([0])], layout=torch.jagged
        ),
    }
    assert row_advantages(data) == [2.0, 0.0]


@pytest.mark.slow
def test_each_validation_appends_its_problem_rows_to_problems_parquet(tmp_path, monkeypatch):
    """verl's validation outputs (`compute_score`'s `problem`, `pred`, `acc` per sample) reach
    the run store's problems.parquet when verl logs the validation's step (0: before training);
    a step validated again (a resume) replaces its rows."""

    def validated(accs):
        extra = {
            "problem": ["toy/a", "toy/a", "toy/b", "toy/b"],
            "pred": ["4", "4", "[no answer]", "2"],
        }
        return extra | {"acc": accs}

    def fit(self, agent_loop_manager):
        self.logger = Tracking("omgrpo", "x", default_backend=["console"], config={})
        runs = [(0, [1.0, 0.0, 0.0, 0.0]), (1, [1.0, 1.0, 0.0, 1.0]), (1, [1.0] * 4)]
        for step, accs in runs:  # the last: step 1 validated again after a resume
            self.global_steps = step
            val = self._val_metrics_update(
                ["toy"] * 4, ["u1", "u1", "u2", "u2"], validated(accs), []
            )
            self.logger.log(data=val, step=self.global_steps)

    trainer = make(tmp_path)
    monkeypatch.setattr(PPOTrainerSync, "fit", fit)
    trainer.fit(None)
    problems = RunStore(trainer.run_store.store.dir).read_problems()
    assert problems["step"].tolist() == [0, 0, 1, 1]  # step 1 validated twice: the last kept
    assert problems["problem_id"].tolist() == ["toy/a", "toy/b"] * 2
    assert problems["accuracy"].tolist() == [0.5, 0.0, 1.0, 1.0]
    assert problems["modal_answer"].tolist() == ["4", "2", "4", "2"]
    assert problems["modal_share"].tolist() == [1.0, 0.5, 1.0, 0.5]
