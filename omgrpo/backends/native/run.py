"""What a native run sets up before its first step, once.

`setup` checks the config, then loads the data, the models and the optimizer into a `Run`;
`resume_or_start` restores the newest checkpoint (or starts afresh) and `start_tracker` starts
the configured trackers. The loop that uses them is `omgrpo.backends.native.trainer`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from omgrpo.backends.native.checkpoint import (
    load_latest_intact_checkpoint,
    restore_weights,
    set_rng_state,
)
from omgrpo.backends.native.mechanism import MechanismProbe
from omgrpo.config import check_values, to_container, validate_algorithm, validate_lora
from omgrpo.core.answers import Grader
from omgrpo.core.process import aggregate
from omgrpo.core.rewards import get_reward
from omgrpo.core.step import LoopState
from omgrpo.generation.rollout import sample, stop_token_ids
from omgrpo.models.loading import (
    base_model_dir,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from omgrpo.models.lora import adapters_off, apply_lora, lora_enabled, trainable_parameters
from omgrpo.models.memory import check_memory_plan
from omgrpo.models.toy_prm import configured_prm
from omgrpo.tasks import TASKS, Problem, PromptEncoder, check_prompt_lengths, load_task
from omgrpo.tracking import build_trackers
from omgrpo.tracking.provenance import collect_provenance
from omgrpo.tracking.store import RunStore


@dataclass
class Run:
    """What a run sets up once and every step uses (models, optimizer, data, run store)."""

    cfg: DictConfig
    config: dict  # the resolved config (logged, compared on resume)
    store: RunStore
    base: str  # base model directory
    device: torch.device
    tokenizer: Any
    # the Hugging Face model that generates, scores and trains; with LoRA its targeted linear
    # layers are peft's LoRA layers (the engine calls its modules directly)
    policy: torch.nn.Module
    # a frozen copy of the base for the KL term (None when kl_coef = 0, or with LoRA, whose
    # reference is the policy with its adapters switched off: `reference`)
    ref: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    encode: PromptEncoder
    stop_ids: list[int]
    train_problems: list[Problem]
    val_problems: list[Problem]
    steps_per_epoch: int
    total_steps: int
    mechanism: MechanismProbe | None = None  # `diagnostics.mechanism_every`
    prm: Any = None  # the frozen process reward model of the `process` reward (None: unused)
    adapters: Any = None  # with `model.lora.rank` > 0: the peft wrapper of `policy`

    @property
    def has_reference(self) -> bool:
        """Whether the loss has a KL term to a reference model (`algorithm.kl_coef` > 0)."""
        return self.ref is not None or (
            self.adapters is not None and self.cfg.algorithm.kl_coef > 0
        )

    @contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference model of the KL term, for the duration: the frozen copy of the base,
        or with LoRA the policy itself with its adapters switched off (the same weights: the
        frozen base; no second copy)."""
        if self.adapters is None:
            yield self.ref
            return
        with adapters_off(self.adapters) as base:
            yield base

    def sample(self, problems: list[Problem], n: int, temperature: float, top_p: float, **kw):
        """n responses per problem from the policy (prompts through the chat template), in
        chunks that fit the device (`rollout.max_batch_tokens`)."""
        return sample(
            self.policy,
            [self.encode(p) for p in problems],
            n=n,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            eos_id=self.stop_ids,
            pad_id=self.tokenizer.pad_token_id,
            max_batch_tokens=self.cfg.rollout.max_batch_tokens,
            **kw,
        )

    def status(self, state: str, step: int, **extra: Any) -> None:
        self.store.write_status(
            state=state, step=step, total_steps=self.total_steps, base_model=self.base, **extra
        )


