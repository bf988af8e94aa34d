"""The native OM-GRPO trainer (one process, CPU or one GPU).

One step (`train_step`), top to bottom:
  1. take `prompts_per_step` problems (a fixed shuffle per epoch, derived from the seed)
  2. sample G rollouts per prompt with the current policy              time/gen
  3. CAR: the policy answers pairs of its own solutions (pool only)    time/car
  4. old and reference log-probs (+ token entropy, self-certainty)    time/old_logprob, ref
     (no old pass with one update per step: the update's own forward gives them)
  5. `omgrpo.core.step.score_step`: answers, answer-token masks, rewards   time/reward
     over each group (soft vote + format for OM-GRPO), GRPO advantages
  6. PPO epochs over mini-batches of the clipped surrogate + k3 KL,   time/update
     answer-span tokens weighted by w
  7. `omgrpo.core.step.step_metrics` and the update's metrics
`train` wraps it with validation, collapse detection, logging and checkpoints.

Labels never enter a label-free reward: they are only read by the `gt` reward and diagnostics.
"""

from __future__ import annotations

import dataclasses
import math
import random
import resource
import sys
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from omgrpo.backends.native.checkpoint import (
    config_diff,
    load_latest_intact_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from omgrpo.backends.native.mechanism import MechanismProbe
from omgrpo.config import to_container, validate_algorithm
from omgrpo.console import TRAIN_FIELDS, Progress
from omgrpo.core.answers import Grader
from omgrpo.core.car import CarResult
from omgrpo.core.diagnostics import (
    CollapseDetector,
    guess_diagnostics,
    process_diagnostics,
    recovery_metrics,
)
from omgrpo.core.losses import (
    COUNT_SUFFIX,
    SUM_SUFFIX,
    token_logprobs_and_entropy,
    token_means,
)
from omgrpo.core.process import aggregate
from omgrpo.core.rewards import get_reward, make_group
from omgrpo.core.step import (
    LoopState,
    StepBatch,
    decode_responses,
    is_correct,
    rollout_table,
    score_step,
    step_loss,
    step_metrics,
)
from omgrpo.generation.car import generate_pair_answers
from omgrpo.generation.engine import stream_seed
from omgrpo.generation.rollout import (
    Sequences,
    response_logits,
    response_logprobs,
    sample,
    stop_token_ids,
)
from omgrpo.models.loading import (
    base_model_dir,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from omgrpo.models.memory import check_memory_plan
from omgrpo.models.toy_prm import configured_prm
from omgrpo.tasks import (
    TASKS,
    Problem,
    PromptEncoder,
    check_prompt_lengths,
    load_task,
    task_probe,
)
from omgrpo.tracking import build_trackers
from omgrpo.tracking.provenance import collect_provenance
from omgrpo.tracking.store import RunStore

STATS_REWARDS = {"self_certainty", "entropy"}  # need per-token stats from the policy


class StageTimer:
    """Accumulates wall-clock seconds per stage (`time/<stage>`), as verl's `marked_timer`."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, defaultdict(float)

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds[stage] += time.perf_counter() - start


@dataclass
class Run:
    """What a run sets up once and every step uses (models, optimizer, data, run store)."""

    cfg: DictConfig
    config: dict  # the resolved config (logged, compared on resume)
    store: RunStore
    base: str  # base model directory
    device: torch.device
    tokenizer: Any
    policy: torch.nn.Module
    ref: torch.nn.Module | None  # reference model for the KL term (None when kl_coef = 0)
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


def train(cfg: DictConfig, stop_after: int | None = None) -> Path:
    """Train as configured; returns the run directory. `stop_after` ends the loop after that
    step as if the process were killed (used to test resume). An exception marks the run
    `failed` in status.json, with the error."""
    store = RunStore(Path(cfg.run.root) / cfg.run.name)
    if (skip := skip_message(cfg)) is not None:  # before anything is written or loaded
        print(skip)
        return store.dir
    with store.recording_failures():
        return _train(cfg, stop_after)


def skip_message(cfg: DictConfig) -> str | None:
    """Why `run.resume=auto` leaves the run of `cfg` alone (it ended on its own), or None when
    the run is to train. Raises if the run directory holds a finished run of another config (a
    changed setting must not pass for that run), or a run and `run.resume=false`."""
    store = RunStore(Path(cfg.run.root) / cfg.run.name)
    if store.start_mode(cfg.run.resume) != "skip":
        return None
    diff = config_diff(store.read_config(), to_container(cfg))
    if diff:
        raise ValueError(
            f"{store.dir} holds a finished run of another config:\n  "
            + "\n  ".join(diff)
            + "\nStart a new run (another run.name) or restore these settings."
        )
    status = store.read_status()
    return (
        f"skipping {store.dir}: it already {status['state']} at step {status.get('step')} "
        "(run.resume=auto); choose another run.name to train it again"
    )


def _train(cfg: DictConfig, stop_after: int | None) -> Path:
    run = setup(cfg)
    state = resume_or_start(run)
    c = cfg.collapse
    detector = CollapseDetector(c.max_unique_per_prompt, c.min_mode_share, c.patience)
    detector.state = state.collapse  # the same dict: checkpoints see its updates
    tracker = start_tracker(run, resume_step=state.step if state.step > 0 else None)
    with tracker:  # the tracker ends its runs as finished / failed / killed
        console = Progress(
            cfg.run.name,
            run.total_steps,
            TRAIN_FIELDS,
            start=state.step,
            every=cfg.trainer.log_every,
            bar=cfg.trainer.progress,
        )
        if state.step == 0 and _validating(run):
            metrics0 = validate(run, 0, state.recovery)
            log_step(run, tracker, 0, metrics0)
            console.update(0, metrics0)
        last_metrics_at = time.perf_counter()
        for step in range(state.step + 1, run.total_steps + 1):
            state.step = step
            problems = batch_for_step(
                run.train_problems, step, cfg.trainer.prompts_per_step, cfg.seed
            )
            batch, metrics = train_step(run, state, problems)
            if _validating(run) and _due(step, cfg.eval.every, run.total_steps):
                metrics.update(validate(run, step, state.recovery))
            collapsed_now = detector.update(step, metrics)
            if collapsed_now:
                metrics["collapse/detected_step"] = step
                console.write(_collapse_message(step, metrics))
            # wall clock from metrics to metrics: the step plus everything around it (the
            # previous step's logging and checkpoint, validation), as a peer trainer is timed
            now = time.perf_counter()
            metrics["perf/step_wall_s"], last_metrics_at = now - last_metrics_at, now
            log_step(run, tracker, step, metrics, batch)
            if _due(step, cfg.trainer.save_every, run.total_steps):
                save(run, state)
            run.status("running", step)
            console.update(step, metrics)
            if collapsed_now and cfg.collapse.stop:
                console.close()
                run.status("collapsed", step, collapse_step=step)
                return run.store.dir
            if stop_after is not None and step >= stop_after:
                return run.store.dir  # simulated kill (tests): no "finished" status
        console.close()
        run.status("finished", run.total_steps)
    return run.store.dir


def train_step(run: Run, state: LoopState, problems: list[Problem]) -> tuple[StepBatch, dict]:
    """RL step `state.step` on `problems` (module docstring): updates the policy and `state`,
    returns the scored batch and the step's metrics. Raises FloatingPointError after
    `trainer.max_consecutive_skips` non-finite steps in a row."""
    cfg, policy = run.cfg, run.policy
    timer = StageTimer(run.device)
    grading = Grader.from_config(cfg.reward)  # this step's answer comparisons share its budget
    task_hook = task_probe(cfg.task)  # the task's token roles and guess reading
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if "coreward" in cfg.reward.parts:  # the paraphrases too; group g's partner is g +- P
        problems = problems + [_paraphrased(p) for p in problems]
    seqs, car = generate(run, problems, state.step, timer)
    need_stats = bool(STATS_REWARDS & set(cfg.reward.parts))
    # with a single update per step the old policy is the updated one: the update reuses its
    # own forward for the old log-probs (no extra pass)
    old = {"logprobs": None}
    if need_stats or not single_update(cfg.algorithm, len(seqs)):
        with timer("old_logprob"):
            old = response_logprobs(
                policy, seqs, cfg.algorithm.micro_batch_size, with_stats=need_stats
            )
    ref_logprobs = None
    if run.ref is not None:
        with timer("ref_logprob"):
            ref = response_logprobs(run.ref, seqs, cfg.algorithm.micro_batch_size)
            ref_logprobs = ref["logprobs"]
    with timer("reward"):  # answers, rewards and advantages
        batch = score_step(
            run.tokenizer,
            seqs.response_ids,
            seqs.response_mask,
            problems,
            cfg,
            car=car,
            stats=old if need_stats else None,
            grader=grading,
            probe=task_hook,
            process=run.prm,
        )
    if cfg.trainer.shuffle_advantages:
        batch = shuffled_advantages(
            batch, torch.Generator().manual_seed(cfg.seed * 7919 + state.step)
        )
    probe = {}
    probe_every = cfg.trainer.grad_probe_every
    if probe_every and (state.step == 1 or state.step % probe_every == 0):
        with timer("probe"):
            probe = gradient_probe(policy, seqs, batch)
    probe |= mechanism_probe(run, state.step, timer, seqs, batch, ref_logprobs)
    with timer("update"):
        policy.train()
        update = ppo_update(
            policy,
            run.optimizer,
            seqs,
            old["logprobs"],
            ref_logprobs,
            batch,
            cfg.algorithm,
            cfg.optim.grad_clip,
        )
        with warnings.catch_warnings():  # a skipped step has no optimizer.step()
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            run.scheduler.step()  # the schedule counts training steps, skipped ones included
    _count_skip(run, state, update.pop("skipped"))
    metrics = {
        "train/epoch": (state.step - 1) // run.steps_per_epoch,
        "train/skipped_steps": state.skipped,
        **step_metrics(batch, state, cfg.collapse.confident_share, task_hook),
        **update,
        **probe,
        "lr": run.scheduler.get_last_lr()[0],
        "answers/grading_timeouts": grading.timeouts,
    }
    timer.seconds["step"] = sum(timer.seconds.values())
    metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
    metrics["mem/peak_gb"] = _peak_memory_gb(run.device)
    metrics["perf/tokens_per_s"] = float(seqs.response_mask.sum()) / timer.seconds["gen"]
    return batch, metrics


def generate(
    run: Run, problems: list[Problem], step: int, timer: StageTimer
) -> tuple[Sequences, CarResult | None]:
    """G rollouts per prompt from the current policy and, with CAR, its pair answers (they
    only enlarge the soft-vote pool, they are never trained on)."""
    cfg, policy, tokenizer = run.cfg, run.policy, run.tokenizer
    G = cfg.rollout.n
    policy.eval()
    with timer("gen"):
        seed = stream_seed(cfg.seed, "rollout", step)  # rows' streams: resumable, chunk-free
        seqs = run.sample(problems, G, cfg.rollout.temperature, cfg.rollout.top_p, seed=seed)
    if not cfg.car.enable:
        return seqs, None
    with timer("car"):
        texts = decode_responses(tokenizer, seqs.response_ids, seqs.response_mask).texts
        car = generate_pair_answers(
            policy,
            tokenizer,
            [(p.question, texts[g * G : (g + 1) * G]) for g, p in enumerate(problems)],
            cfg.car,
            rng=random.Random(f"{cfg.seed}-car-{step}"),
            seed=stream_seed(cfg.seed, "car", step),
            max_batch_tokens=cfg.rollout.max_batch_tokens,
        )
    return seqs, car


def log_step(run: Run, tracker, step: int, metrics: dict, batch: StepBatch | None = None) -> None:
    """Metrics to the run store and the trackers; the rollouts too at step 1 and every
    `trainer.log_rollouts_every` steps."""
    run.store.log_metrics(step, metrics)
    tracker.log_metrics(step, metrics)
    if batch is not None and (step == 1 or step % max(run.cfg.trainer.log_rollouts_every, 1) == 0):
        table = rollout_table(step, batch)
        run.store.log_rollouts(step, table)
        tracker.log_rollouts(step, table)


def _collapse_message(step: int, metrics: dict) -> str:
    return (
        f"collapse detected at step {step}: "
        f"{metrics['answers/unique_per_prompt']:.2f} answers per prompt, "
        f"'{metrics['answers/batch_mode']}' in "
        f"{metrics['answers/batch_mode_share']:.0%} of the batch"
    )


# ----------------------------------------------------------------------------------------
# Setup, resume, checkpoints
# ----------------------------------------------------------------------------------------
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
    if cfg.model.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    ref = None
    if cfg.algorithm.kl_coef > 0:
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
        policy.parameters(),
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
    )


def resume_or_start(run: Run) -> LoopState:
    """The newest checkpoint's state (models, optimizer, RNGs restored) with `run.resume`,
    else a fresh state; marks the run as running."""
    state = LoopState()
    checkpoint = (
        load_latest_intact_checkpoint(run.store, run.config) if run.cfg.run.resume else None
    )
    if checkpoint is not None:
        saved = checkpoint[1]
        run.policy.load_state_dict(saved["model"])
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


def save(run: Run, state: LoopState) -> None:
    """Checkpoint the step just finished and prune old checkpoints."""
    loop = dataclasses.asdict(state)
    step = loop.pop("step")
    save_checkpoint(
        run.store.checkpoint_dir(step),
        step=step,
        model=run.policy,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        loop_state=loop,
        config=run.config,
    )
    run.store.prune_checkpoints(run.cfg.trainer.keep_checkpoints, run.cfg.trainer.keep_best)


def _count_skip(run: Run, state: LoopState, skipped: bool) -> None:
    """Count a skipped (non-finite) step; too many in a row end the run."""
    if not skipped:
        state.consecutive_skips = 0
        return
    state.skipped += 1
    state.consecutive_skips += 1
    if state.consecutive_skips >= run.cfg.trainer.max_consecutive_skips:
        # `step` stays the last step that completed (as everywhere in status.json); the step
        # that ended the run is `failed_step`
        run.status("failed", state.step - 1, failed_step=state.step, reason="non-finite loss")
        raise FloatingPointError(
            f"step {state.step}: the loss was NaN/inf for {state.consecutive_skips} steps in "
            "a row; lower optim.lr, check the model's dtype, or inspect the rollouts in "
            f"{run.store.rollouts_dir}"
        )


def _validating(run: Run) -> bool:
    return run.cfg.eval.every > 0 and bool(run.val_problems)


def _due(step: int, every: int, total_steps: int) -> bool:
    """At every `every`-th step (none for 0) and at the last one."""
    return step == total_steps or (every > 0 and step % every == 0)


# ----------------------------------------------------------------------------------------
# Pieces of the step
# ----------------------------------------------------------------------------------------
def check_config(cfg) -> None:
    """Fail on names and values that would otherwise fail minutes later, listing valid ones."""
    for name in cfg.reward.parts:
        get_reward(name)
    if "process" in cfg.reward.parts:
        aggregate([], cfg.reward.prm.aggregate)  # names the valid aggregations
    if cfg.task.name not in TASKS:
        raise ValueError(f"unknown task '{cfg.task.name}'; valid tasks: {', '.join(sorted(TASKS))}")
    validate_algorithm(cfg.algorithm, "algorithm")
    if cfg.rollout.n < 2:
        raise ValueError("rollout.n must be >= 2: group advantages need at least two rollouts")
    tokens = cfg.rollout.max_batch_tokens
    if tokens is not None and tokens < 1:
        raise ValueError(
            f"rollout.max_batch_tokens must be >= 1 or null (free memory), got {tokens}"
        )


def batch_for_step(train: list[Problem], step: int, per_step: int, seed: int) -> list[Problem]:
    """Problems of a step: consecutive slices of per-epoch shuffles (a pure function of the
    step, so resume needs no sampler state)."""
    out, start = [], (step - 1) * per_step
    for pos in range(start, start + per_step):
        epoch, idx = divmod(pos, len(train))
        order = list(range(len(train)))
        random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
        out.append(train[order[idx]])
    return out


def single_update(algo, batch: int) -> bool:
    """One optimizer step per training step (one PPO epoch, one mini-batch): the old policy's
    log-probs are then the update's own, detached."""
    return algo.ppo_epochs == 1 and (algo.mini_batch_size or batch) >= batch


def ppo_update(
    policy,
    optimizer,
    seqs: Sequences,
    old_logprobs,
    ref_logprobs,
    batch: StepBatch,
    algo,
    grad_clip: float,
) -> dict[str, Any]:
    """PPO epochs over mini-batches; micro-batches accumulate gradients with the mini-batch's
    token count as the denominator. A non-finite loss or gradient skips the whole step."""
    B = len(seqs)
    roles = batch.responses.role_masks()
    mini = algo.mini_batch_size or B
    micro = algo.micro_batch_size or mini
    device = next(policy.parameters()).device
    combined = UpdateMetrics()
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(B) if (algo.ppo_epochs > 1 or mini < B) else torch.arange(B)
        for m0 in range(0, B, mini):
            mb = order[m0 : m0 + mini]
            num_tokens = seqs.response_mask[mb].sum().clamp(min=1).to(device)
            optimizer.zero_grad(set_to_none=True)
            for u0 in range(0, len(mb), micro):
                idx = mb[u0 : u0 + micro]
                # token-mean micro-batch losses are already partial sums of the mini-batch's
                scale = 1.0 if algo.agg == "token-mean" else len(idx) / len(mb)
                metrics = _micro_batch_backward(
                    policy,
                    seqs.select(idx).to(device),
                    idx,
                    old_logprobs,
                    ref_logprobs,
                    batch,
                    roles,
                    algo,
                    num_tokens,
                    scale,
                )
                if metrics is None:  # a non-finite loss
                    optimizer.zero_grad(set_to_none=True)
                    return {"skipped": True}
                combined.add_micro_batch(metrics, scale)
            norm = torch.nn.utils.clip_grad_norm_(
                policy.parameters(), grad_clip if grad_clip > 0 else float("inf")
            )
            if not torch.isfinite(norm):
                optimizer.zero_grad(set_to_none=True)
                return {"skipped": True}
            combined.end_mini_batch(float(norm))
            optimizer.step()
    return {**combined.result(), "skipped": False}


def _micro_batch_backward(
    policy,
    part: Sequences,
    idx,
    old_logprobs,
    ref_logprobs,
    batch: StepBatch,
    roles: dict,
    algo,
    num_tokens,
    scale: float,
) -> dict[str, float] | None:
    """One micro-batch's loss (times `scale`) back-propagated; its metrics, or None when the
    loss is not finite (nothing is back-propagated then). A function so that its logits
    (m x T x V) are freed on return: held in `ppo_update`'s loop they stayed alive through the
    next micro-batch's forward and the optimizer step, m*T*V*b bytes more at the step's
    peak."""
    logits = response_logits(policy, part)
    logprobs, entropy = token_logprobs_and_entropy(logits.float(), part.response_ids)
    loss, metrics = step_loss(
        batch,
        idx,
        logprobs,
        part.response_mask,
        algo,
        num_tokens,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy.detach(),
        roles=roles,
    )
    loss = loss * scale
    if not torch.isfinite(loss):
        return None
    loss.backward()
    return metrics


class UpdateMetrics:
    """How an update's micro-batch metrics combine into the step's: the token statistics
    (`token_stats` sums and counts) add up over every micro-batch of every mini-batch and
    epoch and are divided once (`token_means`: token-weighted, as the verl backend, nan for a
    role without tokens); `loss/*` is each mini-batch's loss as back-propagated (the sum of
    its scaled micro-batch losses) and, like `grad/norm`, averaged over mini-batches."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = defaultdict(float)
        self.losses: dict[str, float] = defaultdict(float)  # of the current mini-batch
        self.means: dict[str, list[float]] = defaultdict(list)

    def add_micro_batch(self, metrics: dict[str, float], scale: float) -> None:
        for key, value in metrics.items():
            if key.endswith((SUM_SUFFIX, COUNT_SUFFIX)):
                self.stats[key] += value
            else:
                self.losses[key] += value * scale

    def end_mini_batch(self, grad_norm: float) -> None:
        for key, value in self.losses.items():
            self.means[key].append(value)
        self.losses.clear()
        self.means["grad/norm"].append(grad_norm)

    def result(self) -> dict[str, float]:
        return {**token_means(self.stats), **{k: float(np.mean(v)) for k, v in self.means.items()}}


def shuffled_advantages(batch: StepBatch, generator: torch.Generator) -> StepBatch:
    """`batch` with its advantages (and format advantages) permuted within each group: the
    shuffled-advantage null control (`trainer.shuffle_advantages`)."""
    order = torch.arange(len(batch.group_ids))
    for g in batch.group_ids.unique():
        rows = (batch.group_ids == g).nonzero().squeeze(1)
        order[rows] = rows[torch.randperm(len(rows), generator=generator)]
    fmt = batch.format_advantages
    return dataclasses.replace(
        batch,
        advantages=batch.advantages[order],
        format_advantages=None if fmt is None else fmt[order],
    )


def gradient_probe(policy, seqs: Sequences, batch: StepBatch, rows: int = 64) -> dict[str, float]:
    """Norms and cosine of the policy-gradient parts of the answer tokens and of the other
    response tokens, at the current weights, on the first `rows` rollouts (ratio 1, no
    masking, no KL: the gradients the OMU weight scales and leaves alone)."""
    policy.train()
    part = seqs.select(torch.arange(min(rows, len(seqs))))
    device = next(policy.parameters()).device
    part = part.to(device)
    logprobs, _ = token_logprobs_and_entropy(
        response_logits(policy, part).float(), part.response_ids
    )
    resp = part.response_mask.bool()
    answer = batch.responses.answer_mask[: len(part)].to(device) & resp
    weighted = -batch.advantages[: len(part)].to(device).unsqueeze(1) * logprobs
    num_tokens = resp.sum().clamp(min=1)
    params = [p for p in policy.parameters() if p.requires_grad]
    flat = []
    for mask in (answer, resp & ~answer):
        grads = torch.autograd.grad(
            (weighted * mask).sum() / num_tokens, params, retain_graph=True, allow_unused=True
        )
        flat.append(
            torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).flatten()
                    for g, p in zip(grads, params)
                ]
            )
        )
    answer_grad, reasoning_grad = flat
    return {
        "grad/answer_norm": float(answer_grad.norm()),
        "grad/reasoning_norm": float(reasoning_grad.norm()),
        "grad/answer_reasoning_cos": float(
            torch.nn.functional.cosine_similarity(answer_grad, reasoning_grad, dim=0)
        ),
    }


def mechanism_probe(
    run: Run, step: int, timer: StageTimer, seqs: Sequences, batch: StepBatch, ref_logprobs
) -> dict[str, float]:
    """The `mech/*` metrics when `diagnostics.mechanism_every` makes `step` a probe step, else
    none; taken before the update (they split this step's update)."""
    if run.mechanism is None or not run.mechanism.due(step):
        return {}
    with timer("mechanism"):
        return run.mechanism.measure(run.policy, run.optimizer, seqs, batch, ref_logprobs, run.cfg)


@torch.no_grad()
def validate(run: Run, step: int, recovery: dict) -> dict:
    """avg@k, pass@k and unique answers per problem at the evaluation temperature. Runs on its
    own random stream so validating (or not) never changes the training trajectory."""
    cfg, problems = run.cfg, run.val_problems
    k = cfg.eval.k
    run.policy.eval()
    seqs = run.sample(
        problems,
        k,
        cfg.eval.temperature,
        cfg.eval.top_p,
        batch_size=cfg.eval.batch_size,
        seed=stream_seed(cfg.seed, "validation", step),
    )
    responses = decode_responses(run.tokenizer, seqs.response_ids, seqs.response_mask)
    answers = responses.answers
    grader = Grader.from_config(cfg.reward)  # its own budget: never what a step left over
    groups = [
        make_group(a, label=p.answer, grader=grader) for a, p in zip(_chunks(answers, k), problems)
    ]
    correct = [
        [bool(is_correct(a, p.answer, grader)) for a in g.answers] for g, p in zip(groups, problems)
    ]
    by_difficulty = {}
    difficulties = [p.meta.get("difficulty") for p in problems]
    if all(difficulties):  # toy problems: accuracy and guessing by difficulty
        for d in sorted(set(difficulties)):
            accs = [np.mean(c) for c, pd_ in zip(correct, difficulties) if pd_ == d]
            by_difficulty[f"val/acc_{d}"] = float(np.mean(accs))
        per_rollout = [d for d in difficulties for _ in range(k)]
        probe, texts = task_probe(cfg.task), responses.texts
        by_difficulty.update(guess_diagnostics(texts, answers, per_rollout, probe, "val"))
        questions = [p.question for p in problems for _ in range(k)]
        flat = [c for ok in correct for c in ok]
        by_difficulty.update(
            process_diagnostics(texts, answers, questions, flat, per_rollout, probe, "val")
        )
    return {
        **by_difficulty,
        "val/acc": float(np.mean([np.mean(c) for c in correct])),
        f"val/pass@{k}": float(np.mean([any(c) for c in correct])),
        "val/unique_answers": float(
            np.mean([len({c for c in g.classes if c is not None}) for g in groups])
        ),
        "val/extract_rate": float(np.mean([a is not None for a in answers])),
        **recovery_metrics(correct, recovery),
    }


def warmup_cosine(optimizer, total_steps: int, warmup_ratio: float, min_ratio: float):
    """Linear warm-up over `warmup_ratio` of the steps, then cosine decay to `min_ratio`."""
    warmup = round(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _paraphrased(p: Problem) -> Problem:
    return Problem(id=p.id + "#para", question=p.paraphrase, answer=p.answer)


def _chunks(xs: list, size: int) -> list[list]:
    return [xs[i : i + size] for i in range(0, len(xs), size)]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return max_rss_gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def max_rss_gib(ru_maxrss: int, platform: str = sys.platform) -> float:
    """`getrusage`'s peak resident set size in GiB: the kernel reports it in KiB on Linux but
    in bytes on macOS."""
    return ru_maxrss / (2**30 if platform == "darwin" else 2**20)
