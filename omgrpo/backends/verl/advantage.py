"""Answer-token weighting of verl's GRPO advantages (the Outcome-Masked Update, paper §3.2).

verl's GRPO estimator gives every response token of rollout i the same advantage A_i (per-uid
mean and unbiased std, eps 1e-6: the same as `omgrpo.core.losses.group_advantages`). OM-GRPO then
weights it per token: w on answer-span tokens, 1 elsewhere; in the "format-only" ablation
answer tokens get the group advantage of the format reward instead. The V1 trainer's advantage
step reads only uid / response_mask / rm_scores / log-probs / values, so the `omgrpo` trainer
applies this right after it: `weight_jagged` on the rollouts as TransferQueue stores them
(jagged, one row per rollout), through `apply_answer_weighting` on the padded batch. With a
generic mask (`omgrpo.core.masks`: `top_entropy_quantile`, `random_mask`), `generic_masks`
draws it over the step's stored rollouts first, and its tokens get advantage 0 (and, through
`omgrpo_token_mask`, KL weight 0 in the loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.workers.utils.padding import response_to_nested

from omgrpo.backends.verl import ANSWER_MASK_KEY, FORMAT_SCORE_KEY, TOKEN_MASK_KEY, span_mask_key
from omgrpo.core.losses import answer_token_advantages, group_advantages
from omgrpo.core.masks import mask_metrics, mask_spans, masked_tokens, token_mask

__all__ = [
    "apply_answer_weighting",
    "generic_masks",
    "uid_group_ids",
    "weight_advantages",
    "weight_jagged",
]


def uid_group_ids(uids: Sequence[object]) -> torch.Tensor:
    """(B,) int64 group id per rollout from verl's per-prompt `uid` strings."""
    _, inverse = np.unique(np.asarray([str(u) for u in uids], dtype=object), return_inverse=True)
    return torch.as_tensor(inverse, dtype=torch.int64)


