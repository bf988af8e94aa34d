"""The generation engine shared by the rollout sampler, the scorer and CAR's pair answers.

Prefill (`prefix_tree_forward`): rows are grouped along a tree of shared prefixes (e.g. system
prompt -> question -> rows), every prefix is computed once and its KV cache reused by the rows
below it; identical rows are computed once.

Decode (`decode`): one token per row per step on top of the prefill, a stop rule per row, and the
batch ends once every row has stopped. Two interchangeable backends:

- `_LeanKV`, for Llama-family decoders (Llama, Qwen2, Qwen3): the model's own modules, a KV cache
  for the new tokens grown as they come, and attention split into the shared prefix (kept once per
  prefix node and read by all of its rows, never copied per row) and each row's own new tokens.
  It skips the per-call work of an HF forward (mask building, cache concatenation, repeating KV
  heads), which is most of a decode step for a small model.
- `_HFKV`, for any causal LM: the HF forward on a `DynamicCache` (the reference the fast path is
  tested against).

Score (`shared_prompt_logits`): the logits of given responses (reference pass, update), for
Llama-family models: each distinct prompt is prefilled once, then all responses run on the
model's own modules (`lean_forward`, the blocks `_LeanKV` decodes with), each row attending to its
prompt's keys/values and its own tokens in one fused SDPA call. Gradients flow to the prompts.
Not under HF gradient checkpointing in train mode, which drops the prompt's cache and never
wraps these direct module calls: the update then runs the plain HF forward
(`omgrpo.generation.rollout.hf_checkpointing`).

Sampling draws one uniform per row and new token from the caller's `row_uniforms`, never from
a batch-wide RNG: a row's tokens do not depend on which rows are decoded beside it, so callers
may split rows into chunks of any size (`omgrpo.generation.budget`) and get the same rows.

Layout: a prefill is left-padded per tree level, so the cache holds padding that an attention
mask (1 = real token) hides; position ids count real tokens only, so padding never changes a
row's result.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from omgrpo.generation.budget import LEAN_MODEL_TYPES  # the decoder families `_LeanKV` runs

GROW_FROM = 256  # new tokens the lean decoder's cache holds at first; it doubles when full


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, max len), rows aligned to the right."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, max len), rows aligned to the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def common_prefix_len(rows: list[list[int]]) -> int:
    # the lexicographically smallest and largest rows share exactly the common prefix of all
    # rows (min / max compare lists in C; one Python scan of two rows remains)
    lo, hi = min(rows), max(rows)
    for i, (a, b) in enumerate(zip(lo, hi)):
        if a != b:
            return i
    return len(lo)


# ----------------------------------------------------------------------------------------
# Stop rule and sampling
# ----------------------------------------------------------------------------------------
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


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """logits (B, V) -> token ids (B,), row b drawn with `uniforms[b]` in [0, 1) (default: the
    global torch RNG). temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return sample_categorical(probs, uniforms)


def sample_categorical(probs: torch.Tensor, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of (B, V) non-negative weights -> (B,), by inverting each row's CDF
    with one uniform per row (`uniforms` (B,) in [0, 1), default: the global torch RNG).
    (`torch.multinomial` draws B x V exponentials, which on the CPU cost ~4 ms per toy decode
    step at 512 x 390, a quarter of generation.) A token of weight 0 is never drawn."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all() and (total > 0).all()):
        raise ValueError("sampling weights must be finite, non-negative and not all zero")
    if uniforms is None:
        uniforms = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device)
    u = uniforms.to(cdf.dtype).view(total.shape) * total
    # the first position whose cumulative weight exceeds u (u < total, so one exists up to
    # round-off; at u == total the last token of positive weight)
    index = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(index, last_positive)


def row_uniforms(seed: int, rows: int, width: int) -> torch.Tensor:
    """(rows, width) uniforms in [0, 1) on the CPU: row r's draws for its `width` new tokens.
    One generator filled row-major, so row r's draws depend on the seed, r and `width` only,
    never on how the rows are chunked."""
    return torch.rand((rows, width), generator=torch.Generator().manual_seed(seed))


