"""One training step's rollouts, scored: the typed batch both backends share.

`score_step` turns generated responses into a `StepBatch` (decode, extract the last
`\\boxed{}` answer and its token span, cluster each group's answers with CAR's pair answers as
extra voters, rewards, GRPO advantages); `step_metrics` turns a `StepBatch` into the step's
diagnostics (`reward/*`, `answers/*`, `acc/train`, `car/*`, `response/length_mean`). The native
trainer scores a whole step at once; verl's agent loop scores each prompt's group as it
finishes and its driver rebuilds the step's batch from the rollouts' records
(`omgrpo.backends.verl.metrics`), so both compute the same numbers with the same code.

Labels never enter a label-free reward: `correct` and the label-based metrics only diagnose.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np
import pandas as pd
import torch

from omgrpo.core.answers import Grader, equivalent, extract_boxed
from omgrpo.core.car import CarResult, top_vote_metrics
from omgrpo.core.diagnostics import (
    answer_diagnostics,
    confidently_wrong,
    label_flip_rate,
    majority_answers,
    task_diagnostics,
)
from omgrpo.core.losses import group_advantages, grpo_loss
from omgrpo.core.masks import mask_metrics, mask_spans, masked_tokens, masks_on, token_mask
from omgrpo.core.process import ProcessScorer, StepScores, aggregate, process_metrics
from omgrpo.core.reward_quality import reward_quality_metrics
from omgrpo.core.rewards import RewardGroup, compute_rewards, format_score, make_group
from omgrpo.core.spans import answer_char_span, response_offsets, span_token_mask, with_stop_token
from omgrpo.core.task import Problem, TaskProbe

__all__ = [
    "LoopState",
    "Responses",
    "StepBatch",
    "decode_responses",
    "extract_answer",
    "is_correct",
    "masked_step",
    "score_step",
    "step_metrics",
]


@dataclass
class LoopState:
    """What a training loop carries from step to step (checkpointed, so resume is exact).
    verl's trainer keeps `last_majority` and `collapse` in one too."""

    step: int = 0
    """The step being run, or the last one finished (0: none yet)."""
    skipped: int = 0
    """Steps skipped for a non-finite loss or gradient (`train/skipped_steps`)."""
    consecutive_skips: int = 0
    """Skipped steps in a row (the run aborts at `trainer.max_consecutive_skips`)."""
    last_majority: dict[str, str] = field(default_factory=dict)
    """Prompt id -> majority answer at its last visit (`answers/label_flip_rate`)."""
    recovery: dict[str, list[int]] = field(default_factory=dict)
    """Validation prompts no sample solved at step 0, and those solved since (`recovery/*`)."""
    collapse: dict[str, Any] = field(default_factory=lambda: {"streak": 0, "detected_step": None})
    """`omgrpo.core.diagnostics.CollapseDetector.state` (the detector updates this dict)."""


@dataclass
class Responses:
    """Generated tokens of B rollouts, decoded, with the token span of each final answer and
    the tokens of the other roles the diagnostics split KL and entropy by."""

    ids: torch.Tensor  # (B, T) int64 generated token ids, right-padded
    mask: torch.Tensor  # (B, T) 1 on generated tokens (eos included)
    answer_mask: torch.Tensor  # (B, T) bool: the answer span's tokens (`algorithm.answer_span`)
    texts: list[str]  # (B,) decoded responses (special tokens dropped)
    answers: list[str | None]  # (B,) content of the last \boxed{} (None: no answer)
    result_mask: torch.Tensor | None = None  # (B, T) bool: the last computed line's result
    format_mask: torch.Tensor | None = None  # (B, T) bool: the closing line (and eos), not answer
    # span -> (B, T) bool: further spans the generic masks read (`omgrpo.core.masks.mask_spans`)
    span_masks: dict[str, torch.Tensor] = field(default_factory=dict)

    def role_masks(self) -> dict[str, torch.Tensor]:
        """(B, T) bool masks of the non-answer roles: `result` (the value the reasoning computed
        last, `a op b = c`), `format` (the closing line around the answer, and eos) and `other`
        (the remaining reasoning tokens)."""
        resp = self.mask.bool()
        result = self.result_mask & resp & ~self.answer_mask  # (a closing-line span holds it)
        fmt = self.format_mask & resp & ~result & ~self.answer_mask
        return {"result": result, "format": fmt, "other": resp & ~self.answer_mask & ~result & ~fmt}


