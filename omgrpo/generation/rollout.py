"""What the policy does without training: sample responses, and the log-probs of given responses
(`response_logprobs`; rewards are scored in `omgrpo.core.step.score_step`).

Sequences are laid out as a left-padded prompt block (B, P) followed by a right-padded response
block (B, T), so the logits predicting response token t sit at position P - 1 + t. Position ids
are counted from the first real token (cumsum of the attention mask), identical in sampling and
in computing log-probs, so a response's log-probs do not depend on how much padding its batch
needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omgrpo.core.losses import token_logprobs_and_entropy
from omgrpo.generation.budget import model_chunk_rows, row_chunks
from omgrpo.generation.engine import (
    decode,
    draw_seed,
    lean_decoding_supported,
    left_pad,
    prefix_tree_forward,
    right_pad,
    row_uniforms,
    shared_prompt_logits,
    stop_token_ids,
)

# left_pad, right_pad and stop_token_ids live in omgrpo.generation.engine; importable from here too.
__all__ = [
    "Sequences",
    "hf_checkpointing",
    "left_pad",
    "response_logits",
    "response_logprobs",
    "right_pad",
    "sample",
    "stop_token_ids",
]


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


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


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
    max_batch_tokens: int | None = None,
    seed: int | None = None,
) -> Sequences:
    """Sample `n` responses per prompt with a KV cache; rows [i*n, (i+1)*n) belong to prompt i.

    The prompts' common prefix (the chat template's system turn) is prefilled once and each
    prompt once for its n rollouts (`omgrpo.generation.engine`). `eos_id` may list several stop
    tokens (chat models end turns with e.g. `<|im_end|>` while their tokenizer's eos is
    `<|endoftext|>`).

    Rows are generated in chunks (`omgrpo.generation.budget.row_chunks`): at most `batch_size`
    rows, and at most `max_batch_tokens` K/V tokens, or, without it, what fits the device's
    free memory now. Row r draws its tokens from row r of `row_uniforms(seed, ...)`, so the
    result does not depend on the chunks; `seed` None draws one from the global torch RNG (a
    checkpoint's RNG state then reproduces the samples).
    """
    rows = n * len(prompts)
    chunk = model_chunk_rows(
        model,
        rows=rows,
        group=n,
        prompt_len=max(map(len, prompts)),
        new_tokens=max_new_tokens,
        top_p=top_p,
        max_rows=batch_size,
        max_batch_tokens=max_batch_tokens,
    )
    uniforms = None
    if temperature > 0:
        uniforms = row_uniforms(draw_seed() if seed is None else seed, rows, max_new_tokens)
    parts = []
    for lo, hi in row_chunks(len(prompts), n, chunk):
        group = min(n, hi - lo)  # all of each prompt's rows, or a piece of one prompt's
        parts.append(
            _sample_chunk(
                model,
                prompts[lo // n : -(-hi // n)],
                group,
                max_new_tokens,
                temperature,
                top_p,
                eos_id,
                pad_id,
                None if uniforms is None else uniforms[lo:hi],
            )
        )
    return _concat(parts, pad_id)


def _sample_chunk(
    model, prompts, n, max_new_tokens, temperature, top_p, eos_id, pad_id, uniforms
) -> Sequences:
    """`n` rows of each of `prompts`, in one decode batch."""
    device = next(model.parameters()).device
    stops = torch.tensor(eos_id if isinstance(eos_id, list) else [eos_id], device=device)
    logits, cache, mask, next_pos = prefix_tree_forward(
        model, prompts, [[0] * len(prompts)], pad_id
    )
    response, lengths = decode(
        model,
        logits[:, -1, :],
        cache,
        mask,
        next_pos,
        group=n,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=stops,
        pad_id=pad_id,
        uniforms=uniforms,
    )
    # A token is part of the response up to and including the first stop token.
    response_mask = (torch.arange(response.shape[1], device=device) < lengths[:, None]).long()
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], pad_id)
    return Sequences(prompt_ids, prompt_mask, response.cpu(), response_mask.cpu())


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

    With `share_prefix` the prompts' common prefix (the chat template's system turn) is run
    once, and each distinct prompt once for all of its rollouts; for Llama-family models the
    responses then read their prompt's keys/values without copying them per row
    (`omgrpo.generation.engine.shared_prompt_logits`), for others the prompt caches are copied per row
    (`omgrpo.generation.engine.prefix_tree_forward`). Both equal the plain forward up to float round-off
    (tested). Under HF gradient checkpointing in train mode (`hf_checkpointing`) this is the
    plain forward, whatever `share_prefix` says.
    """
    device = next(model.parameters()).device
    t = seqs.response_ids.shape[1]
    if share_prefix and not hf_checkpointing(model):
        prompts = [row[m.bool()].tolist() for row, m in zip(seqs.prompt_ids, seqs.prompt_mask)]
        if lean_decoding_supported(model):
            seqs = seqs.to(device)
            return shared_prompt_logits(
                model, prompts, seqs.response_ids, seqs.response_mask, pad_id
            )
        logits, *_ = prefix_tree_forward(
            model,
            prompts,
            [[0] * len(prompts), [tuple(p) for p in prompts]],
            pad_id,
            tail=(seqs.response_ids, seqs.response_mask),
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


def hf_checkpointing(model: torch.nn.Module) -> bool:
    """Whether HF's layers checkpoint a forward of `model` (train mode, checkpointing on).

    They then drop any KV cache, and the lean scorer calls the blocks' modules itself, so
    neither prompt-sharing path can build on the prompt's cache. `response_logits` then runs
    the plain forward: HF's own checkpointing, exactly the reference gradient, simple; it
    recomputes each prompt per row instead of once per group, at most 512 of a row's 3584
    tokens at the paper's lengths, where checkpointing is needed. The lean path's speed
    matters for the toy CPU runs, which never checkpoint."""
    return model.training and bool(getattr(model, "is_gradient_checkpointing", False))


def response_logprobs(
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
            # a function per micro-batch: its logits are freed before the next one's exist
            part = seqs.select(slice(i, i + step))
            for key, value in _micro_logprobs(model, part, with_stats).items():
                out[key].append(value)
    return {k: torch.cat(v) for k, v in out.items()}


def _micro_logprobs(model, part: Sequences, with_stats: bool) -> dict[str, torch.Tensor]:
    """`response_logprobs` of one micro-batch, on the CPU."""
    logits = response_logits(model, part).float()
    logprobs, entropy = token_logprobs_and_entropy(logits, part.response_ids.to(logits.device))
    out = {"logprobs": logprobs.cpu()}
    if with_stats:
        out["entropy"] = entropy.cpu()
        # KL(U || p) = -log V - mean_j log p_j
        mean_logp = torch.log_softmax(logits, -1).mean(-1)
        out["self_certainty"] = (-mean_logp - math.log(logits.shape[-1])).cpu()
    return out