def stream_seed(*keys: object) -> int:
    """A 63-bit seed named by `keys`, e.g. (seed, "rollout", step): distinct names give
    unrelated streams (`random.Random` hashes a string seed with SHA-512)."""
    return random.Random("-".join(map(str, keys))).getrandbits(63)


def draw_seed() -> int:
    """A seed drawn from the global torch RNG, for callers that set none: one draw per call,
    so a saved RNG state reproduces the samples."""
    return int(torch.randint(0, 2**63 - 1, (1,)))


# ----------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------
def select_rows(cache: DynamicCache, index: torch.Tensor, batch: int) -> None:
    """Re-index the cache's batch dimension in place (broadcast without copy from batch 1)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        if batch == 1:
            layer.keys = layer.keys.expand(len(index), -1, -1, -1)
            layer.values = layer.values.expand(len(index), -1, -1, -1)
        else:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)


def prefix_tree_forward(
    model: torch.nn.Module,
    rows: list[list[int]],
    levels: Sequence[Sequence[Hashable]],
    pad_id: int,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
    logits_to_keep: int = 1,
):
    """Forward every row, computing each shared prefix once along a tree of row groupings.

    `levels[l][r]` is row r's node at level l, coarse to fine and nested (rows sharing a node at
    level l share it at every coarser level). A node's tokens are the common token prefix of its
    rows beyond its parent's (every row keeps at least one token of its own); nodes of a level
    are run as one left-padded batch on top of their parents' KV cache, then each row runs its
    own remaining tokens; identical rows (e.g. pairs of identical solutions, common once a
    group agrees) are computed once and their cache is copied. With no levels this is the plain
    left-padded forward.

    `tail` = (ids, mask), both (R, T), right-padded tokens appended after each row (responses
    to score; rows are then never merged), with `logits_to_keep` the positions whose logits are
    returned. Gradients flow through the shared prefixes.

    Returns (logits of the last `logits_to_keep` positions (R, K, V), KV cache, attention mask
    (R, W), next position id (R, 1)); the cache holds padding between levels, hidden by the mask.
    """
    device = next(model.parameters()).device
    n_rows = len(rows)
    cache, mask = DynamicCache(), torch.zeros((1, 0), dtype=torch.long, device=device)
    done = [0] * n_rows  # tokens of each row already in the cache
    parent_of = [0] * n_rows  # row -> index of its node in the current cache batch
    logits = None
    finest = list(range(n_rows)) if tail is not None else [tuple(row) for row in rows]
    all_levels = [*levels, finest]
    for depth, keys in enumerate(all_levels):
        final = depth == len(all_levels) - 1
        members, chunks, ends = _level_nodes(rows, keys, done, final)
        if not final and not any(chunks):
            continue  # nothing shared at this level: the rows stay on their parents' nodes
        parents = torch.tensor([parent_of[rs[0]] for rs in members], device=device)
        select_rows(cache, parents, mask.shape[0])
        mask = mask.index_select(0, parents)
        ids, new_mask = (t.to(device) for t in left_pad(chunks, pad_id))
        if final and tail is not None:
            ids = torch.cat([ids, tail[0].to(device)], dim=1)
            new_mask = torch.cat([new_mask, tail[1].to(device, new_mask.dtype)], dim=1)
        base = mask.sum(-1, keepdim=True)
        positions = (base + new_mask.cumsum(-1) - 1).clamp(min=0)
        mask = torch.cat([mask, new_mask], dim=1)
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep if final else 1,
        ).logits
        for node, rs in enumerate(members):
            for r in rs:
                done[r], parent_of[r] = ends[node], node
    if len(members) < n_rows:  # duplicates: one copy of the cache per row for decoding
        rows_to_nodes = torch.tensor(parent_of, device=device)
        select_rows(cache, rows_to_nodes, len(members))
        mask, logits = mask.index_select(0, rows_to_nodes), logits.index_select(0, rows_to_nodes)
    next_pos = mask.sum(-1, keepdim=True)
    return logits, cache, mask, next_pos


def _level_nodes(
    rows: list[list[int]], keys: Sequence[Hashable], done: list[int], final: bool
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """One level of `prefix_tree_forward`: its nodes (the rows of each, in order of first
    appearance), each node's new tokens (its rows' common prefix beyond what the cache holds,
    leaving every row at least one token of its own; the whole rest at the final level) and
    the token count each row reaches."""
    node_ids: dict[Hashable, int] = {}
    members: list[list[int]] = []
    for r, key in enumerate(keys):
        if key not in node_ids:
            node_ids[key] = len(members)
            members.append([])
        members[node_ids[key]].append(r)
    chunks, ends = [], []
    for rs in members:
        first, start = rows[rs[0]], done[rs[0]]
        if final:
            end = len(first)
        else:
            common = common_prefix_len([rows[r] for r in rs])
            end = max(start, min(common, min(len(rows[r]) for r in rs) - 1))
        chunks.append(first[start:end])
        ends.append(end)
    return members, chunks, ends


# ----------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------
StopRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(rows (A,), their new tokens (A,)) -> (A,) bool: which of these rows stop here (the token
is kept)."""