@dataclass
class StepBatch:
    """One step's rollouts, scored: P prompts with G rollouts each (B = P * G rows, in group
    order: the rows of group g are contiguous, and group g answers `prompts[g]`).

    Built by `score_step`. verl's driver builds it from the rollouts' records, without the
    token-level fields (`responses`, advantages): verl keeps those in its own batch.
    """

    prompts: list[Problem]  # (P,) one per group; CoReward: P/2 questions, then paraphrases
    group_ids: torch.Tensor  # (B,) int64 group of each rollout, 0..P-1, non-decreasing
    responses: Responses | None  # (B, T) tokens, masks and texts; None in verl's driver
    answers: list[str | None]  # (B,) z_i, the extracted answers
    correct: list[bool | None]  # (B,) z_i equivalent to the label (None: unlabelled); diagnostic
    groups: list[RewardGroup]  # (P,) each group's answer classes (+ CAR pool), as rewarded
    reward_parts: dict[str, np.ndarray]  # part -> (B,) float64, each reward part
    rewards: np.ndarray  # (B,) float64 weighted sum of the parts
    advantages: torch.Tensor | None  # (B,) float32 GRPO advantage A_i; None in verl's driver
    format_advantages: torch.Tensor | None = None  # (B,) format-only: answer tokens' advantage
    car: CarResult | None = None  # CAR's pair answers per group (extra voters, never trained)
    grader: Grader | None = None  # the step's grader (CAR diagnostics re-cluster with it)
    step_scores: list[StepScores] | None = None  # (B,) the PRM's step scores (reward `process`)
    process: list[float | None] | None = None  # (B,) their aggregate (None: unscored)
    token_mask: torch.Tensor | None = None  # (B, T) bool: taken out by the generic masks
    sample_mask: torch.Tensor | None = None  # (B,) bool: rollouts in the loss (core.dapo)

    def per_group(self, values: list) -> list[list]:
        """(B,) values as P lists, one per group."""
        sizes = torch.bincount(self.group_ids, minlength=len(self.prompts)).tolist()
        bounds = np.cumsum([0, *sizes]).tolist()
        return [values[a:b] for a, b in pairwise(bounds)]

    def per_rollout(self, values: list) -> list:
        """(P,) per-prompt values repeated for each rollout: (B,)."""
        return [values[g] for g in self.group_ids.tolist()]


def extract_answer(text: str) -> str | None:
    """The content of the last `\\boxed{}` of a response (None: none, or malformed)."""
    boxed = extract_boxed(text)
    return boxed.content if boxed is not None else None


def is_correct(answer: str | None, label: str | None, grader: Grader) -> bool | None:
    """Whether an answer is equivalent to the label; None without a label (diagnostics only)."""
    if label is None:
        return None
    return answer is not None and equivalent(answer, label, grader)


