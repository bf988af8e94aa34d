"""Test-only harness: real verl 0.9.1 training steps of omgrpo's plugin on the CPU.

`omgrpo train backend=verl` runs unchanged; what makes it run without a GPU is injected from
outside: the modules `omgrpo_cpu_platform` (a "cpu" verl platform) and `omgrpo_cpu_rollout`
(an "hf" rollout backend) loaded by verl in every process through `VERL_USE_EXTERNAL_MODULES`,
Ray started with logical GPUs, and the config overrides below. A third module,
`omgrpo_cpu_reward`, adds a reward part that the tests put in their runs so that every group's
rewards differ (advantages of both signs by construction, not by sampling luck). omgrpo's plugin itself is loaded
through its real `verl.plugins` entry point. docs/verl.md ("The CPU harness") says what each
piece works around, with the verl 0.9.1 lines.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from omgrpo.backends.verl import smoke
from omgrpo.backends.verl.data import write_toy_parquet
from omgrpo.config import ModelConfig, TaskConfig
from omgrpo.models.toy import ensure_toy_base
from omgrpo.tasks.toy import ToyWorldSpec, generate_toy_splits

HARNESS_DIR = Path(__file__).resolve().parent
REPO = HARNESS_DIR.parents[3]
MODULES = "omgrpo_cpu_platform,omgrpo_cpu_rollout,omgrpo.backends.verl.plugin,omgrpo_cpu_reward"
SERVER_LOG = "OMGRPO_HF_SERVER_LOG"  # the hf server appends one JSON line per request here

# A toy base that closes \boxed{} within ~30 tokens (hidden 64, 2 layers, toy BPE, ChatML) and
# disagrees with itself: 300 SFT steps in an easy world (1-2 operations on small numbers) give
# ~1/3 right answers on the test's problems (GT rewards not all 0), ~100 s on 2 idle cores.
BASE_SETTINGS = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
BASE_SFT_STEPS = 300
BASE_SFT_BATCH = 32
WORLD = dict(min_steps=1, max_steps=2, max_start=9, max_operand=9, max_factor=3, max_value=30)
N_TRAIN, N_VAL = 8, 4


def build_toy_base(cache_dir: Path) -> Path:
    """The toy base (trained once per cache dir), SFT on problems disjoint from `write_data`'s."""
    model = OmegaConf.structured(ModelConfig(**BASE_SETTINGS, cache_dir=str(cache_dir)))
    model.warm_start.steps = BASE_SFT_STEPS
    model.warm_start.batch_size = BASE_SFT_BATCH
    model.warm_start.check_problems = 0
    task = TaskConfig(**WORLD)
    splits = generate_toy_splits(N_TRAIN, N_VAL, 0, seed=task.seed, spec=ToyWorldSpec(**WORLD))
    exclude = {p.question for p in splits.train + splits.val}
    return ensure_toy_base(model, OmegaConf.structured(task), exclude)


def write_data(out: Path) -> tuple[Path, Path]:
    """The train / val parquet files (verl's format) of the toy world's problems."""
    return write_toy_parquet(out, N_TRAIN, N_VAL, spec=ToyWorldSpec(**WORLD))


def overrides(base: Path, train: Path, val: Path, steps: int, n: int) -> list[str]:
    """verl settings for 1 process on 2 CPU cores (the preset is the paper's 8-GPU one)."""
    modules = f"'{MODULES}'"  # quoted: a comma-separated string for Hydra
    return [
        "experiment=paper_qwen3_1p7b",
        f"actor_rollout_ref.model.path={base}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=2",
        "data.max_prompt_length=64",
        "data.max_response_length=64",
        "data.dataloader_num_workers=0",
        f"omgrpo.rollout.n={n}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        # the paper's 3e-6 barely moves a 120k-parameter model: step 2's KL would be ~0
        "actor_rollout_ref.actor.optim.lr=1e-3",
        # FSDP1 fails on CPU (sync_module_states); FSDP2 + gloo works.
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        # flash_attention_2 is verl's default
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        # logical resources: each bundle asks for max_colocate_count CPUs + 1 GPU
        "ray_kwargs.ray_init.num_cpus=8",
        "+ray_kwargs.ray_init.num_gpus=1",
        # Ray's dashboard (a server and a dozen module processes) is never read here
        "+ray_kwargs.ray_init.include_dashboard=false",
        # the preset sets this list in Ray's runtime env, replacing the shell's
        f"ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES={modules}",
    ]


def environment(out: Path) -> dict[str, str]:
    """The driver's environment; Ray's processes inherit it (the preset's runtime env adds
    `VERL_USE_EXTERNAL_MODULES`, see `overrides`)."""
    env = dict(os.environ)
    path = [str(HARNESS_DIR), str(REPO), env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        VERL_USE_EXTERNAL_MODULES=MODULES,
        VERL_PLATFORM="cpu",
        TORCH_COMPILE_DISABLE="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
        # Ray starts a Python worker per logical CPU (8 here) in advance; verl's actors get
        # their own processes anyway, so the idle ones only cost their start-up
        RAY_enable_worker_prestart="0",
        RAY_prestart_worker_first_driver="0",
        # Ray runs its workers at nice 15 (`ray job submit` sets 0): under a busy machine the
        # run then waits behind everything else (a 900 s timeout beside a niced 2-process
        # job, where it takes ~4 min alone)
        RAY_worker_niceness="0",
        **{SERVER_LOG: str(out / "server.jsonl")},
    )
    return env


def run_train(out: Path, args: list[str], timeout: float | None = None) -> int:
    """`omgrpo train backend=verl <args>` on the CPU (smoke.run_train: out/train.log and
    out/metrics.jsonl); the hf server logs its requests to out/server.jsonl."""
    return smoke.run_train(out, args, env=environment(out), timeout=timeout)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