def decode(
    model: torch.nn.Module,
    logits: torch.Tensor,
    cache: DynamicCache,
    mask: torch.Tensor,
    next_pos: torch.Tensor,
    *,
    group: int = 1,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop: StopRule,
    pad_id: int,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `max_new_tokens` per row on top of a prefill (`prefix_tree_forward`'s last
    logits (U, V), cache, mask, next positions), `group` rows per prefilled row (rows
    [u*group, (u+1)*group) continue prefilled row u). A row ends with the token its `stop` rule
    flags; the loop ends once every row has ended. Row b's token t is drawn with
    `uniforms[b, t]` ((B, max_new_tokens), `row_uniforms`; needed when temperature > 0).

    Returns (tokens (B, T), lengths (B,)): row b's tokens are tokens[b, :lengths[b]], its stop
    token included; the rest is `pad_id`. Rows that never stop have length `max_new_tokens`.
    """
    device = logits.device
    batch = logits.shape[0] * group
    if temperature > 0 and uniforms is None:
        raise ValueError("decode: sampling at temperature > 0 needs the rows' uniforms")
    if uniforms is not None:
        uniforms = uniforms.to(device)
    if group > 1:
        logits = logits.repeat_interleave(group, dim=0)
    backend = _LeanKV if lean_decoding_supported(model) else _HFKV
    kv = backend(model, cache, mask, next_pos, group, max_new_tokens)
    out = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # row at each batch position
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        draws = uniforms[rows, step] if uniforms is not None else None
        tok = sample_next_token(logits, temperature, top_p, draws)
        tok = tok.masked_fill(~alive, pad_id)
        out[rows, step] = tok
        open_pos = alive.nonzero().squeeze(1)
        ended = open_pos[stop(rows[open_pos], tok[open_pos])]
        lengths[rows[ended]] = step + 1
        alive[ended] = False
        if not bool(alive.any()) or step == max_new_tokens - 1:
            break
        # Drop ended rows once an eighth of the batch can go (rows that share one prefix copy
        # go together, once all of them have ended: a prompt's rows end at similar lengths)
        keep = kv.rows_to_keep(alive)
        if len(keep) <= 0.875 * len(rows):
            kv.keep(keep)
            rows, tok, alive = rows[keep], tok[keep], alive[keep]
        logits = kv.step(tok)
    return out[:, : int(lengths.max())], lengths


def lean_decoding_supported(model: torch.nn.Module) -> bool:
    """Whether `_LeanKV` implements this model (Llama-family decoder, no sliding window)."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    return (
        getattr(config, "model_type", None) in LEAN_MODEL_TYPES
        and not getattr(config, "use_sliding_window", False)
        and hasattr(inner, "layers")
        and hasattr(inner, "rotary_emb")
        and hasattr(model, "lm_head")
    )


