"""The `omgrpo` V1 trainer's overrides on fake TransferQueue / worker-group objects (CPU, real
verl classes, no Ray): `_compute_advantage` (answer weighting on the stored rows, padding rows,
entropy split), `_compute_metrics` (padding rows excluded, `timing_raw["car"]`, loss-metric
means, collapse stop) and `on_init_end` (the loss installed on the actor workers).
"""

from __future__ import annotations

try:
    import verl  # noqa: F401
except ModuleNotFoundError as exc:  # CI runs these with real verl: say how to get it
    raise ModuleNotFoundError(
        "tests/test_verl_*.py need verl: install with pip install -e '.[dev,verl]' (or make setup)"
    ) from exc

import math
from types import SimpleNamespace

import pytest
import torch
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1 import PPOTrainerSync
from verl.utils import tensordict_utils as tu

from omgrpo.backends.verl import (
    ANSWER_MASK_KEY,
    FORMAT_SCORE_KEY,
    RECORD_KEY,
    TOKEN_MASK_KEY,
    span_mask_key,
)
from omgrpo.backends.verl import trainer as trainer_mod
from omgrpo.backends.verl.config import compose_verl
from omgrpo.backends.verl.loss import omgrpo_ppo_loss
from omgrpo.backends.verl.record import CarRecord, RolloutRecord
from omgrpo.backends.verl.trainer import OmgrpoTrainer, entropy_split, validation_aliases
from omgrpo.core.masks import random_token_mask, top_entropy_mask

LAUNCH = [
    "actor_rollout_ref.model.path=/models/m",
    "data.train_files=train.parquet",
    "data.val_files=val.parquet",
]


def nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


class FakeTQ:
    """TransferQueue's kv_batch_get / kv_batch_put over a dict of rows (one dict per key)."""

    def __init__(self, rows: dict[str, dict]):
        self.rows, self.gets, self.puts = rows, [], []

    def kv_batch_get(self, keys, partition_id, select_fields):
        self.gets.append((list(keys), list(select_fields)))
        fields = {}
        for f in select_fields:
            values = [self.rows[k][f] for k in keys]
            if isinstance(values[0], torch.Tensor) and values[0].ndim == 1:
                fields[f] = nested(values)
            elif isinstance(values[0], torch.Tensor):
                fields[f] = torch.stack(values)
            else:
                fields[f] = values
        return tu.get_tensordict(fields)

    def kv_batch_put(self, keys, partition_id, fields):
        self.puts.append((list(keys), fields))
        names = list(fields.keys())  # (iterating a TensorDict gives rows)
        for i, k in enumerate(keys):
            for f in names:
                self.rows[k][f] = fields[f][i]
        return KVBatchMeta(keys=list(keys), tags=[{} for _ in keys], partition_id=partition_id)


@pytest.fixture(scope="module")
def make_trainer():
    cache = {}

    def make(*overrides: str) -> OmgrpoTrainer:
        if overrides not in cache:
            cache[overrides] = compose_verl("paper_qwen3_1p7b", [*LAUNCH, *overrides])
        return OmgrpoTrainer(cache[overrides])  # no Ray: workers are built later, in init()

    return make


def stored_rows(format_only: bool = False) -> dict[str, dict]:
    """2 prompts x G=2 after verl's GRPO step, plus a balance-batch padding row (row 0's
    fields with a one-token response, response_mask 0, another uid)."""
    lengths, answers = [4, 3, 5, 2], [[2, 3], [2], [], [0, 1]]
    adv, uids, fmt = [1.0, -1.0, 0.5, -0.5], ["a", "a", "b", "b"], [1.0, 0.0, 1.0, 1.0]
    rows = {}
    for k, (n, pos, a, u, f) in enumerate(zip(lengths, answers, adv, uids, fmt)):
        mask = torch.zeros(n, dtype=torch.int64)
        mask[pos] = 1
        rows[f"{u}_{k}_0"] = {
            "uid": u,
            "response_mask": torch.ones(n, dtype=torch.int64),
            "advantages": torch.full((n,), a),
            ANSWER_MASK_KEY: mask,
            FORMAT_SCORE_KEY: torch.tensor(f),
            "entropy": torch.arange(n, dtype=torch.float32) + 10 * k,
        }
    first = rows["a_0_0"]
    rows["pad_0_0"] = {
        **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in first.items()},
        "uid": "pad",
        "response_mask": torch.zeros(1, dtype=torch.int64),
        "advantages": torch.zeros(1),
        "entropy": torch.full((1,), 99.0),
    }
    return rows


