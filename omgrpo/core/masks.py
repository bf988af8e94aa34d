"""Generic token masks: study v4's controls for the answer mask (PREREGISTRATION-v4).

Besides the answer span (`algorithm.answer_span`, weighted by `answer_weight`; its value
`closing_only` is the first control), two options take response tokens out of training, with
weight 0 in both the PG and the KL term:

* `algorithm.top_entropy_quantile` q (TRL's name and meaning): only the response tokens whose
  entropy under the sampling policy is at or above the step's (1 - q) quantile, taken over all
  the step's response tokens, are trained (:func:`top_entropy_mask`);
* `algorithm.random_mask` <span>: per rollout, as many response tokens as its <span> holds (0
  without a well-formed box) are drawn uniformly, without replacement, by a generator seeded
  from (seed, step, rollout), never the sampling RNG (:func:`random_token_mask`).

The `answer` token role stays `answer_span`. Pure tensor functions, the one implementation both
backends call: the native trainer on the step's batch (`omgrpo.core.step.masked_step`), verl's
driver on the stored rollouts (`omgrpo.backends.verl.advantage.generic_masks`). Both log
:func:`mask_metrics`: `mask/frac` and `mask/answer_overlap`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from omgrpo.core.losses import token_means, token_stats

__all__ = [
    "mask_metrics",
    "mask_spans",
    "masked_tokens",
    "masks_on",
    "quantile",
    "random_token_mask",
    "rollout_seed",
    "token_mask",
    "token_masks_on",
    "top_entropy_mask",
]


def token_masks_on(algo: Any) -> bool:
    """Whether `algo` (`config.algorithm`) asks for a mask beside the answer span:
    `top_entropy_quantile` or `random_mask` set."""
    return (
        getattr(algo, "top_entropy_quantile", None) is not None
        or getattr(algo, "random_mask", None) is not None
    )


def masks_on(algo: Any) -> bool:
    """Whether `algo` runs one of the generic masks (`answer_span: closing_only`,
    `top_entropy_quantile`, `random_mask`): then the step logs the `mask/*` metrics."""
    return getattr(algo, "answer_span", "boxed") == "closing_only" or token_masks_on(algo)


def mask_spans(algo: Any) -> tuple[str, ...]:
    """The spans (`omgrpo.core.spans.ANSWER_SPANS`) whose token masks the generic masks read
    besides the answer span: `boxed` (for `mask/answer_overlap`) and `random_mask`'s span;
    none without a generic mask."""
    if not masks_on(algo):
        return ()
    random_span = getattr(algo, "random_mask", None)
    return tuple(dict.fromkeys(["boxed", *([random_span] if random_span else [])]))


def quantile(values: Tensor, q: float) -> Tensor:
    """The `q`-quantile of `values` (all elements) by linear interpolation between the order
    statistics at rank q * (n - 1) (numpy's and `torch.quantile`'s default, the same lerp), in
    float64 and without `torch.quantile`'s limit on the input size. 0-dim; nan for no values."""
    v = values.detach().double().flatten().sort().values
    if v.numel() == 0:
        return torch.tensor(math.nan, dtype=torch.float64)
    rank = q * (v.numel() - 1)
    lo = min(math.floor(rank), v.numel() - 1)
    hi = min(lo + 1, v.numel() - 1)
    return torch.lerp(v[lo], v[hi], torch.tensor(rank - lo, dtype=torch.float64))


def top_entropy_mask(entropy: Tensor, response_mask: Tensor, top_quantile: float) -> Tensor:
    """(B, T) bool: the response tokens `algorithm.top_entropy_quantile` takes out of training.

    TRL's rule (`get_high_entropy_mask`): a response token is trained when its entropy is at or
    above the (1 - q) quantile of the entropies of all the step's response tokens (`quantile`);
    the others are masked. q = 1 masks nothing; a step without response tokens neither.

    Args:
        entropy: (B, T) per-token entropy under the sampling policy (padding: any value).
        response_mask: (B, T) bool or 0/1, the response tokens (the quantile's population).
        top_quantile: q in (0, 1], the share of the step's response tokens kept.
    """
    resp = response_mask.bool()
    if not resp.any():
        return torch.zeros_like(resp)
    values = entropy.detach().double()
    threshold = quantile(values[resp], 1 - top_quantile).to(values.device)
    return resp & ~(values >= threshold)