class _HFKV:
    """Any causal LM: the HF forward on a `DynamicCache` with one cache row per decoded row."""

    def __init__(self, model, cache, mask, next_pos, group: int, max_new_tokens: int):
        if group > 1:
            index = torch.arange(mask.shape[0], device=mask.device).repeat_interleave(group)
            select_rows(cache, index, mask.shape[0])
            mask, next_pos = mask[index], next_pos[index]
        self.model, self.cache, self.mask, self.pos = model, cache, mask, next_pos

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        ones = torch.ones((len(tokens), 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=-1)
        logits = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=self.pos,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        self.pos = self.pos + 1
        return logits

    def rows_to_keep(self, alive: torch.Tensor) -> torch.Tensor:
        return alive.nonzero().squeeze(1)

    def keep(self, index: torch.Tensor) -> None:
        select_rows(self.cache, index, self.mask.shape[0])
        self.mask, self.pos = self.mask[index], self.pos[index]


class _LeanKV:
    """Llama-family decoding with the model's own modules: the prefill's cache is the shared
    prefix (one copy per prefilled row, read by its `group` rows through a batched matmul),
    new tokens go to a cache per row, and attention is one softmax over both.

    The new tokens' cache starts at `GROW_FROM` tokens and doubles when full (up to
    `max_new_tokens`): most rows end long before the longest, so the cache is sized by the
    responses, not preallocated at full length. Growing and dropping rows replace one layer's
    K or V at a time, so at most one layer's old copy is alive beside the cache."""

    def __init__(self, model, cache, mask, next_pos, group: int, max_new_tokens: int):
        self.model = model
        self.prefix_k, self.prefix_v = cache_tensors(cache)
        for layer in cache.layers:  # decode consumes the prefill: the tensors are ours now
            layer.keys = layer.values = None
        nodes, kv_heads, _, head_dim = self.prefix_k[0].shape
        dtype, device = self.prefix_k[0].dtype, self.prefix_k[0].device
        self.bias = padding_bias(mask, dtype)
        self.group, self.t, self.max_new_tokens = group, 0, max_new_tokens
        self.pos = next_pos.repeat_interleave(group, dim=0)
        shape = (nodes * group, kv_heads, min(GROW_FROM, max_new_tokens), head_dim)
        n_layers = len(model.model.layers)
        self.new_k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.new_v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = lean_forward(self.model, tokens[:, None], self.pos, self._attend)
        self.t += 1
        self.pos = self.pos + 1
        return self.model.lm_head(hidden)[:, -1, :]

    def _attend(self, i: int, q, k, v, scaling: float) -> torch.Tensor:
        """q (B, H, 1, D), k / v (B, kv heads, 1, D) of the new token -> (B, 1, H * D)."""
        if self.t == self.new_k[i].shape[2]:
            self._grow(i)
        self.new_k[i][:, :, self.t] = k[:, :, 0]
        self.new_v[i][:, :, self.t] = v[:, :, 0]
        t = self.t + 1
        own = (self.new_k[i][:, :, :t], self.new_v[i][:, :, :t], None)
        prefix = (self.prefix_k[i], self.prefix_v[i], self.bias)
        return prefix_attention(q, prefix, own, self.group, scaling)

    def _grow(self, i: int) -> None:
        """Double layer i's cache of new tokens (at most `max_new_tokens`), keeping its tokens."""
        for cache in (self.new_k, self.new_v):
            old = cache[i]
            width = min(2 * old.shape[2], self.max_new_tokens)
            cache[i] = old.new_empty((*old.shape[:2], width, old.shape[3]))
            cache[i][:, :, : self.t] = old[:, :, : self.t]
            del old

    def rows_to_keep(self, alive: torch.Tensor) -> torch.Tensor:
        """Batch positions of the prefix nodes with a row still alive (all of their rows)."""
        nodes_alive = alive.view(-1, self.group).any(1)
        return nodes_alive.repeat_interleave(self.group).nonzero().squeeze(1)

    def keep(self, index: torch.Tensor) -> None:
        """Keep the rows at `index`: whole prefix nodes (`rows_to_keep`)."""
        nodes = index[:: self.group] // self.group
        # one layer at a time: the old copy of a layer is freed before the next is copied
        for cache, rows in ((self.prefix_k, nodes), (self.prefix_v, nodes)):
            for i in range(len(cache)):
                cache[i] = cache[i].index_select(0, rows)
        for cache in (self.new_k, self.new_v):
            for i in range(len(cache)):
                cache[i] = cache[i].index_select(0, index)
        self.bias = self.bias[nodes]
        self.pos = self.pos[index]


# ----------------------------------------------------------------------------------------
# Llama-family blocks and prefix-shared attention (decoding and scoring)
# ----------------------------------------------------------------------------------------
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(layer, q (B, H, T, D), k / v (B, kv heads, T, D) after rotary, scaling) -> (B, T, H * D)."""


def lean_forward(
    model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """ids (B, T), positions (B, T) -> final-norm hidden states (B, T, hidden): the model's own
    modules in HF's order, with attention delegated to `attend` (which owns the KV cache)."""
    inner = model.model
    x = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(x, positions)
    batch, width = ids.shape
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (batch, width, -1, attn.head_dim)
        q = attn.q_proj(h).view(shape)
        k = attn.k_proj(h).view(shape)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        x = x + attn.o_proj(attend(i, q, k, v, attn.scaling))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return inner.norm(x)


def prefix_attention(q, prefix, own, group: int, scaling: float) -> torch.Tensor:
    """Attention of rows over a prefix they share plus their own keys, with one softmax.

    q (B, H, T, D); `prefix` = (k, v (N, kv heads, W, D), additive bias (N, W)) with B = N *
    `group`: rows [n*group, (n+1)*group) read prefix n, through one batched matmul per node
    (the prefix is never copied per row); `own` = (k, v (B, kv heads, S, D), additive bias
    (T, S) or None). Query head h reads KV head h // (H / kv heads), HF's `repeat_kv` order.
    Returns (B, T, H * D).
    """
    (pk, pv, pbias), (ok, ov, obias) = prefix, own
    batch, heads, t, dim = q.shape
    nodes, kv_heads, width, _ = pk.shape
    n, g = group, heads // kv_heads
    rows_q = (q * scaling).reshape(batch, kv_heads, g * t, dim)  # scaled here: q is small
    node_q = rows_q.view(nodes, n, kv_heads, g * t, dim).transpose(1, 2)
    scores_p = torch.matmul(node_q.reshape(nodes, kv_heads, n * g * t, dim), pk.transpose(2, 3))
    scores_p = scores_p + pbias[:, None, None, :]
    scores_p = scores_p.view(nodes, kv_heads, n, g * t, width).transpose(1, 2)
    scores_own = torch.matmul(rows_q, ok.transpose(2, 3))  # (B, kv heads, g*T, S)
    if obias is not None:
        scores_own = (scores_own.view(batch, kv_heads, g, t, -1) + obias).view_as(scores_own)
    scores = torch.cat([scores_p.reshape(batch, kv_heads, g * t, width), scores_own], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs_p, probs_own = probs.split([width, ok.shape[2]], dim=-1)
    probs_p = probs_p.reshape(nodes, n, kv_heads, g * t, width).transpose(1, 2)
    out_p = torch.matmul(probs_p.reshape(nodes, kv_heads, n * g * t, width), pv)
    out_p = out_p.view(nodes, kv_heads, n, g * t, dim).transpose(1, 2)
    out = out_p.reshape(batch, kv_heads, g * t, dim) + torch.matmul(probs_own, ov)
    return out.reshape(batch, heads, t, dim).transpose(1, 2).reshape(batch, t, heads * dim)


def cache_tensors(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer keys and values (N, kv heads, W, D) of a prefill's cache."""
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def padding_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias (N, W) hiding padding (mask 0), as HF's eager attention."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(mask == 0, torch.finfo(dtype).min)


# ----------------------------------------------------------------------------------------
# Scoring: prompts once per group, responses on top
# ----------------------------------------------------------------------------------------
def shared_prompt_logits(
    model: torch.nn.Module,
    prompts: list[list[int]],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    pad_id: int,
    chunks: int = 4,
    max_chunk_rows: int = 64,
) -> torch.Tensor:
    """Logits (R, T, V) predicting each response token of `response_ids` (R, T) (right-padded,
    `response_mask` 1 on real tokens) after its row's prompt, for a Llama-family model
    (`lean_decoding_supported`), with grad if enabled. Logits at padding are meaningless.

    Each distinct prompt is run once (the prompts' common prefix, e.g. the system turn, once
    for all: `prefix_tree_forward`), then the responses run on the model's own modules, each
    row attending to its prompt's keys/values and its own tokens in one fused SDPA call.
    Gradients of a prompt accumulate over its rows. Responses run in batches of similar length
    (`chunks`, more where a batch would exceed `max_chunk_rows`), each cut to its longest
    response, so short responses do not pay for the longest one's padding (4 chunks of a 64 x 8
    toy batch padded it by 15 %, 8 by 8 %). (On the CPU, reading the prompt's keys/values in place as
    `prefix_attention` does for decoding measured slower here than a per-row copy and the fused
    kernel: with whole responses the attention, not the copy, is the cost.)
    """
    device = response_ids.device
    node_of: dict[tuple[int, ...], int] = {}
    row_node = [node_of.setdefault(tuple(p), len(node_of)) for p in prompts]
    last, cache, mask, next_pos = prefix_tree_forward(
        model, [list(p) for p in node_of], [[0] * len(node_of)], pad_id
    )
    rows = torch.tensor(row_node, device=device)
    prefix = (*cache_tensors(cache), padding_bias(mask, last.dtype), next_pos)
    # tokens 0 .. length-2 predict tokens 1 .. length-1; the last one predicts nothing
    inputs = response_mask.sum(-1).to(device) - 1
    order = torch.argsort(inputs, descending=True, stable=True)
    # the prompt's last position predicts token 0 of every row
    slots, parts = [(torch.arange(len(prompts), device=device), 0, 1)], [last[rows, -1:]]
    n_chunks = max(chunks, -(-len(order) // max_chunk_rows))
    for index in order.tensor_split(min(n_chunks, len(order))):
        width = int(inputs[index].max().clamp(min=0))
        if width > 0:
            slots.append((index, 1, 1 + width))
            parts.append(_response_logits(model, response_ids[index, :width], rows[index], prefix))
    return _Place.apply((len(prompts), response_ids.shape[1], last.shape[-1]), slots, *parts)


class _Place(torch.autograd.Function):
    """Pieces of logits placed into one zero (R, T, V) tensor, `slots` = (rows, first, end
    position) per piece; the gradient of a piece is its slot of the output's gradient.

    Padding, joining and reordering the chunks as tensors of their own held 4 copies of the
    logits at once (5 in `response_logprobs`: `omgrpo bench memory`); writing them in place
    into one output under autograd cloned the output's whole gradient per write (2 more
    copies in the update). This holds the pieces and the output, and in backward the output's
    gradient and the pieces' (2 copies each)."""

    @staticmethod
    def forward(ctx, shape, slots, *parts):
        out = parts[0].new_zeros(shape)
        for (index, lo, hi), part in zip(slots, parts):
            out[index, lo:hi] = part
        ctx.slots = slots
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None, *(grad[index, lo:hi] for index, lo, hi in ctx.slots)


def _response_logits(model, ids: torch.Tensor, rows: torch.Tensor, prefix) -> torch.Tensor:
    """Logits (N, W, V) after response tokens `ids` (N, W) on top of prompt nodes `rows` (N,)
    of `prefix` = (per-layer keys, values (P, kv heads, L, D), padding bias (P, L), next
    position (P, 1))."""
    keys, values, prompt_bias, next_pos = prefix
    n_rows, width = ids.shape  # width > 0 (shared_prompt_logits skips empty chunks)
    device = ids.device
    positions = next_pos[rows] + torch.arange(width, device=device)
    causal = torch.full((width, width), torch.finfo(prompt_bias.dtype).min, device=device)
    bias = torch.cat(
        [prompt_bias[rows, None, :].expand(-1, width, -1), causal.triu(1).expand(n_rows, -1, -1)],
        dim=-1,
    )[:, None]

    def attend(i: int, q, k, v, scaling: float) -> torch.Tensor:
        k = torch.cat([keys[i].index_select(0, rows), k], dim=2)
        v = torch.cat([values[i].index_select(0, rows), v], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(n_rows, width, -1)

    return model.lm_head(lean_forward(model, ids, positions, attend))