def setup(cfg: DictConfig) -> Run:
    """Check the config, then load the data, the models and the optimizer."""
    config = to_container(cfg)
    check_config(cfg)
    store = RunStore(Path(cfg.run.root) / cfg.run.name)
    store.start_mode(cfg.run.resume)  # refuses an existing run with run.resume=false
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    Grader.from_config(cfg.reward).warm_up()  # imports sympy / math-verify while models load
    splits = load_task(cfg.task)
    base = base_model_dir(cfg.model, cfg.task, splits)
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    if cfg.model.path:  # before any weights load (the toy model is a few MB: not planned)
        check_memory_plan(cfg, base, device)
    tokenizer = load_tokenizer(base)
    policy = load_model(base, device, dtype)
    adapters = None
    if lora_enabled(cfg.model):  # `policy` is changed in place and stays the HF model
        adapters = apply_lora(policy, cfg.model.lora, seed=cfg.seed)
    if cfg.model.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    ref = None
    if cfg.algorithm.kl_coef > 0 and adapters is None:
        ref = load_model(base, device, dtype).eval().requires_grad_(False)
    stop_ids = stop_token_ids(tokenizer, policy)
    prm = None
    if "process" in cfg.reward.parts:  # frozen, outside the optimizer (it never trains)
        prm = configured_prm(cfg, splits, device)
    _seed_everything(cfg.seed)  # after loading: a first-time warm start consumes RNG
    if "coreward" in cfg.reward.parts and any(p.paraphrase is None for p in splits.train):
        raise ValueError("reward 'coreward' needs a paraphrase for every training problem")
    encode = PromptEncoder(tokenizer, cfg.rollout.max_prompt_len)
    check_prompt_lengths(splits, encode, paraphrases="coreward" in cfg.reward.parts)
    steps_per_epoch = math.ceil(len(splits.train) / cfg.trainer.prompts_per_step)
    total_steps = cfg.trainer.steps or cfg.trainer.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(
        trainable_parameters(policy),  # all of them, or the LoRA adapters
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    return Run(
        cfg=cfg,
        config=config,
        store=store,
        base=base,
        device=device,
        tokenizer=tokenizer,
        policy=policy,
        ref=ref,
        optimizer=optimizer,
        scheduler=warmup_cosine(
            optimizer, total_steps, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio
        ),
        encode=encode,
        stop_ids=stop_ids,
        train_problems=splits.train,
        val_problems=splits.val[: cfg.eval.num_prompts],
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        mechanism=MechanismProbe.build(cfg, policy, ref, tokenizer, encode, splits.val, stop_ids),
        prm=prm,
        adapters=adapters,
    )


def check_config(cfg) -> None:
    """Fail on names and values that would otherwise fail minutes later, listing valid ones."""
    for name in cfg.reward.parts:
        get_reward(name)
    if "process" in cfg.reward.parts:
        aggregate([], cfg.reward.prm.aggregate)  # names the valid aggregations
    if cfg.task.name not in TASKS:
        raise ValueError(f"unknown task '{cfg.task.name}'; valid tasks: {', '.join(sorted(TASKS))}")
    validate_algorithm(cfg.algorithm, "algorithm")
    validate_lora(cfg.model.lora, "model.lora")
    if cfg.rollout.n < 2:
        raise ValueError("rollout.n must be >= 2: group advantages need at least two rollouts")
    tokens = cfg.rollout.max_batch_tokens
    if tokens is not None and tokens < 1:
        raise ValueError(
            f"rollout.max_batch_tokens must be >= 1 or null (free memory), got {tokens}"
        )
    check_values(cfg)  # every other numeric key's range (InputError naming the key)
    buffer = cfg.algorithm.get("overlong_buffer")
    if buffer is not None and buffer > cfg.rollout.max_new_tokens:
        raise ValueError(
            f"algorithm.overlong_buffer ({buffer}) must be at most rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}): the penalty ramps over the last buffer tokens"
        )


def warmup_cosine(optimizer, total_steps: int, warmup_ratio: float, min_ratio: float):
    """Linear warm-up over `warmup_ratio` of the steps, then cosine decay to `min_ratio`."""
    warmup = round(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resume_or_start(run: Run) -> LoopState:
    """The newest checkpoint's state (models, optimizer, RNGs restored) with `run.resume`,
    else a fresh state; marks the run as running."""
    state = LoopState()
    checkpoint = (
        load_latest_intact_checkpoint(run.store, run.config) if run.cfg.run.resume else None
    )
    if checkpoint is not None:
        saved = checkpoint[1]
        restore_weights(saved, run.policy, run.adapters)
        run.optimizer.load_state_dict(saved["optimizer"])
        run.scheduler.load_state_dict(saved["scheduler"])
        set_rng_state(saved["rng"])
        state = LoopState(**saved["loop"], step=saved["step"])
        run.store.truncate_metrics(state.step)
        print(f"resuming {run.store.dir} from step {state.step}")
    else:
        run.store.truncate_metrics(-1)
        run.store.new_identity()  # a fresh run is a new identity, whatever ran here before
        run.store.write_config(run.config)
    run.store.write_provenance(collect_provenance())
    run.status("running", state.step)
    return state


def start_tracker(run: Run, resume_step: int | None):
    """The configured trackers (MLflow, W&B), started on this run."""
    cfg = run.cfg
    tracker = build_trackers(cfg.tracking, Path(cfg.run.root))
    tracker.start(
        run.store.dir,
        run.config,
        name=cfg.run.name,
        group=cfg.run.experiment,
        tags=list(cfg.run.tags),
        resume_step=resume_step,
    )
    return tracker