def decode_responses(
    tokenizer: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    probe: TaskProbe | None = None,
    span: str = "boxed",
    spans: Sequence[str] = (),
) -> Responses:
    """Decode each response, extract its boxed answer and mark the tokens of each role; the
    `result` role is the task's (`probe.result_span`; no probe: no result tokens). `span`: the
    answer span (`algorithm.answer_span`, `omgrpo.core.spans.ANSWER_SPANS`; not `boxed`: with
    the special token, eos, right after it). `spans`: further spans to mark, alike
    (`Responses.span_masks`)."""
    rows = [ids[i, : int(n)].tolist() for i, n in enumerate(mask.sum(-1).tolist())]
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    # one batched re-tokenization for the offsets (a call per row cost ~0.5 s at 64 x 8)
    encoded = tokenizer(texts, return_offsets_mapping=True, add_special_tokens=False)
    char_offsets = np.zeros((*ids.shape, 2), dtype=np.int64)  # (B, T, 2), filled row by row
    special = frozenset(tokenizer.all_special_ids)
    no_span = (0, 0)  # (start, end) of a missing span: overlaps no token
    answer_span, result_span, closing = [], [], []  # (B, 2), (B, 2), (B,)
    answers, boxes = [], []
    for i, (row, text) in enumerate(zip(rows, texts)):
        row_encoding = {k: encoded[k][i] for k in ("input_ids", "offset_mapping")}
        if row:
            char_offsets[i, : len(row)] = response_offsets(
                tokenizer, row, text, encoding=row_encoding, special=special
            )
        boxed = extract_boxed(text)
        boxes.append(boxed)
        answer_span.append(answer_char_span(text, span, boxed) or no_span)
        result_span.append((probe.result_span(text) if probe else None) or no_span)
        # the closing line, to the end (eos has an empty offset there); none without a box
        closing.append(len(text) + 1 if boxed is None else text.rfind("\n", 0, boxed.span[0]) + 1)
        answers.append(boxed.content if boxed is not None else None)
    offsets = torch.from_numpy(char_offsets)
    real = torch.arange(ids.shape[1]) < torch.tensor([len(r) for r in rows])[:, None]
    answer_mask = span_token_mask(offsets, torch.tensor(answer_span))
    stop = real & torch.isin(ids.cpu(), torch.tensor(sorted(special), dtype=ids.dtype))
    if span != "boxed":  # the eos ending the response right after the answer
        answer_mask = with_stop_token(answer_mask, stop)
    span_masks = {}
    for other in spans:
        chars = [answer_char_span(t, other, b) or no_span for t, b in zip(texts, boxes)]
        other_mask = span_token_mask(offsets, torch.tensor(chars, dtype=torch.long).reshape(-1, 2))
        span_masks[other] = other_mask if other == "boxed" else with_stop_token(other_mask, stop)
    return Responses(
        ids=ids,
        mask=mask,
        answer_mask=answer_mask,
        texts=texts,
        answers=answers,
        result_mask=span_token_mask(offsets, torch.tensor(result_span)),
        format_mask=real & (offsets[..., 0] >= torch.tensor(closing)[:, None]),
        span_masks=span_masks,
    )


def score_step(
    tokenizer: Any,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    problems: list[Problem],
    cfg: Any,
    *,
    car: CarResult | None = None,
    stats: dict[str, torch.Tensor] | None = None,
    grader: Grader | None = None,
    probe: TaskProbe | None = None,
    process: ProcessScorer | None = None,
) -> StepBatch:
    """Score a step's rollouts (rollouts of a prompt contiguous, G = B / len(problems)).

    Args:
        tokenizer: the policy's HF fast tokenizer (offsets map answers to tokens).
        response_ids, response_mask: (B, T) generated ids, right-padded, and their mask.
        problems: the P prompts; labels only reach the `gt` reward and `correct`. With the
            `coreward` reward, the second half are the first half's paraphrases.
        cfg: anything with `reward` (`RewardConfig`) and `algorithm` (`AlgorithmConfig`): the
            native config or verl's `omgrpo` section.
        car: CAR's pair answers per prompt; they join the soft-vote pool.
        stats: the policy's per-token `entropy` and `self_certainty` (B, T), for the rewards
            that read them.
        grader: the step's `Grader` (its budget is spent here); default: a fresh one from
            `cfg.reward`.
        probe: the task's hook for the `result` token role (`omgrpo.tasks.task_probe`).
        process: the PRM (`omgrpo.models.prm`), for the `process` reward: each response's step
            scores, aggregated by `cfg.reward.prm.aggregate`.
    """
    grader = grader if grader is not None else Grader.from_config(cfg.reward)
    span = cfg.algorithm.answer_span
    responses = decode_responses(
        tokenizer, response_ids, response_mask, probe, span, mask_spans(cfg.algorithm)
    )
    answers = responses.answers
    G = len(answers) // len(problems)
    coreward = "coreward" in cfg.reward.parts
    step_scores = aggregated = None
    if "process" in cfg.reward.parts:
        if process is None:
            raise ValueError("reward 'process' needs a process reward model (reward.prm)")
        questions = [problems[i // G].question for i in range(len(answers))]
        step_scores = process(questions, responses.texts)
        how = cfg.reward.prm.aggregate
        aggregated = [None if s is None else aggregate(s, how) for s in step_scores]
    groups = _reward_groups(problems, responses, G, len(tokenizer), stats, car, coreward, grader)
    if aggregated is not None:
        groups = [
            dataclasses.replace(g, process=aggregated[i * G : (i + 1) * G])
            for i, g in enumerate(groups)
        ]
    rewards, parts = compute_rewards(groups, list(cfg.reward.parts), dict(cfg.reward.weights))
    group_ids = torch.arange(len(problems)).repeat_interleave(G)
    eps = cfg.algorithm.adv_eps
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float32), group_ids, eps)
    format_adv = None
    if cfg.algorithm.format_only:  # answer tokens get the format reward's advantage
        fmt = torch.tensor([format_score(a) for a in answers])
        format_adv = group_advantages(fmt, group_ids, eps)
    return StepBatch(
        prompts=list(problems),
        group_ids=group_ids,
        responses=responses,
        answers=answers,
        correct=[
            is_correct(a, problems[g].answer, grader) for a, g in zip(answers, group_ids.tolist())
        ],
        groups=groups,
        reward_parts=parts,
        rewards=rewards,
        advantages=advantages,
        format_advantages=format_adv,
        car=car,
        grader=grader,
        step_scores=step_scores,
        process=aggregated,
    )