def rollout_seed(seed: int, step: int, rollout: int) -> int:
    """The seed of `random_token_mask`'s generator for one rollout: a hash of (run seed, step,
    rollout index), so the draw is the same in every process and on resume, and independent of
    every RNG sampling uses."""
    digest = hashlib.sha256(f"omgrpo-random-mask/{seed}/{step}/{rollout}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def random_token_mask(
    response_mask: Tensor,
    counts: Tensor | Sequence[int],
    seed: int,
    step: int,
    rollouts: Sequence[int] | None = None,
) -> Tensor:
    """(B, T) bool: per rollout, `counts[i]` of its response tokens drawn uniformly without
    replacement (all of them when it has fewer), by a CPU generator seeded with
    `rollout_seed(seed, step, rollouts[i])` (`rollouts`: each row's rollout index in the step,
    default 0..B-1). A random permutation of the row's response positions, its first
    `counts[i]` taken."""
    resp = response_mask.detach().bool().cpu()
    counts = torch.as_tensor(counts).reshape(-1).tolist()
    rollouts = list(range(len(resp))) if rollouts is None else [int(r) for r in rollouts]
    out = torch.zeros_like(resp)
    for i, (count, rollout) in enumerate(zip(counts, rollouts, strict=True)):
        positions = resp[i].nonzero().squeeze(1)
        k = min(int(count), len(positions))
        if k <= 0:
            continue
        generator = torch.Generator().manual_seed(rollout_seed(seed, step, rollout))
        out[i, positions[torch.randperm(len(positions), generator=generator)[:k]]] = True
    return out.to(response_mask.device)


def token_mask(
    algo: Any,
    response_mask: Tensor,
    *,
    seed: int,
    step: int,
    entropy: Tensor | None = None,
    spans: Mapping[str, Tensor] | None = None,
    rollouts: Sequence[int] | None = None,
) -> Tensor | None:
    """(B, T) bool: the response tokens the generic masks of `algo` take out of training
    (weight 0 in the PG and KL terms): `top_entropy_mask` or / and `random_token_mask`; None
    when neither is configured.

    Args:
        algo: `config.algorithm` (`top_entropy_quantile`, `random_mask`).
        response_mask: (B, T) the step's response tokens (all of the step's rollouts).
        seed, step: the run's seed and the step (the random draw's generators).
        entropy: (B, T) per-token entropy under the sampling policy (`top_entropy_quantile`).
        spans: span -> (B, T) bool token mask (`random_mask`'s span: its counts per rollout).
        rollouts: each row's rollout index in the step (default 0..B-1).
    """
    if not token_masks_on(algo):
        return None
    resp = response_mask.bool()
    out = torch.zeros_like(resp)
    q = getattr(algo, "top_entropy_quantile", None)
    if q is not None:
        if entropy is None:
            raise ValueError("algorithm.top_entropy_quantile needs the step's per-token entropy")
        out |= top_entropy_mask(entropy, resp, float(q))
    span = getattr(algo, "random_mask", None)
    if span is not None:
        if spans is None or span not in spans:
            raise ValueError(f"algorithm.random_mask={span} needs the '{span}' span's token mask")
        counts = (spans[span].bool() & resp).sum(-1)
        out |= random_token_mask(resp, counts, seed, step, rollouts)
    return out


def masked_tokens(
    response_mask: Tensor,
    answer_mask: Tensor,
    answer_weight: float,
    format_only: bool,
    generic: Tensor | None,
) -> Tensor:
    """(B, T) bool: the response tokens with weight 0 in the PG term: the generic masks'
    (`token_mask`) and the answer span's when `answer_weight` is 0 (not format-only, where
    answer tokens take the format advantage)."""
    resp = response_mask.bool()
    out = torch.zeros_like(resp) if generic is None else generic.bool() & resp
    if answer_weight == 0 and not format_only:
        out = out | (answer_mask.bool() & resp)
    return out


def mask_metrics(masked: Tensor, response_mask: Tensor, boxed_mask: Tensor) -> dict[str, float]:
    """`mask/frac` (masked / response tokens) and `mask/answer_overlap` (the share of the
    `boxed` span's tokens that are masked; nan for a step without one) of one step, as
    `token_stats` token-weighted means (`masked`: `masked_tokens`)."""
    resp = response_mask.bool()
    stats = token_stats(
        {},
        {},
        extra={
            "mask/frac": (masked.bool() & resp, resp),
            "mask/answer_overlap": (masked.bool() & resp, boxed_mask.bool() & resp),
        },
    )
    return token_means(stats)
