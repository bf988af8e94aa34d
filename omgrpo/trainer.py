"""The native OM-GRPO trainer (one process, CPU or one GPU).

One step, top to bottom:
  1. take `prompts_per_step` problems (a fixed shuffle per epoch, derived from the seed)
  2. sample G rollouts per prompt with the current policy              time/gen
  3. extract each rollout's last \\boxed{} answer and its token span
  4. old and reference log-probs (+ token entropy, self-certainty)    time/old_logprob, ref
     (no old pass with one update per step: the update's own forward gives them)
  5. rewards over each group (soft vote + format for OM-GRPO)         time/reward
  6. GRPO advantages; answer-span tokens weighted by w               time/adv
  7. PPO epochs over mini-batches of the clipped surrogate + k3 KL    time/update
  8. diagnostics, validation, checkpoint, log to the run store

Labels never enter a label-free reward: they are only read by the `gt` reward and diagnostics.
"""

from __future__ import annotations

import math
import random
import resource
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from omgrpo.answers import (
    GradingBudget,
    equivalent,
    extract_boxed,
    grading_scope,
    set_math_verify,
    use_grading_budget,
)
from omgrpo.car import generate_pair_answers, top_vote_metrics
from omgrpo.checkpoint import load_latest_intact_checkpoint, save_checkpoint, set_rng_state
from omgrpo.config import to_container
from omgrpo.diagnostics import (
    CollapseDetector,
    answer_diagnostics,
    confidently_wrong,
    label_flip_rate,
    majority_answers,
    recovery_metrics,
)
from omgrpo.losses import AGG_MODES, group_advantages, grpo_loss, token_logprobs_and_entropy
from omgrpo.models.loading import (
    base_model_dir,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from omgrpo.rewards import compute_rewards, get_reward, make_group
from omgrpo.rollout import Sequences, response_logits, sample, score, stop_token_ids
from omgrpo.spans import answer_mask_for_ids
from omgrpo.store import RunStore
from omgrpo.tasks import TASKS, Problem, load_task, render_prompt
from omgrpo.tracking import build_trackers

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
    with RunStore(Path(cfg.run.root) / cfg.run.name).recording_failures():
        return _train(cfg, stop_after)


def _train(cfg: DictConfig, stop_after: int | None) -> Path:
    config = to_container(cfg)
    check_config(cfg)
    store = RunStore(Path(cfg.run.root) / cfg.run.name)
    if store.has_progress() and not cfg.run.resume:
        raise FileExistsError(
            f"{store.dir} already holds a run; pass run.resume=true to continue it, or choose "
            "another run.name / run.root"
        )
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    set_math_verify(cfg.reward.math_verify)

    # -- data and models ---------------------------------------------------------------
    splits = load_task(cfg.task)
    base = base_model_dir(cfg.model, cfg.task, splits)
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    tokenizer = load_tokenizer(base)
    policy = load_model(base, device, dtype)
    if cfg.model.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    ref = None
    if cfg.algorithm.kl_coef > 0:
        ref = load_model(base, device, dtype).eval().requires_grad_(False)
    stop_ids = stop_token_ids(tokenizer, policy)
    _seed_everything(cfg.seed)  # after loading: a first-time warm start consumes RNG
    encode = PromptEncoder(tokenizer, cfg.rollout.max_prompt_len)
    coreward = "coreward" in cfg.reward.parts
    if coreward and any(p.paraphrase is None for p in splits.train):
        raise ValueError("reward 'coreward' needs a paraphrase for every training problem")

    steps_per_epoch = math.ceil(len(splits.train) / cfg.trainer.prompts_per_step)
    total_steps = cfg.trainer.steps or cfg.trainer.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(
        policy.parameters(),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    scheduler = warmup_cosine(
        optimizer, total_steps, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio
    )

    # -- resume or start ---------------------------------------------------------------
    # Everything the loop carries from step to step (checkpointed, so resume is exact).
    loop = {
        "skipped": 0,
        "consecutive_skips": 0,
        "last_majority": {},
        "recovery": {},
        "collapse": None,
    }
    start = 0
    checkpoint = load_latest_intact_checkpoint(store, config) if cfg.run.resume else None
    if checkpoint is not None:
        state = checkpoint[1]
        policy.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        loop, start = state["loop"], state["step"]
        store.truncate_metrics(start)
        print(f"resuming {store.dir} from step {start}")
    else:
        store.truncate_metrics(-1)
        store.write_config(config)
    store.write_status(state="running", step=start, total_steps=total_steps, base_model=base)
    c = cfg.collapse
    detector = CollapseDetector(c.max_unique_per_prompt, c.min_mode_share, c.patience)
    if loop["collapse"] is not None:
        detector.state = loop["collapse"]
    loop["collapse"] = detector.state  # the same dict: checkpoints see its updates

    tracker = build_trackers(cfg.tracking, Path(cfg.run.root))
    tracker.start(
        store.dir,
        config,
        name=cfg.run.name,
        group=cfg.run.experiment,
        tags=list(cfg.run.tags),
        resume_step=start if checkpoint is not None else None,
    )
    # the tracker ends its runs as finished / failed / killed; per-step grading budgets end too
    with tracker, grading_scope():
        val_problems = splits.val[: cfg.eval.num_prompts]
        if start == 0 and cfg.eval.every > 0 and val_problems:
            metrics0 = validate(policy, tokenizer, encode, val_problems, cfg, 0, loop["recovery"])
            store.log_metrics(0, metrics0)
            tracker.log_metrics(0, metrics0)

        bar = tqdm(
            range(start + 1, total_steps + 1),
            initial=start,
            total=total_steps,
            desc=cfg.run.name,
            disable=not cfg.trainer.progress,
            dynamic_ncols=True,
        )
        last_val: dict[str, float] = {}
        for step in bar:
            timer = StageTimer(device)
            # all of this step's answer comparisons share one budget (omgrpo.answers)
            grading = use_grading_budget(
                GradingBudget(cfg.reward.grading_budget_s, cfg.reward.equivalence_timeout)
            )
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            problems = batch_for_step(splits.train, step, cfg.trainer.prompts_per_step, cfg.seed)
            if coreward:  # CoReward samples the paraphrases too; group g's partner is g ± P
                problems = problems + [_paraphrased(p) for p in problems]
            G = cfg.rollout.n

            # 2. sample G rollouts per prompt
            with timer("gen"):
                policy.eval()
                seqs = sample(
                    policy,
                    [encode(p) for p in problems],
                    n=G,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature,
                    top_p=cfg.rollout.top_p,
                    eos_id=stop_ids,
                    pad_id=tokenizer.pad_token_id,
                )

            # 3. answers and answer-token masks
            texts, answers, answer_mask = extract(tokenizer, seqs)
            labels = [p.answer for p in problems for _ in range(G)]
            correct = [
                None if lab is None else (a is not None and equivalent(a, lab))
                for a, lab in zip(answers, labels)
            ]

            # 3b. CAR: the current policy compares pairs of its own solutions; the short pair
            # answers only enlarge the soft-vote pool, they are never trained on
            car = None
            if cfg.car.enable:
                with timer("car"):
                    policy.eval()
                    car = generate_pair_answers(
                        policy,
                        tokenizer,
                        [(p.question, texts[g * G : (g + 1) * G]) for g, p in enumerate(problems)],
                        cfg.car,
                        rng=random.Random(f"{cfg.seed}-car-{step}"),
                    )

            # 4. old / reference log-probs (and token stats some rewards need); with a single
            # update per step the old policy is the updated one: the update reuses its forward
            need_stats = bool(STATS_REWARDS & set(cfg.reward.parts))
            old = {"logprobs": None}
            if need_stats or not single_update(cfg.algorithm, len(seqs)):
                with timer("old_logprob"):
                    old = score(policy, seqs, cfg.algorithm.micro_batch_size, with_stats=need_stats)
            ref_logprobs = None
            if ref is not None:
                with timer("ref_logprob"):
                    ref_logprobs = score(ref, seqs, cfg.algorithm.micro_batch_size)["logprobs"]

            # 5. rewards, one group per prompt
            with timer("reward"):
                groups = make_groups(
                    problems,
                    answers,
                    old if need_stats else None,
                    answer_mask,
                    seqs.response_mask,
                    G,
                    coreward,
                    len(tokenizer),
                    pools=car.answers if car else None,
                )
                rewards, parts = compute_rewards(groups, cfg.reward.parts, dict(cfg.reward.weights))

            # 6. advantages (format-only: answer tokens get the format reward's advantage)
            with timer("adv"):
                group_ids = torch.arange(len(problems)).repeat_interleave(G)
                advantages = group_advantages(
                    torch.tensor(rewards, dtype=torch.float32), group_ids, cfg.algorithm.adv_eps
                )
                format_adv = None
                if cfg.algorithm.format_only:
                    fmt = torch.tensor([float(a is not None) for a in answers])
                    format_adv = group_advantages(fmt, group_ids, cfg.algorithm.adv_eps)

            # 7. policy update
            with timer("update"):
                policy.train()
                update = ppo_update(
                    policy,
                    optimizer,
                    seqs,
                    old["logprobs"],
                    ref_logprobs,
                    advantages,
                    answer_mask,
                    format_adv,
                    cfg.algorithm,
                    cfg.optim.grad_clip,
                )
                with warnings.catch_warnings():  # a skipped step has no optimizer.step()
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
                    scheduler.step()  # the schedule counts training steps, skipped ones included
            if update.pop("skipped"):
                loop["skipped"] += 1
                loop["consecutive_skips"] += 1
                if loop["consecutive_skips"] >= cfg.trainer.max_consecutive_skips:
                    store.write_status(state="failed", step=step, reason="non-finite loss")
                    raise FloatingPointError(
                        f"step {step}: the loss was NaN/inf for {loop['consecutive_skips']} steps in "
                        "a row; lower optim.lr, check the model's dtype, or inspect the rollouts in "
                        f"{store.rollouts_dir}"
                    )
            else:
                loop["consecutive_skips"] = 0

            # 8. metrics, validation, rollouts, checkpoint
            metrics = {
                "train/epoch": (step - 1) // steps_per_epoch,
                "train/skipped_steps": loop["skipped"],
                "reward/total": float(rewards.mean()),
                **{f"reward/{k}": float(v.mean()) for k, v in parts.items()},
                **answer_diagnostics(groups, _chunks(correct, G)),
                "answers/confidently_wrong": confidently_wrong(
                    groups, _chunks(correct, G), cfg.collapse.confident_share
                ),
                "answers/label_flip_rate": label_flip_rate(
                    [p.id for p in problems], majority_answers(groups), loop["last_majority"]
                ),
                **(car_metrics(car, answers, correct, problems, G) if car else {}),
                **update,
                "lr": scheduler.get_last_lr()[0],
                "response/length_mean": float(seqs.response_mask.sum(-1).float().mean()),
                "answers/grading_timeouts": grading.timeouts,
            }
            timer.seconds["step"] = sum(timer.seconds.values())
            metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
            metrics["mem/peak_gb"] = _peak_memory_gb(device)
            metrics["perf/tokens_per_s"] = float(seqs.response_mask.sum()) / timer.seconds["gen"]
            if (
                cfg.eval.every > 0
                and val_problems
                and (step % cfg.eval.every == 0 or step == total_steps)
            ):
                last_val = validate(
                    policy, tokenizer, encode, val_problems, cfg, step, loop["recovery"]
                )
                metrics.update(last_val)
            collapsed_now = detector.update(step, metrics)
            if collapsed_now:
                metrics["collapse/detected_step"] = step
                tqdm.write(
                    f"collapse detected at step {step}: "
                    f"{metrics['answers/unique_per_prompt']:.2f} answers per prompt, "
                    f"'{metrics['answers/batch_mode']}' in "
                    f"{metrics['answers/batch_mode_share']:.0%} of the batch"
                )
            store.log_metrics(step, metrics)
            tracker.log_metrics(step, metrics)
            if step == 1 or step % max(cfg.trainer.log_rollouts_every, 1) == 0:
                table = rollout_table(
                    step, problems, G, texts, answers, correct, rewards, parts, advantages
                )
                store.log_rollouts(step, table)
                tracker.log_rollouts(step, table)
            if step == total_steps or (
                cfg.trainer.save_every and step % cfg.trainer.save_every == 0
            ):
                save_checkpoint(
                    store.checkpoint_dir(step),
                    step=step,
                    model=policy,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    loop_state=loop,
                    config=config,
                )
                store.prune_checkpoints(cfg.trainer.keep_checkpoints)
            store.write_status(state="running", step=step, total_steps=total_steps, base_model=base)
            bar.set_postfix(
                reward=f"{metrics['reward/total']:.2f}",
                val_acc=f"{last_val.get('val/acc', float('nan')):.3f}",
                uniq=f"{metrics['answers/unique_per_prompt']:.2f}",
            )
            if collapsed_now and cfg.collapse.stop:
                bar.close()
                store.write_status(
                    state="collapsed",
                    step=step,
                    total_steps=total_steps,
                    base_model=base,
                    collapse_step=step,
                )
                return store.dir
            if stop_after is not None and step >= stop_after:
                return store.dir  # simulated kill (tests): no "finished" status
        bar.close()
        store.write_status(
            state="finished", step=total_steps, total_steps=total_steps, base_model=base
        )
    return store.dir


# ----------------------------------------------------------------------------------------
# Pieces of the step
# ----------------------------------------------------------------------------------------
def check_config(cfg) -> None:
    """Fail on names and values that would otherwise fail minutes later, listing valid ones."""
    for name in cfg.reward.parts:
        get_reward(name)
    if cfg.task.name not in TASKS:
        raise ValueError(f"unknown task '{cfg.task.name}'; valid tasks: {', '.join(sorted(TASKS))}")
    if cfg.algorithm.agg not in AGG_MODES:
        raise ValueError(
            f"unknown algorithm.agg '{cfg.algorithm.agg}'; valid: {', '.join(AGG_MODES)}"
        )
    if cfg.algorithm.answer_weight < 0:
        raise ValueError("algorithm.answer_weight must be >= 0 (0 = OM-GRPO, 1 = vanilla GRPO)")
    if cfg.rollout.n < 2:
        raise ValueError("rollout.n must be >= 2: group advantages need at least two rollouts")


class PromptEncoder:
    """Question -> prompt token ids through the model's chat template (paper's template)."""

    def __init__(self, tokenizer, max_len: int):
        self.tokenizer, self.max_len, self.cache = tokenizer, max_len, {}

    def __call__(self, problem: Problem) -> list[int]:
        if problem.question not in self.cache:
            text = render_prompt(self.tokenizer, problem.question)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > self.max_len:
                raise ValueError(
                    f"problem {problem.id}: prompt has {len(ids)} tokens, more than "
                    f"rollout.max_prompt_len={self.max_len}"
                )
            self.cache[problem.question] = ids
        return self.cache[problem.question]


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


def extract(tokenizer, seqs: Sequences) -> tuple[list[str], list[str | None], torch.Tensor]:
    """Decode each response, extract its boxed answer and the (B, T) answer-token mask."""
    texts, answers = [], []
    mask = torch.zeros_like(seqs.response_mask, dtype=torch.bool)
    for i in range(len(seqs)):
        n = int(seqs.response_mask[i].sum())
        ids = seqs.response_ids[i, :n].tolist()
        row_mask, text = answer_mask_for_ids(tokenizer, ids)
        mask[i, :n] = row_mask
        boxed = extract_boxed(text)
        texts.append(text)
        answers.append(boxed.content if boxed else None)
    return texts, answers, mask


def car_metrics(car, answers, correct, problems, G) -> dict[str, float]:
    """CAR's mechanics and top-vote accuracy with / without the pair answers."""
    per_prompt = _chunks(answers, G)
    return {
        **car.diagnostics(per_prompt, _chunks(correct, G)),
        **top_vote_metrics(per_prompt, car.answers, [p.answer for p in problems]),
    }


def make_groups(
    problems, answers, stats, answer_mask, response_mask, G, coreward, vocab, pools=None
):
    """One RewardGroup per prompt (CoReward pairs prompt g with its paraphrase g ± P; CAR's
    pair answers, when given, join group g's soft-vote pool)."""
    per_prompt = _chunks(answers, G)
    certainty = entropy = None
    if stats is not None:
        valid = response_mask.float()
        certainty = (
            (stats["self_certainty"] * valid).sum(-1) / valid.sum(-1).clamp(min=1)
        ).tolist()
        am = answer_mask.float()
        ent = (stats["entropy"] * am).sum(-1) / am.sum(-1).clamp(min=1)
        entropy = [float(e) if am[i].any() else None for i, e in enumerate(ent)]
    half = len(problems) // 2
    groups = []
    for g, problem in enumerate(problems):
        partner = None
        if coreward:
            partner = per_prompt[g + half] if g < half else per_prompt[g - half]
        sl = slice(g * G, (g + 1) * G)
        groups.append(
            make_group(
                per_prompt[g],
                label=problem.answer,
                partner=partner,
                pool=pools[g] if pools is not None else None,
                self_certainty=certainty[sl] if certainty else None,
                answer_entropy=entropy[sl] if entropy else None,
                max_entropy=math.log(vocab),
            )
        )
    return groups


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
    advantages,
    answer_mask,
    format_adv,
    algo,
    grad_clip: float,
) -> dict[str, Any]:
    """PPO epochs over mini-batches; micro-batches accumulate gradients with the mini-batch's
    token count as the denominator. A non-finite loss or gradient skips the whole step.
    `old_logprobs` None: the policy's own (only valid for a `single_update`)."""
    B = len(seqs)
    mini = algo.mini_batch_size or B
    micro = algo.micro_batch_size or mini
    device = next(policy.parameters()).device
    sums: dict[str, list[float]] = defaultdict(list)
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(B) if (algo.ppo_epochs > 1 or mini < B) else torch.arange(B)
        for m0 in range(0, B, mini):
            mb = order[m0 : m0 + mini]
            num_tokens = seqs.response_mask[mb].sum().clamp(min=1).to(device)
            optimizer.zero_grad(set_to_none=True)
            for u0 in range(0, len(mb), micro):
                idx = mb[u0 : u0 + micro]
                part = seqs.select(idx).to(device)
                logits = response_logits(policy, part)
                logprobs, entropy = token_logprobs_and_entropy(logits.float(), part.response_ids)
                loss, metrics = grpo_loss(
                    logprobs,
                    logprobs.detach() if old_logprobs is None else old_logprobs[idx].to(device),
                    None if ref_logprobs is None else ref_logprobs[idx].to(device),
                    advantages[idx].to(device),
                    part.response_mask,
                    answer_mask[idx].to(device),
                    answer_weight=algo.answer_weight,
                    format_advantages=None if format_adv is None else format_adv[idx].to(device),
                    clip=algo.clip,
                    kl_coef=algo.kl_coef,
                    agg=algo.agg,
                    num_tokens=num_tokens,
                    entropy=entropy.detach(),
                )
                if algo.agg != "token-mean":  # sequence means: weight micro-batches by size
                    loss = loss * (len(idx) / len(mb))
                if not torch.isfinite(loss):
                    optimizer.zero_grad(set_to_none=True)
                    return {"skipped": True}
                loss.backward()
                for k, v in metrics.items():
                    sums[k].append(v)
            norm = torch.nn.utils.clip_grad_norm_(
                policy.parameters(), grad_clip if grad_clip > 0 else float("inf")
            )
            if not torch.isfinite(norm):
                optimizer.zero_grad(set_to_none=True)
                return {"skipped": True}
            sums["grad/norm"].append(float(norm))
            optimizer.step()
    out: dict[str, Any] = {k: float(np.mean(v)) for k, v in sums.items()}
    out["skipped"] = False
    return out


@torch.no_grad()
def validate(
    policy, tokenizer, encode, problems: list[Problem], cfg, step: int, recovery: dict
) -> dict:
    """avg@k, pass@k and unique answers per problem at the evaluation temperature. Runs on its
    own RNG stream so validating (or not) never changes the training trajectory."""
    k = cfg.eval.k
    policy.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed * 1_000_003 + step)
        seqs = sample(
            policy,
            [encode(p) for p in problems],
            n=k,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.eval.temperature,
            top_p=cfg.eval.top_p,
            eos_id=stop_token_ids(tokenizer, policy),
            pad_id=tokenizer.pad_token_id,
            batch_size=cfg.eval.batch_size,
        )
    _, answers, _ = extract(tokenizer, seqs)
    groups = [make_group(a, label=p.answer) for a, p in zip(_chunks(answers, k), problems)]
    correct = [
        [a is not None and p.answer is not None and equivalent(a, p.answer) for a in g.answers]
        for g, p in zip(groups, problems)
    ]
    return {
        "val/acc": float(np.mean([np.mean(c) for c in correct])),
        f"val/pass@{k}": float(np.mean([any(c) for c in correct])),
        "val/unique_answers": float(
            np.mean([len({c for c in g.classes if c is not None}) for g in groups])
        ),
        "val/extract_rate": float(np.mean([a is not None for a in answers])),
        **recovery_metrics(correct, recovery),
    }


def rollout_table(step, problems, G, texts, answers, correct, rewards, parts, advantages):
    return pd.DataFrame(
        {
            "step": step,
            "prompt_id": [p.id for p in problems for _ in range(G)],
            "rollout": [i for _ in problems for i in range(G)],
            "question": [p.question for p in problems for _ in range(G)],
            "text": texts,
            "answer": answers,
            "label": [p.answer for p in problems for _ in range(G)],
            "correct": pd.array(correct, dtype="boolean"),
            "reward": rewards,
            **{f"reward_{k}": v for k, v in parts.items()},
            "advantage": advantages.numpy(),
        }
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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
