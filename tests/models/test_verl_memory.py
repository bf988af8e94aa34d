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


@pytest.mark.parametrize("preset", list(BACKBONES))
def test_one_gpu_preset_has_the_planners_settings_and_fits_80_gib(preset):
    model_dir = BACKBONES[preset]
    cfg = compose_verl(f"{preset}_1gpu", [f"actor_rollout_ref.model.path={model_dir}"])
    assert cfg.trainer.n_gpus_per_node == 1 and cfg.data.train_batch_size == 128
    derived = one_gpu_settings(model_shape(str(model_dir)), 80 * GIB, 512, 3072)
    for key, value in preset_overrides(derived).items():
        assert OmegaConf.select(cfg, key) == value, key  # the preset is the planner's
    plan = plan_verl(cfg, str(model_dir), 80 * GIB)
    assert plan.fits, plan.problems
    assert plan.vllm["sequences"] >= 8  # vLLM holds a whole group of 3584-token rollouts


def test_rollout_stage_hand_computed_for_qwen3_without_offload():
    shape = model_shape(str(BACKBONES["paper_qwen3_1p7b"]))
    st = verl_settings(compose_verl("paper_qwen3_1p7b_1gpu"))
    plan = build_verl_plan(shape, st, 80 * GIB)
    # vLLM's share of the device + the actor's fp32 weights (4 P) and AdamW moments (8 P)
    assert plan.stages["rollout"] == int(0.65 * 80 * GIB) + 12 * 1_720_574_976


@pytest.mark.parametrize("preset", [*BACKBONES, *(f"{p}_1gpu" for p in BACKBONES)])
def test_every_verl_preset_fits_80_gib_per_gpu(capsys, preset):
    model_dir = BACKBONES[preset.removesuffix("_1gpu")]
    args = ["plan", "backend=verl", f"experiment={preset}", "--device-gb", "80", "--json"]
    code = cli.main([*args, f"actor_rollout_ref.model.path={model_dir}"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["fits"] and plan["problems"] == []


def test_a_one_gpu_preset_on_a_smaller_gpu_is_refused_naming_the_stage(capsys):
    model_dir = BACKBONES["paper_qwen2p5_7b"]
    args = ["plan", "backend=verl", "experiment=paper_qwen2p5_7b_1gpu", "--device-gb", "24"]
    code = cli.main([*args, f"actor_rollout_ref.model.path={model_dir}"])
    out = capsys.readouterr().out
    assert code == 1 and re.search(r"verdict: does not fit: rollout needs [\d.]+ GiB", out)


def test_readme_table_is_what_plan_table_prints(capsys):
    assert cli.main(["plan", "--table"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == fit_table()
    assert printed in (ROOT / "README.md").read_text(), "README: paste `omgrpo plan --table`"
