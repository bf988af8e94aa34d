"""TRL's `GRPOTrainer` as the peer of `omgrpo bench step --vs-trl` (the `bench` extra): the same
base model, prompts, group size, sampling and optimisation settings as an omgrpo run, timed per
step."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch
from transformers import TrainerCallback

from omgrpo.backends.native.trainer import batch_for_step
from omgrpo.config import compose
from omgrpo.core.rewards import majority_vote_reward, make_group
from omgrpo.core.step import extract_answer
from omgrpo.models.loading import base_model_dir, load_model, load_tokenizer, resolve_device
from omgrpo.tasks import load_task, render_prompt


class StepClock(TrainerCallback):
    """Wall-clock time at the start of training and at the end of every optimizer step."""

    def __init__(self) -> None:
        self.ends = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:])]


def majority_vote(group_size: int) -> Callable[..., list[float]]:
    """A TRL reward function: omgrpo's majority-vote reward (its answer extraction and
    clustering) over each run of `group_size` completions, which TRL's sampler keeps together."""

    def reward(completions: list[str], **_: Any) -> list[float]:
        rewards: list[float] = []
        for start in range(0, len(completions), group_size):
            answers = [extract_answer(c) for c in completions[start : start + group_size]]
            rewards += majority_vote_reward(make_group(answers))
        return rewards

    return reward


def trl_config(cfg: Any, steps: int, out_dir: str, device: torch.device) -> Any:
    """`GRPOConfig` matching an omgrpo config: one optimizer step per generation batch of
    `prompts_per_step` x G completions, G, max new tokens, temperature, top-p, beta (k3 KL to a
    reference model), clip, lr (constant), grad clip; fp32; no logging, saving or shuffling."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=cfg.trainer.prompts_per_step * cfg.rollout.n,
        gradient_accumulation_steps=1,
        num_generations=cfg.rollout.n,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        beta=cfg.algorithm.kl_coef,
        epsilon=cfg.algorithm.clip,
        learning_rate=cfg.optim.lr,
        lr_scheduler_type="constant",
        max_grad_norm=cfg.optim.grad_clip,
        use_cpu=device.type == "cpu",
        bf16=False,
        fp16=False,
        shuffle_dataset=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=cfg.seed,
    )


def trl_step_seconds(steps: int, overrides: list[str]) -> dict:
    """Train TRL's GRPOTrainer for `steps` steps on what `compose(overrides)` would train (the
    toy base's directory, the chat-rendered problems of omgrpo's first `steps` steps) and return
    the mean wall seconds per step after the first."""
    from datasets import Dataset
    from trl import GRPOTrainer

    cfg = compose(overrides)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    splits = load_task(cfg.task)
    base = base_model_dir(cfg.model, cfg.task, splits)
    device = resolve_device(cfg.model.device)
    tokenizer = load_tokenizer(base)
    P = cfg.trainer.prompts_per_step
    # the problems omgrpo's trainer takes in these steps, in its order (TRL does not shuffle)
    train = [
        p for step in range(1, steps + 1) for p in batch_for_step(splits.train, step, P, cfg.seed)
    ]
    prompts = [render_prompt(tokenizer, p.question) for p in train]
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(
            model=load_model(base, device, torch.float32),
            reward_funcs=majority_vote(cfg.rollout.n),
            args=trl_config(cfg, steps, out, device),
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
            callbacks=[clock],
        )
        trainer.train()
    seconds = clock.step_seconds()
    if not seconds:
        raise RuntimeError(f"TRL's GRPOTrainer ran no step on {len(prompts)} prompts")
    kept = seconds[1:] if len(seconds) > 1 else seconds
    return {
        "time/step": sum(kept) / len(kept),
        "steps": len(seconds),
        "threads": torch.get_num_threads(),
        "trl": version("trl"),
    }
