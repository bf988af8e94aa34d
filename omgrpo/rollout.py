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


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def sample_next_token(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
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
    eos_id: int | list[int],
    pad_id: int,
    batch_size: int | None = None,
) -> Sequences:
    """Sample `n` responses per prompt with a KV cache; rows [i*n, (i+1)*n) belong to prompt i.

    `eos_id` may list several stop tokens (chat models end turns with e.g. `<|im_end|>` while
    their tokenizer's eos is `<|endoftext|>`). Uses the global torch RNG, so a checkpoint's
    RNG state reproduces the samples.
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
    stops = torch.tensor(eos_id if isinstance(eos_id, list) else [eos_id], device=device)
    batch = len(prompts)
    logits, cache, mask, next_pos = shared_prefix_forward(model, prompts, pad_id, use_cache=True)
    logits = logits[:, -1, :]
    tokens, alive = [], torch.ones(batch, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        tok = sample_next_token(logits, temperature, top_p)
        tok = torch.where(alive, tok, torch.full_like(tok, pad_id))
        tokens.append(tok)
        alive = alive & ~torch.isin(tok, stops)
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], -1)
        logits = decode_step(model, tok, mask, next_pos, cache)
        next_pos = next_pos + 1
    response = torch.stack(tokens, dim=1)
    # A token is part of the response up to and including the first eos.
    is_stop = torch.isin(response, stops.cpu() if response.device.type == "cpu" else stops).long()
    before_eos = is_stop.cumsum(-1) - is_stop
    response_mask = (before_eos == 0).long()
    response = response.masked_fill(response_mask == 0, pad_id)
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    return Sequences(prompt_ids, prompt_mask, response.cpu(), response_mask.cpu())


def decode_step(model: torch.nn.Module, tokens, mask, positions, cache) -> torch.Tensor:
    """Next-token logits (B, V) after feeding one new token per row on top of a KV cache
    (`mask` already includes the new position)."""
    return model(
        input_ids=tokens[:, None],
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1, :]


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


def response_logits(
    model: torch.nn.Module, seqs: Sequences, share_prefix: bool = True, pad_id: int = 0
) -> torch.Tensor:
    """Logits (B, T, V) predicting each response token (with grad if enabled).

    With `share_prefix` the prompts' common prefix (the system prompt of the chat template) is
    run once and its KV cache broadcast to every row, which halves the toy world's compute; the
    result equals the plain forward up to float round-off (tested).
    """
    device = next(model.parameters()).device
    t = seqs.response_ids.shape[1]
    if share_prefix:
        prompts = [row[m.bool()].tolist() for row, m in zip(seqs.prompt_ids, seqs.prompt_mask)]
        logits, *_ = shared_prefix_forward(
            model,
            prompts,
            pad_id,
            tail_ids=seqs.response_ids.to(device),
            tail_mask=seqs.response_mask.to(device),
            logits_to_keep=t + 1,
        )
        return logits[:, :-1, :]
    seqs = seqs.to(device)
    ids = torch.cat([seqs.prompt_ids, seqs.response_ids], dim=1)
    mask = torch.cat([seqs.prompt_mask, seqs.response_mask], dim=1)
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=_positions(mask), logits_to_keep=t + 1
    ).logits
    return logits[:, :-1, :]


def common_prefix_len(rows: list[list[int]]) -> int:
    first, n = rows[0], min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != first[i] for r in rows):
            return i
    return n


def shared_prefix_forward(
    model: torch.nn.Module,
    prompts: list[list[int]],
    pad_id: int,
    tail_ids: torch.Tensor | None = None,
    tail_mask: torch.Tensor | None = None,
    logits_to_keep: int = 1,
    use_cache: bool = False,
):
    """Forward `prompt_i + tail_i` for every row, computing the rows' common prefix once.

    Layout: [shared prefix (L)] [left-padded rest of each prompt] [tail (right-padded)].
    Returns (logits of the last `logits_to_keep` positions, KV cache, attention mask (B, L+R),
    next position id (B, 1)).
    """
    device = next(model.parameters()).device
    batch = len(prompts)
    # Every row keeps at least one own token so the last prompt position is always computed.
    shared = max(0, min(common_prefix_len(prompts), min(len(p) for p in prompts) - 1))
    rest_ids, rest_mask = (x.to(device) for x in left_pad([p[shared:] for p in prompts], pad_id))
    if tail_ids is not None:
        rest_ids = torch.cat([rest_ids, tail_ids.to(device)], dim=1)
        rest_mask = torch.cat([rest_mask, tail_mask.to(device, rest_mask.dtype)], dim=1)
    cache = DynamicCache()
    if shared:
        prefix = torch.tensor([prompts[0][:shared]], device=device)
        model(
            input_ids=prefix,
            position_ids=torch.arange(shared, device=device)[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        for layer in cache.layers:  # broadcast, no copy; gradients flow back through expand
            layer.keys = layer.keys.expand(batch, -1, -1, -1)
            layer.values = layer.values.expand(batch, -1, -1, -1)
    ones = torch.ones((batch, shared), dtype=rest_mask.dtype, device=device)
    mask = torch.cat([ones, rest_mask], dim=1)
    positions = (shared + rest_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=rest_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    next_pos = shared + rest_mask.sum(-1, keepdim=True)
    return out.logits, (cache if use_cache else None), mask, next_pos


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


def stop_token_ids(tokenizer, model) -> list[int]:
    """Tokens that end a response: the tokenizer's eos, the model's generation-config eos
    ids, and the chat template's end-of-turn token when the vocabulary has one."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    for token in ("<|im_end|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)
