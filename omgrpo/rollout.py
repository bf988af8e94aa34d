"""What the policy does without training: sample responses, and score given responses.

Sequences are laid out as a left-padded prompt block (B, P) followed by a right-padded response
block (B, T), so the logits predicting response token t sit at position P - 1 + t. Position ids
are counted from the first real token (cumsum of the attention mask), identical in sampling and
scoring, so a response's log-probs do not depend on how much padding its batch needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from omgrpo.losses import token_logprobs_and_entropy


@dataclass
class Sequences:
    """A batch of prompt + response token ids (rollouts of one prompt are contiguous)."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) right-padded
    response_mask: torch.Tensor  # (B, T) 1 on generated tokens, eos included

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, idx: torch.Tensor | slice) -> Sequences:
        return Sequences(
            self.prompt_ids[idx],
            self.prompt_mask[idx],
            self.response_ids[idx],
            self.response_mask[idx],
        )

    def to(self, device: torch.device) -> Sequences:
        return Sequences(
            *(
                t.to(device)
                for t in (self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask)
            )
        )


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _sample_next(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits (B, V) -> token ids (B,). temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1).squeeze(-1)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
    batch_size: int | None = None,
) -> Sequences:
    """Sample `n` responses per prompt with a KV cache; rows [i*n, (i+1)*n) belong to prompt i.

    Uses the global torch RNG (so a checkpoint's RNG state reproduces the samples).
    """
    expanded = [p for p in prompts for _ in range(n)]
    chunk = batch_size or len(expanded)
    parts = [
        _sample_chunk(
            model, expanded[i : i + chunk], max_new_tokens, temperature, top_p, eos_id, pad_id
        )
        for i in range(0, len(expanded), chunk)
    ]
    return _concat(parts, pad_id)


def _sample_chunk(model, prompts, max_new_tokens, temperature, top_p, eos_id, pad_id):
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, pad_id))
    batch = prompt_ids.shape[0]
    cache = DynamicCache()
    mask = prompt_mask
    out = model(
        input_ids=prompt_ids,
        attention_mask=mask,
        position_ids=_positions(mask),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    next_pos = mask.sum(-1, keepdim=True)  # (B, 1)
    tokens, alive = [], torch.ones(batch, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        tok = _sample_next(out.logits[:, -1, :], temperature, top_p)
        tok = torch.where(alive, tok, torch.full_like(tok, pad_id))
        tokens.append(tok)
        alive = alive & (tok != eos_id)
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], -1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        next_pos = next_pos + 1
    response = torch.stack(tokens, dim=1)
    # A token is part of the response up to and including the first eos.
    before_eos = (response == eos_id).long().cumsum(-1) - (response == eos_id).long()
    response_mask = (before_eos == 0).long()
    response = response.masked_fill(response_mask == 0, pad_id)
    return Sequences(prompt_ids.cpu(), prompt_mask.cpu(), response.cpu(), response_mask.cpu())


def _concat(parts: list[Sequences], pad_id: int) -> Sequences:
    if len(parts) == 1:
        return parts[0]
    p_width = max(s.prompt_ids.shape[1] for s in parts)
    r_width = max(s.response_ids.shape[1] for s in parts)

    def pad(t: torch.Tensor, width: int, value: int, left: bool) -> torch.Tensor:
        extra = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
        return torch.cat([extra, t] if left else [t, extra], dim=1)

    return Sequences(
        torch.cat([pad(s.prompt_ids, p_width, pad_id, True) for s in parts]),
        torch.cat([pad(s.prompt_mask, p_width, 0, True) for s in parts]),
        torch.cat([pad(s.response_ids, r_width, pad_id, False) for s in parts]),
        torch.cat([pad(s.response_mask, r_width, 0, False) for s in parts]),
    )


def response_logits(model: torch.nn.Module, seqs: Sequences) -> torch.Tensor:
    """Logits (B, T, V) predicting each response token."""
    device = next(model.parameters()).device
    seqs = seqs.to(device)
    ids = torch.cat([seqs.prompt_ids, seqs.response_ids], dim=1)
    mask = torch.cat([seqs.prompt_mask, seqs.response_mask], dim=1)
    t = seqs.response_ids.shape[1]
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=_positions(mask), logits_to_keep=t + 1
    ).logits
    return logits[:, :-1, :]


def score(
    model: torch.nn.Module,
    seqs: Sequences,
    micro_batch_size: int | None = None,
    with_stats: bool = False,
) -> dict[str, torch.Tensor]:
    """Log-probs (B, T) of the response tokens without grad; with `with_stats` also the token
    entropy (B, T) and Intuitor's per-token self-certainty KL(U || pi) (B, T)."""
    out: dict[str, list[torch.Tensor]] = {"logprobs": []}
    if with_stats:
        out.update(entropy=[], self_certainty=[])
    step = micro_batch_size or len(seqs)
    with torch.no_grad():
        for i in range(0, len(seqs), step):
            part = seqs.select(slice(i, i + step))
            logits = response_logits(model, part).float()
            tokens = part.response_ids.to(logits.device)
            logprobs, entropy = token_logprobs_and_entropy(logits, tokens)
            out["logprobs"].append(logprobs.cpu())
            if with_stats:
                out["entropy"].append(entropy.cpu())
                # KL(U || p) = -log V - mean_j log p_j
                mean_logp = torch.log_softmax(logits, -1).mean(-1)
                out["self_certainty"].append((-mean_logp - math.log(logits.shape[-1])).cpu())
    return {k: torch.cat(v) for k, v in out.items()}
