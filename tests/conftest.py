"""Shared fixtures: a tiny toy config whose base model is trained once per test session."""

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A toy run that takes well under a second per step on 2 CPU cores.
TINY = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.warm_start.steps=5",
    "model.warm_start.batch_size=8",
    "model.warm_start.check_problems=0",  # tests/test_toy_worlds.py checks a base on its own
    "task.n_train=32",
    "task.n_val=8",
    "task.n_test=8",
    "rollout.n=4",
    "rollout.max_new_tokens=24",
    "eval.num_prompts=4",
    "eval.k=2",
    "eval.every=2",
    "trainer.prompts_per_step=2",
    "trainer.progress=false",
    "optim.lr=1e-3",
    # trackers have their own tests; a fresh MLflow DB per run dir costs ~8 s
    "tracking.mlflow=false",
    "tracking.wandb=false",
]


@pytest.fixture(scope="session")
def base_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("base-cache"))


@pytest.fixture
def tiny_overrides(tmp_path, base_cache):
    return [*TINY, f"model.cache_dir={base_cache}", f"run.root={tmp_path / 'runs'}"]
