"""The per-GPU plan of verl runs (`omgrpo.models.verl_memory`): the one-GPU presets carry the
planner's settings and fit one 80 GiB GPU, every verl preset fits per GPU, and README's
"what fits where" table is what `omgrpo plan --table` prints."""

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from omgrpo import cli
from omgrpo.models.memory import GIB, model_shape
from omgrpo.models.verl_memory import (
    build_verl_plan,
    one_gpu_settings,
    plan_verl,
    preset_overrides,
    verl_settings,
)
from omgrpo.tools.plan_table import fit_table

pytest.importorskip("verl")
from omgrpo.backends.verl.config import compose_verl

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "model_configs"
BACKBONES = {
    "paper_qwen3_1p7b": CONFIGS / "qwen3-1.7b-base",
    "paper_llama3p2_3b": CONFIGS / "llama-3.2-3b-instruct",
    "paper_qwen2p5_7b": CONFIGS / "qwen2.5-7b",
}


@pytest.fixture(scope="module")
def presets():
    """Every verl preset composed once: the paper's 8-GPU ones and the one-GPU ones."""
    return {
        name: compose_verl(name, [f"actor_rollout_ref.model.path={model_dir}"])
        for base, model_dir in BACKBONES.items()
        for name in (base, f"{base}_1gpu")
    }


@pytest.mark.parametrize("preset", list(BACKBONES))
@pytest.mark.slow
def test_one_gpu_preset_has_the_planners_settings_and_fits_80_gib(presets, preset):
    cfg, model_dir = presets[f"{preset}_1gpu"], BACKBONES[preset]
    assert cfg.trainer.n_gpus_per_node == 1 and cfg.data.train_batch_size == 128
    derived = one_gpu_settings(model_shape(str(model_dir)), 80 * GIB, 512, 3072)
    for key, value in preset_overrides(derived).items():
        assert OmegaConf.select(cfg, key) == value, key  # the preset is the planner's
    plan = plan_verl(cfg, str(model_dir), 80 * GIB)
    assert plan.fits, plan.problems
    assert plan.vllm["sequences"] >= 8  # vLLM holds a whole group of 3584-token rollouts


def test_every_verl_preset_fits_80_gib_per_gpu(presets):
    for name, cfg in presets.items():
        plan = plan_verl(cfg, cfg.actor_rollout_ref.model.path, 80 * GIB)
        assert plan.fits, (name, plan.problems)


def test_rollout_stage_hand_computed_for_qwen3_without_offload(presets):
    shape = model_shape(str(BACKBONES["paper_qwen3_1p7b"]))
    plan = build_verl_plan(shape, verl_settings(presets["paper_qwen3_1p7b_1gpu"]), 80 * GIB)
    # vLLM's share of the device + the actor's fp32 weights (4 P) and AdamW moments (8 P)
    assert plan.stages["rollout"] == int(0.65 * 80 * GIB) + 12 * 1_720_574_976


@pytest.mark.slow
def test_plan_cli_for_verl_fits_80_and_refuses_24_naming_the_stage(capsys):
    model = f"actor_rollout_ref.model.path={BACKBONES['paper_qwen2p5_7b']}"
    args = ["plan", "backend=verl", "experiment=paper_qwen2p5_7b_1gpu", model, "--device-gb"]
    assert cli.main([*args, "80", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert cli.main([*args, "24"]) == 1
    assert re.search(r"verdict: does not fit: .*update needs [\d.]+ GiB", capsys.readouterr().out)


@pytest.mark.slow
def test_readme_table_is_what_plan_table_prints(capsys):
    assert cli.main(["plan", "--table"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == fit_table()
    assert printed in (ROOT / "README.md").read_text(), "README: paste `omgrpo plan --table`"