def weight_advantages(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    answer_weight: float,
    format_advantages: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages with the answer span weighted.

    Args:
        advantages: (B, T) verl advantages (A_i on every response token of rollout i).
        response_mask: (B, T) valid response tokens.
        answer_mask: (B, T) answer-span tokens (outside the response they are ignored).
        answer_weight: w (0 = OM-GRPO, 1 = GRPO).
        format_advantages: optional (B,) format-reward advantage: answer tokens take it
            instead of w * A_i ("format-only").
        token_mask: optional (B, T) tokens of the generic masks: advantage 0.

    Returns:
        (B, T) advantages, 0 outside the response (as verl's).
    """
    if advantages.shape != response_mask.shape or answer_mask.shape != advantages.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)}, response_mask {tuple(response_mask.shape)} "
            f"and {ANSWER_MASK_KEY} {tuple(answer_mask.shape)} must have the same (B, T) shape"
        )
    resp = response_mask.bool()
    answer = answer_mask.bool() & resp
    out = answer_token_advantages(advantages, answer, answer_weight, format_advantages)
    if token_mask is not None:
        out = torch.where(token_mask.bool(), torch.zeros_like(out), out)
    return out * resp.to(advantages.dtype)


def apply_answer_weighting(
    data: DataProto,
    answer_weight: float,
    format_only: bool = False,
    eps: float = 1e-6,
    token_mask: torch.Tensor | None = None,
) -> DataProto:
    """Weight `data.batch["advantages"]` in place on answer tokens and return `data`.

    Reads `advantages`, `response_mask`, `omgrpo_answer_mask` (B, T) and, for `format_only`,
    `omgrpo_format` (B,) with `non_tensor_batch["uid"]` (the prompt groups). The answer mask
    is intersected with `response_mask` (and written back so the loss sees the same tokens).
    Nothing here compares masks with responses: verl's balance-batch padding rows (a copy of
    another rollout's fields with a one-token response and `response_mask` 0) lose their copied
    answer mask only because their `response_mask` is 0, and `weight_jagged` cuts every row
    back to its response length. `token_mask`: (B, T) the generic masks' tokens (`generic_masks`),
    advantage 0 there; stored, cut to the response, as `omgrpo_token_mask` for the loss.
    """
    batch = data.batch
    for key in ("advantages", "response_mask", ANSWER_MASK_KEY):
        if key not in batch:
            raise KeyError(
                f"batch has no '{key}': the omgrpo agent loop records {ANSWER_MASK_KEY} "
                "(set actor_rollout_ref.rollout.agent.agent_loop_manager_class, see docs/verl.md)"
            )
    response_mask = batch["response_mask"]
    answer_mask = batch[ANSWER_MASK_KEY].to(response_mask.dtype) * response_mask
    batch[ANSWER_MASK_KEY] = answer_mask
    format_adv = None
    if format_only:
        if FORMAT_SCORE_KEY not in batch:
            raise KeyError(f"format_only needs the per-rollout '{FORMAT_SCORE_KEY}' field")
        groups = uid_group_ids(data.non_tensor_batch["uid"])
        fmt = batch[FORMAT_SCORE_KEY].reshape(-1).to(torch.float32)
        format_adv = group_advantages(fmt, groups, eps)
    if token_mask is not None:
        token_mask = token_mask.to(response_mask.dtype) * response_mask
        batch[TOKEN_MASK_KEY] = token_mask
    batch["advantages"] = weight_advantages(
        batch["advantages"], response_mask, answer_mask, answer_weight, format_adv, token_mask
    )
    return data


def weight_jagged(
    data: TensorDict,
    answer_weight: float,
    format_only: bool = False,
    eps: float = 1e-6,
    token_mask: torch.Tensor | None = None,
) -> TensorDict:
    """`apply_answer_weighting` on rollouts as TransferQueue holds them.

    Args:
        data: `uid` (non-tensor), jagged `response_mask`, `advantages`, `omgrpo_answer_mask`
            and, for `format_only`, `omgrpo_format`.
        answer_weight, format_only, eps: as `apply_answer_weighting`.
        token_mask: (B, T) padded, the generic masks' tokens (`generic_masks`), or None.

    Returns:
        A TensorDict with the jagged `advantages` and `omgrpo_answer_mask` (and, with
        `token_mask`, `omgrpo_token_mask`), each row as long as its response (a padding row's
        copied, longer answer mask comes back one token long).
    """
    nested_mask = data["response_mask"]
    names = list(data.keys())  # (iterating a TensorDict gives rows)
    proto = DataProto(batch=data.select(*[k for k in names if k != "uid"]).to_padded_tensor())
    if "uid" in names:
        uids = data.get("uid").tolist()
        proto.non_tensor_batch["uid"] = np.array([str(u) for u in uids], dtype=object)
    if token_mask is not None:
        token_mask = _to_width(token_mask, proto.batch["response_mask"].shape[-1])
    apply_answer_weighting(proto, answer_weight, format_only, eps, token_mask)
    keys = ("advantages", ANSWER_MASK_KEY) + ((TOKEN_MASK_KEY,) if token_mask is not None else ())
    return TensorDict(
        {key: response_to_nested(proto.batch[key], nested_mask) for key in keys},
        batch_size=data.batch_size,
    )


def _to_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T') cut or zero-padded on the right to (B, width)."""
    if x.shape[-1] >= width:
        return x[..., :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def generic_masks(
    data: TensorDict, algo: Any, *, seed: int, step: int
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The generic masks (`omgrpo.core.masks`) over the step's rollouts as TransferQueue holds
    them: `(token_mask, metrics)`.

    Args:
        data: the step's rows (padding rows included, in the advantage step's order: a row's
            position is its rollout index): jagged `response_mask`, `omgrpo_answer_mask`, the
            agent loop's `omgrpo_span_<span>` for `mask_spans(algo)` and, for
            `top_entropy_quantile`, the old-log-prob pass's `entropy`.
        algo: `omgrpo.algorithm`.
        seed, step: `omgrpo.seed` and the training step (the random draw's generators).

    Returns:
        The (B, T) padded bool mask of the tokens taken out (None without `top_entropy_quantile`
        and `random_mask`) and the `mask/*` metrics ({} without a generic mask). A padding row
        (response_mask 0) is never masked and never counts.
    """
    spans = mask_spans(algo)
    if not spans:
        return None, {}
    resp = data["response_mask"].to_padded_tensor(0).bool()
    width = resp.shape[-1]

    def padded(key: str) -> torch.Tensor:
        return _to_width(data[key].to_padded_tensor(0), width).bool() & resp

    span_masks = {span: padded(span_mask_key(span)) for span in spans}
    entropy = None
    if getattr(algo, "top_entropy_quantile", None) is not None:
        entropy = _to_width(data["entropy"].to_padded_tensor(0.0), width)
    mask = token_mask(algo, resp, seed=seed, step=step, entropy=entropy, spans=span_masks)
    answer = padded(ANSWER_MASK_KEY)
    masked = masked_tokens(resp, answer, algo.answer_weight, algo.format_only, mask)
    return mask, mask_metrics(masked, resp, span_masks["boxed"])
