"""`model.path=` with a local HF checkpoint directory and a JSONL dataset (no download)."""

import json

import pytest
from omegaconf import OmegaConf

from omgrpo.backends.native.trainer import train
from omgrpo.config import compose
from omgrpo.models.tokenizer import build_char_tokenizer
from omgrpo.models.toy import build_toy_model
from omgrpo.tracking.store import RunStore

pytestmark = pytest.mark.slow


def _model_and_data(tmp_path):
    """A "real" checkpoint on disk (config.json + weights + tokenizer files + chat template, a
    Qwen3) and a JSONL dataset of 8 problems."""
    tok = build_char_tokenizer()
    arch = OmegaConf.create(dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1))
    model_dir = tmp_path / "my-model"
    build_toy_model(arch, tok, seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def test_trains_a_local_hf_checkpoint_on_a_jsonl_dataset(tmp_path, tiny_overrides):
    model_dir, data = _model_and_data(tmp_path)
    cfg = compose(
        [
            *tiny_overrides,
            f"model.path={model_dir}",
            "task.name=files",
            f"task.train_path={data}",
            f"task.val_path={data}",
            "trainer.steps=2",
            "run.name=hf",
        ]
    )
    run = train(cfg)
    df = RunStore(run).read_metrics()
    assert list(df["train/step"]) == [0, 1, 2]
    assert RunStore(run).read_status()["base_model"] == str(model_dir)
    rollouts = RunStore(run).read_rollouts()
    assert set(rollouts["prompt_id"]) <= {f"train-{i}" for i in range(8)}


def test_trains_with_gradient_checkpointing(tmp_path, tiny_overrides):
    """model.gradient_checkpointing=true (experiment=paper's setting): the update used to fail
    with an IndexError for Llama-family models (the lean scorer read a cache HF had dropped)."""
    model_dir, data = _model_and_data(tmp_path)
    cfg = compose(
        [
            *tiny_overrides,
            f"model.path={model_dir}",
            "model.gradient_checkpointing=true",
            "method=self_certainty",  # rewards that vary for an untrained model: a gradient
            "trainer.grad_probe_every=1",  # the probe's two backward passes, checkpointed too
            "task.name=files",
            f"task.train_path={data}",
            f"task.val_path={data}",
            "trainer.steps=2",
            "run.name=gc",
        ]
    )
    df = RunStore(train(cfg)).read_metrics()
    assert list(df["train/step"]) == [0, 1, 2]
    updates = df[df["train/step"] > 0]
    assert (updates["train/skipped_steps"] == 0).all()
    assert (updates["grad/norm"] > 0).all() and updates["grad/norm"].notna().all()
    assert (updates["grad/reasoning_norm"] > 0).all()


def test_missing_model_path_is_a_clear_error(tiny_overrides, tmp_path):
    cfg = compose([*tiny_overrides, f"model.path={tmp_path / 'nope'}", "trainer.steps=1"])
    with pytest.raises(FileNotFoundError, match=r"model\.path '.*nope' does not exist"):
        train(cfg)