@pytest.mark.parametrize("format_only", [False, True])
@pytest.mark.slow
def test_compute_advantage_weights_the_stored_rows(make_trainer, monkeypatch, format_only):
    extra = ["method=om_grpo_format_only"] if format_only else []
    trainer = make_trainer("omgrpo.algorithm.answer_weight=0.25", *extra)
    fake = FakeTQ(stored_rows())
    monkeypatch.setattr(trainer_mod, "tq", fake)
    seen = []
    monkeypatch.setattr(
        PPOTrainerSync, "_compute_advantage", lambda self, b, metrics: seen.append(b) or b
    )
    keys = list(fake.rows)
    batch = KVBatchMeta(keys=keys, tags=[{"is_padding": k.startswith("pad")} for k in keys])
    metrics = {}
    trainer._compute_advantage(batch, metrics)
    assert seen == [batch]  # verl's GRPO step ran first
    ((_, fields),) = fake.gets
    assert "entropy" in fields and (FORMAT_SCORE_KEY in fields) == format_only
    rows = fake.rows
    w = 0.0 if format_only else 0.25  # the format-only preset keeps w = 0
    a0 = rows["a_0_0"]["advantages"].tolist()
    if format_only:  # group a: formats 1, 0 -> answer tokens +-1/sqrt(2)
        assert a0 == pytest.approx([1.0, 1.0, 2**-0.5, 2**-0.5], rel=1e-5)
    else:
        assert a0 == [1.0, 1.0, w, w]
    assert rows["b_3_0"]["advantages"].tolist() == ([0.0, 0.0] if format_only else [-0.125] * 2)
    pad = rows["pad_0_0"]
    assert pad["advantages"].tolist() == [0.0] and pad[ANSWER_MASK_KEY].tolist() == [0]
    # entropy split over real rows only (the padding row's 99 never counts)
    answer_entropy = [2.0, 3.0, 12.0, 30.0, 31.0]
    reasoning_entropy = [0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 22.0, 23.0, 24.0]
    assert metrics["entropy/answer"] == pytest.approx(sum(answer_entropy) / 5)
    assert metrics["entropy/reasoning"] == pytest.approx(sum(reasoning_entropy) / 9)


@pytest.mark.parametrize("method", ["om_grpo_no_car_random_mask", "om_grpo_no_car_top_entropy"])
@pytest.mark.slow
def test_compute_advantage_draws_the_generic_masks_over_the_step(make_trainer, monkeypatch, method):
    """The driver reads the agent loop's span fields (and the old pass's entropy), draws the
    mask over all the step's rows (a row's position: its rollout index; the padding row never
    counts), zeroes the advantage of the masked tokens and stores the mask for the loss."""
    trainer = make_trainer(f"method={method}")
    trainer.global_steps = 4
    rows = stored_rows()
    for row in rows.values():  # the paper's span, as the agent loop hands it
        row[span_mask_key("boxed")] = row[ANSWER_MASK_KEY].clone()
    fake = FakeTQ(rows)
    monkeypatch.setattr(trainer_mod, "tq", fake)
    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", lambda self, b, metrics: b)
    keys = list(rows)
    metrics = {}
    trainer._compute_advantage(KVBatchMeta(keys=keys, tags=[{} for _ in keys]), metrics)
    ((_, fields),) = fake.gets
    assert span_mask_key("boxed") in fields and "entropy" in fields
    lengths = [4, 3, 5, 2, 1]
    resp = torch.zeros(5, 5, dtype=torch.bool)
    for i, n in enumerate(lengths[:4]):
        resp[i, :n] = True
    if method.endswith("random_mask"):  # as many tokens as each row's boxed span: 5 of 14
        counts = [2, 1, 0, 2, 0]
        expected = random_token_mask(resp, counts, seed=trainer.omgrpo.seed, step=4)
        assert metrics["mask/frac"] == pytest.approx(5 / 14)
    else:  # the old pass's entropies 0..3, 10..12, 20..24, 30..31; the padding row's 99 not
        entropy = torch.zeros(5, 5)
        for i, n in enumerate(lengths[:4]):
            entropy[i, :n] = torch.arange(n) + 10.0 * i
        expected = top_entropy_mask(entropy, resp, 0.2)
        assert int(expected.sum()) == 14 - 3  # 30, 31 and 24 kept (the top fifth, rounded up)
        assert metrics["mask/frac"] == pytest.approx(11 / 14)
    for i, key in enumerate(keys):
        n, row = lengths[i], rows[key]
        assert torch.equal(row[TOKEN_MASK_KEY].bool(), expected[i, :n]), key
        assert (row["advantages"][expected[i, :n]] == 0).all()
        # w = 1 in both presets: the other tokens keep A_i
        kept = row["advantages"][~expected[i, :n]]
        assert (kept == [1.0, -1.0, 0.5, -0.5, 0.0][i]).all()


@pytest.mark.slow
def test_compute_advantage_without_stored_entropy(make_trainer, monkeypatch):
    """Rollout-correction bypass mode skips the old-log-prob pass: no entropy to split."""
    trainer = make_trainer("algorithm.rollout_correction.bypass_mode=true")
    fake = FakeTQ(stored_rows())
    monkeypatch.setattr(trainer_mod, "tq", fake)
    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", lambda self, b, metrics: b)
    metrics = {}
    keys = list(fake.rows)
    trainer._compute_advantage(KVBatchMeta(keys=keys, tags=[{} for _ in keys]), metrics)
    assert "entropy" not in fake.gets[0][1] and "entropy/answer" not in metrics


