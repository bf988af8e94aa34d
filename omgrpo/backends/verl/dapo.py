"""The DAPO-family options that need the step's rows on verl: dynamic sampling, overlong
filtering and the soft overlong punishment, with the native trainer's semantics and metrics
(`omgrpo.core.dapo.dapo_step` decides which rows are zero-spread or truncated and computes the
penalty, for both backends; docs/configuration.md).

Where verl 0.9.1 reads what these options change, and what the `omgrpo` trainer writes there
(`dapo_fields`, in its advantage step, before verl's GRPO step):

- **The rewards.** verl's GRPO step (`PPOTrainer._compute_advantage`) takes each rollout's
  reward from its `rm_scores` field, the score on the response's last token (the agent loop's
  `_postprocess`: ``rm_scores[-1] = reward_score``). The overlong penalty is added there, so the
  group advantages, and every reward metric after them (omgrpo's `reward/*`, verl's
  `critic/score/*`), see the penalised reward, as the native trainer's do.
- **The loss's normaliser.** verl's FSDP engines divide a token-mean loss by
  `batch_num_tokens`, the sum of the update mini-batch's `loss_mask` field over all
  data-parallel ranks (`FSDPEngine.forward_backward_batch`); the seq-mean modes divide by
  `global_batch_size`, fixed at `ppo_mini_batch_size * rollout.n` rows
  (`PPOTrainer._update_actor`). `loss_mask` is a TransferQueue field of its own, a copy of
  `response_mask` (`AgentLoopWorkerTQ._agent_loop_postprocess`, "TODO: uniform response_mask and
  loss_mask") that nothing else in an FSDP actor update reads. So the rows the loss keeps are
  written into `loss_mask` (`kept_loss_mask`): under token-mean their response tokens (the sum is
  the kept tokens), under the seq-mean modes one token per kept row (the sum is the kept rows),
  and `omgrpo_ppo_loss(..., dapo_rows=True)` aggregates over the kept rows' response tokens and
  divides by that sum (at least 1: a mini-batch whose rows were all dropped has loss 0, as
  natively). `response_mask` stays whole, so verl's response-length metrics and omgrpo's token
  metrics (`kl/*`, `entropy/*`, `answer/frac`) still cover every rollout, as the native
  trainer's do (`pg/answer_weight_share`, the PG term's, covers the loss's rows).

The truncated rollouts come from the agent loop (`TRUNCATED_KEY`, with the model's stop tokens:
`omgrpo.generation.engine.stop_token_ids`); the length limit is verl's
`actor_rollout_ref.rollout.response_length`. verl's balance-batch padding rows never count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict
from verl.workers.utils.padding import response_to_nested

from omgrpo.backends.verl import TRUNCATED_KEY
from omgrpo.backends.verl.advantage import uid_group_ids
from omgrpo.core.dapo import dapo_step

__all__ = ["dapo_fields", "dapo_read_fields", "drops_rows", "kept_loss_mask"]


def drops_rows(algo: Any) -> bool:
    """Whether `algo` (`omgrpo.algorithm`) takes rollouts out of the loss (dynamic sampling or
    the overlong filter): the loss then reads the kept rows from `loss_mask`."""
    return bool(getattr(algo, "dynamic_sampling", None) or getattr(algo, "overlong_filter", None))


def dapo_read_fields(algo: Any) -> list[str]:
    """The TransferQueue fields `dapo_fields` reads."""
    fields = ["uid", "response_mask", "rm_scores"]
    if getattr(algo, "overlong_filter", None):
        fields.append(TRUNCATED_KEY)
    return fields


def kept_loss_mask(response_mask: torch.Tensor, keep: torch.Tensor, agg: str) -> torch.Tensor:
    """(B, T) verl's `loss_mask` for the rows `keep` (B,) bool: under `token-mean` their response
    tokens, under the seq-mean modes their first response token (one per kept row, so that the
    engine's sum of it, `batch_num_tokens`, counts the kept rows); in `response_mask`'s dtype."""
    kept = response_mask.bool() & keep.bool().unsqueeze(-1)
    if agg != "token-mean":
        kept = kept & (kept.long().cumsum(-1) == 1)
    return kept.to(response_mask.dtype)


def dapo_fields(
    data: TensorDict, real: Sequence[bool], algo: Any, max_len: int, agg: str
) -> tuple[TensorDict, dict[str, float]]:
    """The DAPO options of `algo` on a step's rows as TransferQueue holds them (module docstring).

    Args:
        data: the step's rows (`dapo_read_fields`): `uid`, jagged `response_mask` and
            `rm_scores` and, with the overlong filter, the agent loop's `TRUNCATED_KEY`.
        real: (B,) False for verl's balance-batch padding rows (left out of every decision and
            metric, and of the loss).
        algo: `omgrpo.algorithm`.
        max_len: the length limit, `actor_rollout_ref.rollout.response_length`.
        agg: the actor's `loss_agg_mode` (`kept_loss_mask`).

    Returns:
        ``(fields, metrics)``: the fields to put back (jagged `rm_scores` with the overlong
        penalty on each rollout's last token; jagged `loss_mask` of the kept rows with dynamic
        sampling or the overlong filter) and the `dapo/*` metrics of `dapo_step`.
    """
    nested_mask = data["response_mask"]
    resp = nested_mask.to_padded_tensor(0)
    scores = data["rm_scores"].to_padded_tensor(0.0)
    rows = torch.as_tensor(list(real), dtype=torch.bool).nonzero().squeeze(-1)
    uids = data.get("uid").tolist()
    lengths = resp.long().sum(-1)
    rewards = scores.double().sum(-1)
    truncated = torch.zeros(len(uids), dtype=torch.bool)
    if getattr(algo, "overlong_filter", None):
        truncated = data[TRUNCATED_KEY].reshape(-1).bool()
    step = dapo_step(
        algo,
        rewards[rows].numpy(),
        uid_group_ids([uids[i] for i in rows.tolist()]),
        lengths[rows],
        truncated[rows],
        max_len,
    )
    fields: dict[str, torch.Tensor] = {}
    if getattr(algo, "overlong_buffer", None) is not None:
        # verl's reward sits on the response's last token (the jagged row's last element)
        last = (nested_mask.offsets().diff() - 1).clamp(min=0)[rows]
        others = rewards[rows] - scores[rows, last].double()
        shaped = scores.clone()
        shaped[rows, last] = (torch.as_tensor(step.rewards) - others).to(scores.dtype)
        fields["rm_scores"] = response_to_nested(shaped, nested_mask)
    if step.sample_mask is not None:
        keep = torch.zeros(len(uids), dtype=torch.bool)
        keep[rows] = step.sample_mask
        fields["loss_mask"] = response_to_nested(kept_loss_mask(resp, keep, agg), nested_mask)
    return TensorDict(fields, batch_size=len(uids)), step.metrics