def _reward_groups(
    problems, responses, G, vocab, stats, car, coreward, grader
) -> list[RewardGroup]:
    """One RewardGroup per prompt (CoReward pairs prompt g with its paraphrase g +- P/2; CAR's
    pair answers, when given, join group g's soft-vote pool)."""
    per_prompt = [responses.answers[g * G : (g + 1) * G] for g in range(len(problems))]
    certainty = entropy = None
    if stats is not None:
        valid = responses.mask.float()
        certainty = (
            (stats["self_certainty"] * valid).sum(-1) / valid.sum(-1).clamp(min=1)
        ).tolist()
        am = responses.answer_mask.float()
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
                pool=car.answers[g] if car is not None else None,
                self_certainty=certainty[sl] if certainty else None,
                answer_entropy=entropy[sl] if entropy else None,
                max_entropy=math.log(vocab),
                grader=grader,
            )
        )
    return groups


def step_loss(
    batch: StepBatch,
    idx: torch.Tensor,
    logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    algo: Any,
    num_tokens: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float | None = None,
    entropy: torch.Tensor | None = None,
    roles: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`grpo_loss` of the rows `idx` of a scored step under `algo` (`config.algorithm`), with
    the step's advantages, answer mask, format advantages and the full-batch `old_logprobs`,
    `ref_logprobs` and `roles` indexed by `idx` and moved to the log-probs' device, and the
    generic masks' `token_mask` and the DAPO options' `sample_mask`. Without `old_logprobs` the
    ratio is 1; `kl_coef` overrides `algo.kl_coef` (0: the PG term alone). The one place the
    native update and the mechanism probe build the loss."""
    device = logprobs.device
    fmt = batch.format_advantages
    masked = batch.token_mask
    return grpo_loss(
        logprobs,
        logprobs.detach() if old_logprobs is None else old_logprobs[idx].to(device),
        None if ref_logprobs is None else ref_logprobs[idx].to(device),
        batch.advantages[idx].to(device),
        response_mask,
        batch.responses.answer_mask[idx].to(device),
        answer_weight=algo.answer_weight,
        answer_kl_weight=algo.answer_kl_weight,
        format_advantages=None if fmt is None else fmt[idx].to(device),
        clip=algo.clip,
        clip_low=getattr(algo, "clip_low", None),
        clip_high=getattr(algo, "clip_high", None),
        kl_coef=algo.kl_coef if kl_coef is None else kl_coef,
        agg=algo.agg,
        num_tokens=num_tokens,
        entropy=entropy,
        roles=None if roles is None else {k: v[idx].to(device) for k, v in roles.items()},
        token_mask=None if masked is None else masked[idx].to(device),
        sample_mask=None if batch.sample_mask is None else batch.sample_mask[idx].to(device),
    )


def masked_step(
    batch: StepBatch, algo: Any, *, seed: int, step: int, entropy: torch.Tensor | None = None
) -> tuple[StepBatch, dict[str, float]]:
    """The generic masks of `algo` (`config.algorithm`; `omgrpo.core.masks`) on a scored step:
    the batch with its `token_mask` (rollout index = row), and the `mask/*` metrics; the batch
    unchanged and no metrics without a generic mask. `seed`, `step`: the random draw's;
    `entropy`: (B, T) per-token entropy under the sampling policy (`top_entropy_quantile`)."""
    if not masks_on(algo):
        return batch, {}
    r = batch.responses
    mask = token_mask(algo, r.mask, seed=seed, step=step, entropy=entropy, spans=r.span_masks)
    masked = masked_tokens(r.mask, r.answer_mask, algo.answer_weight, algo.format_only, mask)
    return dataclasses.replace(batch, token_mask=mask), mask_metrics(
        masked, r.mask, r.span_masks["boxed"]
    )


def step_metrics(
    batch: StepBatch, state: LoopState, confident_share: float, probe: TaskProbe | None = None
) -> dict[str, Any]:
    """Every diagnostic of one scored step (`state.last_majority` is updated in place).

    `reward/total`, `reward/<part>`, `answers/*` (including the string `answers/batch_mode`),
    `acc/train`, `reward_quality/*` (`omgrpo.core.reward_quality`: the proxy reward vs the
    labels, a diagnostic), with CAR the `car/*` diagnostics and the pool's vote
    `car/top_vote_acc`, and, where the batch holds tokens, `response/length_mean` and, given
    the task's `probe`, its `task_diagnostics` (the toy world's guess rates and process
    quality). `confident_share` is `collapse.confident_share`.
    """
    correct = batch.per_group(batch.correct)
    metrics: dict[str, Any] = {
        "reward/total": float(np.mean(batch.rewards)),
        **{f"reward/{k}": float(np.mean(v)) for k, v in batch.reward_parts.items()},
        **answer_diagnostics(batch.groups, correct),
        "answers/confidently_wrong": confidently_wrong(batch.groups, correct, confident_share),
        "answers/label_flip_rate": label_flip_rate(
            [p.id for p in batch.prompts], majority_answers(batch.groups), state.last_majority
        ),
        **reward_quality_metrics(
            batch.per_group(batch.rewards.tolist()), correct, [g.classes for g in batch.groups]
        ),
    }
    if batch.car is not None:
        answers = batch.per_group(batch.answers)
        metrics.update(batch.car.diagnostics(answers, correct, batch.grader))
        labels = [p.answer for p in batch.prompts]
        metrics.update(top_vote_metrics(answers, batch.car.answers, labels, batch.grader))
    if batch.step_scores is not None:
        metrics.update(process_metrics(batch.step_scores, batch.process, batch.correct))
    if batch.responses is not None:
        lengths = batch.responses.mask.sum(-1).float()
        metrics["response/length_mean"] = float(lengths.mean())
        prompts = batch.per_rollout(batch.prompts)
        metrics.update(
            task_diagnostics(batch.responses.texts, batch.answers, prompts, batch.correct, probe)
        )
    return metrics


def rollout_table(
    step: int, batch: StepBatch, texts: list[str | None] | None = None
) -> pd.DataFrame:
    """The step's rollouts, one row each: the run store's `rollouts/step_*.parquet` of both
    backends. `texts`: the responses (default `batch.responses.texts`; verl's driver passes the
    agent loop's)."""
    prompts = batch.per_rollout(batch.prompts)
    if texts is None:
        texts = batch.responses.texts if batch.responses is not None else [None] * len(prompts)
    advantages = batch.advantages
    prm = {}
    if batch.step_scores is not None:  # the PRM's score of each step, as text ("" unscored)
        prm["prm_step_scores"] = [
            "" if s is None else " ".join(f"{x:.4f}" for x in s) for s in batch.step_scores
        ]
    return pd.DataFrame(
        {
            "step": step,
            "prompt_id": [p.id for p in prompts],
            "rollout": [i for g in batch.per_group(batch.answers) for i in range(len(g))],
            "question": [p.question for p in prompts],
            "text": texts,
            "answer": batch.answers,
            "label": [p.answer for p in prompts],
            "correct": pd.array(batch.correct, dtype="boolean"),
            "reward": batch.rewards,
            **{f"reward_{k}": v for k, v in batch.reward_parts.items()},
            "advantage": advantages.numpy() if advantages is not None else np.nan,
            **prm,
        }
    )