def record(k: int, answer: str, uid_start: float) -> dict:
    """One rollout's record as the agent loop writes it (`RolloutRecord.to_dict`)."""
    car = CarRecord(
        pairs=[(k, 1 - k)],
        answers=[answer],
        truncated=0,
        unclosed=0,
        empty=0,
        start=uid_start,
        end=uid_start + 2.5,
    )
    return RolloutRecord(
        answer=answer,
        correct=answer == "4",
        label="4",
        prompt_id="toy/1",
        session=k,
        rewards={"soft_vote": 1.0, "format": 1.0},
        grading_timeouts=0,
        car=car,
    ).to_dict()


def metrics_rows(answers=("4", "5")) -> dict[str, dict]:
    rows = {
        f"u_{k}_0": {
            "uid": "u",
            "extra_fields": {RECORD_KEY: record(k, a, 100.0)},
            "rm_scores": torch.tensor([0.0, 2.0]),
        }
        for k, a in enumerate(answers)
    }
    rows["pad_0_0"] = {"uid": "pad", "extra_fields": {}, "rm_scores": torch.tensor([0.0, 0.0])}
    return rows


def run_compute_metrics(trainer, monkeypatch, rows, step=3):
    fake = FakeTQ(rows)
    monkeypatch.setattr(trainer_mod, "tq", fake)
    handed = []
    monkeypatch.setattr(
        PPOTrainerSync,
        "_compute_metrics",
        lambda self, b, metrics, timing_raw, global_steps, epoch: handed.append(
            (dict(metrics), dict(timing_raw))
        ),
    )
    keys = list(rows)
    batch = KVBatchMeta(keys=keys, tags=[{"is_padding": k.startswith("pad")} for k in keys])
    metrics = {"actor/kl/answer_sum": 3.0, "actor/kl/answer_count": 4.0}
    metrics |= {"actor/kl/reasoning_sum": 1.0, "actor/kl/reasoning_count": 0.0}
    trainer._compute_metrics(batch, metrics, {"gen": 9.0}, global_steps=step, epoch=0)
    return fake, handed


@pytest.mark.slow
def test_compute_metrics_excludes_padding_and_times_car(make_trainer, monkeypatch):
    trainer = make_trainer()
    fake, handed = run_compute_metrics(trainer, monkeypatch, metrics_rows())
    ((keys, _),) = fake.gets
    assert keys == ["u_0_0", "u_1_0"]  # the padding row (no omgrpo record) is never read
    ((metrics, timing_raw),) = handed  # then verl's own _compute_metrics
    assert timing_raw == {"gen": 9.0, "car": 2.5} and metrics["time/car"] == 2.5
    assert metrics["kl/answer"] == 0.75 and math.isnan(metrics["kl/reasoning"])
    assert not any(k.startswith("actor/kl/") for k in metrics)
    assert metrics["reward/total"] == 2.0 and metrics["acc/train"] == 0.5
    assert math.isnan(metrics["collapse/detected_step"])


@pytest.mark.slow
def test_collapse_stop_ends_training_after_the_step(make_trainer, monkeypatch):
    keep = make_trainer("omgrpo.collapse.patience=1")
    keep.total_training_steps = 100
    run_compute_metrics(keep, monkeypatch, metrics_rows(("4", "4")))
    assert keep.total_training_steps == 100  # detected, but stop is off

    stop = make_trainer("omgrpo.collapse.patience=1", "omgrpo.collapse.stop=true")
    stop.total_training_steps = 100
    _, handed = run_compute_metrics(stop, monkeypatch, metrics_rows(("4", "4")), step=7)
    assert handed[0][0]["collapse/detected_step"] == 7
    # verl's fit loop runs while global_steps <= total_training_steps: step 8 never starts
    assert stop.total_training_steps == 7


@pytest.mark.slow
def test_on_init_end_installs_the_loss_on_the_actor_workers(make_trainer, monkeypatch):
    trainer = make_trainer("omgrpo.algorithm.answer_weight=0.5")
    installed, base = [], []
    trainer.actor_rollout_wg = SimpleNamespace(set_loss_fn=installed.append)
    monkeypatch.setattr(PPOTrainerSync, "on_init_end", lambda self: base.append(self))
    trainer.on_init_end()
    (fn,) = installed
    assert fn.func is omgrpo_ppo_loss and fn.keywords["answer_weight"] == 0.5
    assert fn.keywords["config"].use_kl_loss and base == [trainer]  # then verl's weight sync


def test_the_driver_metric_names_are_in_the_metric_table(make_trainer, monkeypatch, metric_table):
    """docs/metrics.md documents what the driver adds to verl's metrics: the step's
    diagnostics with CAR, the loss's token means, the old-pass entropy and validation."""
    _, handed = run_compute_metrics(make_trainer(), monkeypatch, metrics_rows())
    ((metrics, _),) = handed
    val = validation_aliases(["toy"] * 4, ["a", "a", "b", "b"], {"acc": [1.0, 0.0, 0.0, 0.0]})
    entropy = entropy_split(torch.rand(2, 3), torch.ones(2, 3), torch.eye(2, 3))
    names = set(metrics) | set(val) | set(entropy)
    assert metric_table.undocumented(names, "verl") == []
    assert {"val/acc", "val/pass@2", "entropy/answer", "car/span_s", "time/car"} <= names
