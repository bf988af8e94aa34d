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
`train` wraps it with validation, collapse detection, logging and checkpoints. Beside it:
`run` sets a run up (config checks, data, models, optimizer, resume, trackers), `update` is
step 6, `probes` measure the weights before the update, `validation` scores the val split.

Labels never enter a label-free reward: they are only read by the `gt` reward and diagnostics.
"""

from __future__ import annotations

import dataclasses
import random
import resource
import sys
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig

from omgrpo.backends.native.checkpoint import config_diff, save_checkpoint
from omgrpo.backends.native.probes import step_probes
from omgrpo.backends.native.run import Run, resume_or_start, setup, start_tracker
from omgrpo.backends.native.update import (
    dapo_batch,
    ppo_update,
    shuffled_advantages,
    single_update,
)
from omgrpo.backends.native.validation import validate
from omgrpo.config import to_container
from omgrpo.console import TRAIN_FIELDS, Progress
from omgrpo.core.answers import Grader
from omgrpo.core.car import CarResult
from omgrpo.core.diagnostics import CollapseDetector
from omgrpo.core.losses import token_logprobs_and_entropy
from omgrpo.core.step import (
    LoopState,
    StepBatch,
    decode_responses,
    masked_step,
    rollout_table,
    score_step,
    step_metrics,
)
from omgrpo.generation.car import generate_pair_answers
from omgrpo.generation.engine import stream_seed
from omgrpo.generation.rollout import Sequences, response_logits, response_logprobs
from omgrpo.tasks import Problem, task_probe
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
    old, entropy = old_pass(run, seqs, timer, need_stats)
    ref_logprobs = None
    if run.has_reference:  # a frozen copy, or with LoRA the policy with its adapters off
        with timer("ref_logprob"), run.reference() as reference:
            ref = response_logprobs(reference, seqs, cfg.algorithm.micro_batch_size)
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
    # DAPO options: overlong penalty, dropped groups / truncated rollouts (omgrpo.core.dapo)
    batch, dapo_metrics = dapo_batch(
        batch, seqs, cfg.algorithm, cfg.rollout.max_new_tokens, run.stop_ids
    )
    if cfg.trainer.shuffle_advantages:
        batch = shuffled_advantages(
            batch, torch.Generator().manual_seed(cfg.seed * 7919 + state.step)
        )
    # the generic masks (study v4): tokens out of both terms, for the update and the probes
    batch, mask_metrics = masked_step(
        batch, cfg.algorithm, seed=cfg.seed, step=state.step, entropy=entropy
    )
    probe = step_probes(run, state.step, timer, seqs, batch, ref_logprobs)
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
        **mask_metrics,
        **dapo_metrics,
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


def old_pass(
    run: Run, seqs: Sequences, timer: StageTimer, need_stats: bool
) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """The old policy's pass over the step's rollouts, when one is needed: `(old, entropy)`.

    `old["logprobs"]`: the old log-probs the update's ratio uses, None with a single update per
    step (the old policy is then the updated one: the update reuses its own forward); with
    `need_stats` (a reward reads them) also the per-token `entropy` and `self_certainty`.
    `entropy`: with `algorithm.top_entropy_quantile`, the per-token entropy under the sampling
    policy (these weights, before the update, at `rollout.temperature`, as verl's old-log-prob
    pass and TRL compute it; `sampling_entropy`), else None. Its pass leaves the update's
    ratio as it was (1 with a single update)."""
    algo, temperature = run.cfg.algorithm, float(run.cfg.rollout.temperature)
    ratio_pass = need_stats or not single_update(algo, len(seqs))
    top_entropy = algo.get("top_entropy_quantile") is not None
    # at temperature 1 the old pass's own entropy is the sampling policy's: one pass for both
    shared = top_entropy and temperature == 1.0
    old: dict[str, torch.Tensor | None] = {"logprobs": None}
    if not (ratio_pass or top_entropy):
        return old, None
    entropy = None
    with timer("old_logprob"):
        if ratio_pass or shared:
            old = response_logprobs(
                run.policy, seqs, algo.micro_batch_size, with_stats=need_stats or shared
            )
        if top_entropy:
            entropy = old["entropy"] if shared else sampling_entropy(run, seqs, temperature)
    if shared and not ratio_pass:
        old = {"logprobs": None}  # computed for the entropy only
    return old, entropy


def sampling_entropy(run: Run, seqs: Sequences, temperature: float) -> torch.Tensor:
    """(B, T) entropy of each response token's distribution at `temperature` (the rollouts'
    sampling distribution before top-p), under the current weights, without grad; 0 at
    temperature 0 (greedy). On the CPU, micro-batched as the old pass."""
    step = run.cfg.algorithm.micro_batch_size or len(seqs)
    out = []
    with torch.no_grad():
        for i in range(0, len(seqs), step):
            part = seqs.select(slice(i, i + step))
            logits = response_logits(run.policy, part).float()
            if temperature <= 0:
                out.append(torch.zeros(logits.shape[:-1]))
                continue
            tokens = part.response_ids.to(logits.device)
            out.append(token_logprobs_and_entropy(logits / temperature, tokens)[1].cpu())
    return torch.cat(out)


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
        adapters=run.adapters,  # with LoRA the checkpoint holds the adapters, not the base
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


def _collapse_message(step: int, metrics: dict) -> str:
    return (
        f"collapse detected at step {step}: "
        f"{metrics['answers/unique_per_prompt']:.2f} answers per prompt, "
        f"'{metrics['answers/batch_mode']}' in "
        f"{metrics['answers/batch_mode_share']:.0%} of the batch"
    )


def _validating(run: Run) -> bool:
    return run.cfg.eval.every > 0 and bool(run.val_problems)


def _due(step: int, every: int, total_steps: int) -> bool:
    """At every `every`-th step (none for 0) and at the last one."""
    return step == total_steps or (every > 0 and step % every == 0)


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


def _paraphrased(p: Problem) -> Problem:
    return Problem(id=p.id + "#para", question=p.paraphrase, answer=p.answer)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return max_rss_gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def max_rss_gib(ru_maxrss: int, platform: str = sys.platform) -> float:
    """`getrusage`'s peak resident set size in GiB: the kernel reports it in KiB on Linux but
    in bytes on macOS."""
    return ru_maxrss / (2**30 if platform == "darwin" else 2**20)
