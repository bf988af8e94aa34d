"""The generation engine shared by the rollout sampler, the scorer and CAR's pair answers.

Prefill (`prefix_tree_forward`): rows are grouped along a tree of shared prefixes (e.g. system
prompt -> question -> rows), every prefix is computed once and its KV cache reused by the rows
below it; identical rows are computed once.

Decode (`decode`): one token per row per step on top of the prefill, a stop rule per row, and the
batch ends once every row has stopped. Two interchangeable backends:

- `_LeanKV`, for Llama-family decoders (Llama, Qwen2, Qwen3): the model's own weights, with
  q/k/v and gate/up each one product where no adapter layer is in the way
  (`omgrpo.generation.fused`), a KV cache for the new tokens allocated once at the chunk's
  length (static shapes), and attention split into the shared prefix (kept once per prefix
  node and read by all of its rows, never copied per row) and each row's own new tokens. It
  skips the per-call work of an HF forward (mask building, cache concatenation, repeating KV
  heads), which is most of a decode step for a small model: 20 kernel-launching operations
  per block of a Qwen3 shape (`omgrpo bench generate`). On CUDA each step is replayed as a CUDA graph (`_CudaGraphSteps`); the stop
  tokens, sampling and bookkeeping stay on the device, and the host reads it once every
  `CHECK_EVERY` tokens.
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

import math
import os
import random
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from omgrpo.generation.budget import LEAN_MODEL_TYPES  # the decoder families `_LeanKV` runs
from omgrpo.generation.fused import FusedBlock, fuse_decoder


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
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    uniforms: torch.Tensor | None = None,
    log_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits (B, V) -> token ids (B,), row b drawn with `uniforms[b]` in [0, `UNIFORM_TOP`]
    (default: the global torch RNG). temperature 0 is greedy. `log_mass`: as
    `sample_categorical`'s."""
    if temperature <= 0:
        return logits.argmax(-1)
    scaled = logits if temperature == 1.0 else logits.float() / temperature
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return sample_categorical(probs, uniforms, log_mass)


def sample_categorical(
    probs: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    log_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """One draw per row of (B, V) non-negative weights -> (B,), by inverting each row's CDF
    with one uniform per row (`uniforms` (B,) in [0, `UNIFORM_TOP`], e.g. `row_uniforms`
    times `UNIFORM_TOP`; default: the global torch RNG). (`torch.multinomial` draws B x V
    exponentials, which on the CPU cost ~4 ms per toy decode step at 512 x 390, a quarter of
    generation.) A token of weight 0 is never drawn.

    Weights that are not a distribution raise a ValueError; with `log_mass` (a float tensor
    (1,)) the sum of the rows' log total weights is added to it instead, on the device: it
    stays finite exactly while every row's weights were (a total of 0, inf or nan has no
    finite log), so the decode loop need not read the device per token."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    if log_mass is not None:
        log_mass += total.log().sum()
    elif not bool(total.log().isfinite().all()):
        raise ValueError("sampling weights must be finite, non-negative and not all zero")
    if uniforms is None:
        uniforms = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device) * UNIFORM_TOP
    # u < total (`UNIFORM_TOP`), so a position whose cumulative weight exceeds u exists, and
    # its token has weight > 0 (a zero weight leaves the cumulative sum where it was)
    u = uniforms.to(cdf.dtype).view(total.shape) * total
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


# The largest uniform `sample_categorical` takes: u * total then rounds to at most the float
# below total (its exact value is at most total - total * 2^-23, never above that float in
# float32 or float64), so the draw never falls off the end of the CDF.
UNIFORM_TOP = 1.0 - 2.0**-23


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
is kept). A rule run on the host (CAR's brace counter): `decode` calls it after every token."""

CHECK_EVERY = 32  # decode steps between the loop's reads of a GPU (all ended? drop rows)
# On the CPU a read waits for nothing, and dropping ended rows at once saves their compute
# (toy rows end at ~26 of 64 tokens: checking every 32 made 16 x 8 toy generation 2.7x slower)
CHECK_EVERY_CPU = 1
WIDTH_BUCKET = 256  # CUDA graphs: own-token attention width rounded up to a multiple of this


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
    stop: torch.Tensor | StopRule,
    pad_id: int,
    uniforms: torch.Tensor | None = None,
    check_every: int | None = None,
    graphs: bool | None = None,
    width_bucket: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `max_new_tokens` per row on top of a prefill (`prefix_tree_forward`'s last
    logits (U, V), cache, mask, next positions), `group` rows per prefilled row (rows
    [u*group, (u+1)*group) continue prefilled row u). Row b's token t is drawn with
    `uniforms[b, t]` ((B, max_new_tokens), `row_uniforms`; needed when temperature > 0).

    `stop` is a tensor of stop token ids, checked on the device: a row ends with the first of
    them, and the loop reads the device only every `check_every` tokens (default `CHECK_EVERY`
    on CUDA, so no decode step waits for the host; `CHECK_EVERY_CPU` on the CPU) to end the
    batch once every row has ended and to drop ended rows. Or a `StopRule` run on the host after every token. `graphs` (default:
    on CUDA, with token ids and the lean decoder) replays each decode step as a CUDA graph
    (`_CudaGraphSteps`). The lean decoder's attention width grows in steps of `width_bucket`
    tokens (default: `WIDTH_BUCKET` on CUDA, graphs or not; exact widths on the CPU).

    Returns (tokens (B, T), lengths (B,)): row b's tokens are tokens[b, :lengths[b]], its stop
    token included; the rest is `pad_id`. Rows that never stop have length `max_new_tokens`.
    """
    device = logits.device
    batch = logits.shape[0] * group
    if temperature > 0 and uniforms is None:
        raise ValueError("decode: sampling at temperature > 0 needs the rows' uniforms")
    host_rule = not isinstance(stop, torch.Tensor)
    lean = lean_decoding_supported(model)
    if graphs is None:
        enabled = os.environ.get("OMGRPO_CUDA_GRAPHS", "1") != "0"
        graphs = enabled and device.type == "cuda" and lean and not host_rule
    if group > 1:
        logits = logits.repeat_interleave(group, dim=0)
    # on CUDA bucketed widths with or without graphs, so OMGRPO_CUDA_GRAPHS=0 is a like-for-like
    # eager run (the same kernels on the same shapes)
    bucket = width_bucket or (WIDTH_BUCKET if device.type == "cuda" else None)
    kv = (_LeanKV if lean else _HFKV)(model, cache, mask, next_pos, group, max_new_tokens, bucket)
    stop_ids = None if host_rule else stop.to(device)
    rows = _Rows(batch, max_new_tokens, pad_id, device, uniforms, temperature, top_p, stop_ids)
    runner = _CudaGraphSteps(kv, rows) if graphs else None
    default_every = CHECK_EVERY if device.type == "cuda" else CHECK_EVERY_CPU
    every = 1 if host_rule else max(1, check_every or default_every)
    rows.sample(logits)  # token 0, from the prefill
    for step in range(1, max_new_tokens):
        if host_rule:
            rows.end_on_host(stop)
        if (step - 1) % every == 0:
            alive = rows.read_alive()  # the loop's one read of the device
            if not any(alive):
                break
            keep = kv.positions_to_keep(alive)
            # drop ended rows once an eighth of the batch can go (rows that share one prefix
            # copy go together, once all of them have ended: a prompt's rows end alike)
            if len(keep) <= 0.875 * len(alive):
                index = torch.tensor(keep, device=device)
                kv.keep(index)
                rows.keep(index)
                if runner is not None:
                    runner.reset()
        if runner is not None:
            runner.step()
        else:
            rows.sample(kv.step(rows.tok))
    else:
        if host_rule:
            rows.end_on_host(stop)
    return rows.result()


class _Rows:
    """The decoded rows on the device: their tokens and which are still open, with sampling and
    the stop tokens written without host reads (a step can be graph-captured). Rows are kept in
    their original order in `out`; `index` maps the batch's positions to them (rows are dropped
    from the batch, never from the result). Lengths: read off `out` at the end with stop
    tokens (`result`), kept in `lengths` by a host rule (`end_on_host`)."""

    def __init__(self, batch, width, pad_id, device, uniforms, temperature, top_p, stop_ids):
        self.out = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
        self.lengths = torch.full((batch,), width, dtype=torch.long, device=device)
        self.index = torch.arange(batch, device=device)
        self.alive = torch.ones(batch, dtype=torch.bool, device=device)
        self.tok = torch.full((batch,), pad_id, dtype=torch.long, device=device)
        self.step_t = torch.zeros(1, dtype=torch.long, device=device)  # the token drawn next
        self.log_mass = torch.zeros(1, device=device)  # finite while every draw's weights were
        # (`UNIFORM_TOP`: scaled once here rather than per draw)
        self.uniforms = None if uniforms is None else uniforms.to(device) * UNIFORM_TOP
        self.pad_id, self.temperature, self.top_p, self.stop_ids = (
            pad_id,
            temperature,
            top_p,
            stop_ids,
        )

    def sample(self, logits: torch.Tensor) -> None:
        """Draw every row's next token from `logits` (B, V) and record it. An ended row still
        draws (its draws are thrown away: `result` pads every row after its length)."""
        s = self.step_t
        draws = None if self.uniforms is None else self.uniforms[self.index, s]
        tok = sample_next_token(logits, self.temperature, self.top_p, draws, self.log_mass)
        self.out[self.index, s] = tok
        if self.stop_ids is not None:
            # a comparison per stop id: `torch.isin` sorts (and syncs) for larger id sets; the
            # lengths are read off `out` at the end (`result`)
            self.alive &= (tok[:, None] != self.stop_ids).all(-1)
        self.tok.copy_(tok)
        self.step_t += 1

    def end_on_host(self, stop: StopRule) -> None:
        """End the open rows that the host rule `stop` ends with their last token."""
        open_pos = self.alive.nonzero().squeeze(1)
        ended = open_pos[stop(self.index[open_pos], self.tok[open_pos])]
        self.lengths[self.index[ended]] = self.step_t
        self.alive[ended] = False

    def read_alive(self) -> list[bool]:
        """Which batch positions are open, read from the device in one copy; raises if any
        row's sampling weights were not a distribution since the last read."""
        flags = torch.cat([self.log_mass, self.alive]).tolist()
        if not math.isfinite(flags[0]):
            raise ValueError("sampling weights must be finite, non-negative and not all zero")
        return [bool(f) for f in flags[1:]]

    def keep(self, index: torch.Tensor) -> None:
        self.index, self.alive, self.tok = self.index[index], self.alive[index], self.tok[index]

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, lengths): each row's tokens up to its stop token (included), then pads."""
        if not bool(self.log_mass.isfinite().all()):
            raise ValueError("sampling weights must be finite, non-negative and not all zero")
        width = self.out.shape[1]
        if self.stop_ids is not None:  # a row ends at its first stop token
            stops = (self.out[..., None] == self.stop_ids).any(-1)
            self.lengths = torch.where(stops.any(-1), stops.int().argmax(-1) + 1, width)
        after = torch.arange(width, device=self.out.device) >= self.lengths[:, None]
        out = self.out.masked_fill(after, self.pad_id)
        return out[:, : int(self.lengths.max())], self.lengths


class _CudaGraphSteps:
    """Decode steps replayed as CUDA graphs: a step's hundreds of kernels cost one launch.

    A graph is captured per (rows, attention width): the width grows in buckets of
    `WIDTH_BUCKET` tokens, so a 3072-token response needs 12 graphs, captured one after
    another, each in its own memory pool (an older one is never replayed again and is dropped
    with its pool; a pool shared across graphs tripped an allocator assert in torch 2.11 once
    every graph on it had been dropped). The
    first two steps of each key run eagerly on a side stream (lazy initialisations, cuBLAS
    workspaces) before the capture; every step, eager or replayed, is a real step. Dropping
    rows changes the batch: the graphs are then dropped too."""

    WARM_UP = 2

    def __init__(self, kv: _LeanKV, rows: _Rows):
        self.kv, self.rows = kv, rows
        self.graphs: dict[tuple[int, int], Callable[[], None]] = {}
        self.warm: dict[tuple[int, int], int] = {}

    def reset(self) -> None:
        self.graphs.clear()
        self.warm.clear()

    def _body(self) -> None:
        self.rows.sample(self.kv.forward(self.rows.tok))

    def step(self) -> None:
        key = (len(self.rows.index), self.kv.width())
        replay = self.graphs.get(key)
        if replay is None and self.warm.get(key, 0) < self.WARM_UP:
            self.warm[key] = self.warm.get(key, 0) + 1
            self._warm_up(self._body)
        else:
            if replay is None:
                replay = self._capture(self._body)
                self.graphs = {key: replay}
            replay()
        self.kv.t += 1

    @staticmethod
    def _warm_up(body: Callable[[], None]) -> None:
        """Run `body` eagerly on a side stream (as torch's CUDA graph recipe warms up)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)

    @staticmethod
    def _capture(body: Callable[[], None]) -> Callable[[], None]:
        """Record `body`'s kernels (without running them) into a graph; its replay."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph.replay


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

    def __init__(self, model, cache, mask, next_pos, group: int, max_new_tokens: int, bucket=None):
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

    def positions_to_keep(self, alive: list[bool]) -> list[int]:
        return [i for i, a in enumerate(alive) if a]

    def keep(self, index: torch.Tensor) -> None:
        select_rows(self.cache, index, self.mask.shape[0])
        self.mask, self.pos = self.mask[index], self.pos[index]


class _LeanKV:
    """Llama-family decoding with the model's own weights: the prefill's cache is the shared
    prefix (one copy per prefilled row, read by its `group` rows through a batched matmul),
    new tokens go to a cache per row, and attention is one softmax over both.

    The new tokens' cache is allocated once at `max_new_tokens` (the chunk's planned length,
    `omgrpo.generation.budget`), zeroed, and written in place: its shapes never change, so a
    step can be captured as a CUDA graph. It is laid out by prefix node, (nodes, KV heads,
    `group`, tokens, head dim), as a step's queries and keys are (`decode_forward`), so the
    attention reads them and writes the new keys in place. Without
    `bucket` a step attends over exactly the tokens so far; with it, over a width rounded up to
    a multiple of `bucket` (static within a bucket), the slots not yet written hidden by an
    additive bias computed on the device. Dropping rows copies one layer's K or V at a time, so
    at most one layer's old copy is alive beside the cache.

    Projections run fused (`omgrpo.generation.fused`) where the blocks allow it, else on their
    modules (peft's LoRA layers). Rows of one prefix node share their positions, and a step's
    rotary embedding is one (D, D) matrix per node (`rotation_basis`), gathered from a table of
    the model's own cos / sin: q and k rotate in one product."""

    def __init__(self, model, cache, mask, next_pos, group: int, max_new_tokens: int, bucket=None):
        self.model = model
        keys, values = cache_tensors(cache)
        for layer in cache.layers:  # decode consumes the prefill: the tensors are ours now
            layer.keys = layer.values = None
        self.prefix_k = [x.contiguous() for x in keys]
        self.prefix_v = [x.contiguous() for x in values]
        del keys, values
        nodes, kv_heads, _, head_dim = self.prefix_k[0].shape
        dtype, device = self.prefix_k[0].dtype, self.prefix_k[0].device
        self.kv_heads = kv_heads
        self.bias = prefix_bias(mask, dtype, kv_heads)
        self.group, self.bucket, self.t = group, bucket, 0  # t: new tokens in the cache
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # t on the device
        self.slots = torch.arange(max_new_tokens, device=device)
        shape = (nodes, kv_heads, group, max_new_tokens, head_dim)
        n_layers = len(model.model.layers)
        self.new_k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.new_v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.blocks = fuse_decoder(model)
        # each node's rotary cos / sin for its new tokens' positions (its rows share them)
        positions = next_pos.view(-1, 1) + self.slots
        self.rotary = rotary_table(model, int(positions.max()) + 1, dtype, device)[positions]
        self.basis = rotation_basis(head_dim, dtype, device)
        self._width, self._own_bias = 0, None

    def width(self) -> int:
        """The own-token width the next step attends over."""
        if self.bucket is None:
            return self.t + 1
        return min(self.new_k[0].shape[3], -(-(self.t + 1) // self.bucket) * self.bucket)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.forward(tokens)
        self.t += 1
        return logits

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) after feeding `tokens` (B,): device work only (no host reads, no
        allocation that outlives the call), so it can be graph-captured; the caller counts
        the token (`t`)."""
        self._width = self.width()
        if self.bucket is not None:
            hidden = self.slots[: self._width] > self.slot
            zeros = torch.zeros(self._width, dtype=self.bias.dtype, device=self.bias.device)
            self._own_bias = zeros.masked_fill(hidden, torch.finfo(self.bias.dtype).min)
        dim = self.new_k[0].shape[-1]
        rotation = (self.rotary.index_select(1, self.slot) @ self.basis).view(-1, dim, dim)
        hidden = decode_forward(self.model, self.blocks, tokens, rotation, self._attend)
        self.slot += 1
        return self.model.lm_head(hidden)

    def _attend(self, i: int, qk, v) -> torch.Tensor:
        """`decode_forward`'s attention: the new key and values to the cache, then attention."""
        own = (self.new_k[i], self.new_v[i], self._width, self._own_bias)
        prefix = (self.prefix_k[i], self.prefix_v[i], self.bias)
        return prefix_attention(qk, v, prefix, own, self.slot)

    def positions_to_keep(self, alive: list[bool]) -> list[int]:
        """Batch positions of the prefix nodes with a row still alive (all of their rows)."""
        g = self.group
        nodes = [n for n in range(len(alive) // g) if any(alive[n * g : (n + 1) * g])]
        return [n * g + j for n in nodes for j in range(g)]

    def keep(self, index: torch.Tensor) -> None:
        """Keep the rows at `index`: whole prefix nodes (`positions_to_keep`)."""
        nodes = index[:: self.group] // self.group
        # one layer at a time: the old copy of a layer is freed before the next is copied
        for cache in (self.prefix_k, self.prefix_v, self.new_k, self.new_v):
            for i in range(len(cache)):
                cache[i] = cache[i].index_select(0, nodes)
        bias_rows = (
            nodes[:, None] * self.kv_heads + torch.arange(self.kv_heads, device=nodes.device)
        ).flatten()
        self.bias = self.bias[bias_rows]
        self.rotary = self.rotary.index_select(0, nodes)


# ----------------------------------------------------------------------------------------
# Llama-family blocks and prefix-shared attention (decoding and scoring)
# ----------------------------------------------------------------------------------------
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(layer, q (B, H, T, D), k / v (B, kv heads, T, D) after rotary, scaling) -> (B, T, H * D)."""

DecodeAttend = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer, qk (N, kv heads, n, g + 1, D): per prefix node, KV head and row, the g query heads
that read the KV head (scaled) and the key, rotated; v (N, kv heads, n, D), views allowed)
-> (B, H * D)."""


def decode_forward(
    model: torch.nn.Module,
    blocks: list[FusedBlock] | None,
    tokens: torch.Tensor,
    rotation: torch.Tensor,
    attend: DecodeAttend,
) -> torch.Tensor:
    """tokens (B,) -> final-norm hidden states (B, hidden) of one decode step: rows in N prefix
    nodes of B / N rows, node i's rows rotated by its (D, D) `rotation[i]` (`rotation_basis`:
    a node's rows share their positions); attention delegated to `attend` (which owns the KV
    cache).

    Each block lays its new queries and keys out by node and KV head in one elementwise pass
    (which also scales the queries, and with `q_norm` / `k_norm` multiplies in their
    weights), so one product rotates them all and the attention reads them in place. With
    `blocks` (`fuse_decoder`): one product for q/k/v and one for gate/up, q_norm and k_norm as
    one unweighted RMSNorm, and each residual added by the product that makes it (`addmm`).
    Without: the modules (peft's LoRA layers included), as `lean_forward` runs them."""
    inner = model.model
    x = inner.embed_tokens(tokens)
    nodes = rotation.shape[0]
    for i, layer in enumerate(inner.layers):
        attn, d = layer.self_attn, layer.self_attn.head_dim
        h = rms_norm(layer.input_layernorm, x)
        if blocks is None:
            qk, v = _module_queries_keys(attn, h, nodes)
        else:
            qk, v = _fused_queries_keys(blocks[i], h, nodes)
        qk = torch.bmm(qk.view(nodes, -1, d), rotation).view(qk.shape)
        out = attend(i, qk, v)
        if blocks is None:
            x = x + attn.o_proj(out)
            x = x + layer.mlp(rms_norm(layer.post_attention_layernorm, x))
            continue
        b = blocks[i]
        x = torch.addmm(x, out, b.o_weight.t())
        gate_up = F.linear(rms_norm(layer.post_attention_layernorm, x), b.gate_up_weight)
        gate, up = gate_up.chunk(2, -1)
        x = torch.addmm(x, layer.mlp.act_fn(gate) * up, b.down_weight.t())
    return rms_norm(inner.norm, x)


def _fused_queries_keys(b: FusedBlock, h: torch.Tensor, nodes: int):
    """`decode_forward`'s (qk before rotation, v) from one fused product."""
    batch = h.shape[0]
    qkv = F.linear(h, b.qkv_weight, b.qkv_bias)
    kv_heads, _, g1, d = b.qk_scale.shape
    qk = qkv[:, : b.qk_width].view(nodes, batch // nodes, kv_heads, g1, d)
    if b.qk_eps is not None:  # HF's order: normalise, round, then the weight
        qk = F.rms_norm(qk, (d,), None, b.qk_eps)
    laid = torch.empty((nodes, kv_heads, batch // nodes, g1, d), dtype=h.dtype, device=h.device)
    torch.mul(qk.transpose(1, 2), b.qk_scale, out=laid)  # `out`: the node layout
    v = qkv[:, b.qk_width :].view(nodes, batch // nodes, kv_heads, d).transpose(1, 2)
    return laid, v


def _module_queries_keys(attn: torch.nn.Module, h: torch.Tensor, nodes: int):
    """`decode_forward`'s (qk before rotation, v) from the attention's modules."""
    batch, d = h.shape[0], attn.head_dim
    n = batch // nodes
    q, k = attn.q_proj(h).view(batch, -1, d), attn.k_proj(h).view(batch, -1, d)
    if hasattr(attn, "q_norm"):
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    kv_heads = k.shape[1]
    g = q.shape[1] // kv_heads
    laid = torch.empty((nodes, kv_heads, n, g + 1, d), dtype=q.dtype, device=q.device)
    laid[..., :g, :] = q.view(nodes, n, kv_heads, g, d).transpose(1, 2) * attn.scaling
    laid[..., g, :] = k.view(nodes, n, kv_heads, d).transpose(1, 2)
    v = attn.v_proj(h).view(nodes, n, kv_heads, d).transpose(1, 2)
    return laid, v


def rotary_table(model: torch.nn.Module, positions: int, dtype, device) -> torch.Tensor:
    """(positions, 2 D): the model's rotary cos and sin for positions 0 .. positions - 1, made by
    its own `rotary_emb` (each position's values do not depend on the others asked with it)."""
    inner = model.model
    ids = torch.arange(positions, device=device)[None]
    probe = torch.zeros((), dtype=dtype, device=device)
    cos, sin = inner.rotary_emb(probe, ids)
    return torch.cat([cos[0], sin[0]], dim=-1)


def rotation_basis(dim: int, dtype, device) -> torch.Tensor:
    """(2 D, D * D) with [cos, sin] @ basis = `rotation_matrices(cos, sin)` flattened: every
    entry of the product is one of cos, sin, -sin or 0 times 1, exact in any dtype."""
    key = (dim, dtype, device)
    if key not in _BASIS:  # made once, outside any CUDA graph capture
        eye = torch.eye(dim, dtype=dtype, device=device)
        zero, one = eye.new_zeros(1, dim), eye.new_ones(1, dim)
        signs = rotation_matrices(zero, one)[0]  # rotate_half as a signed permutation
        cos_part = torch.diag_embed(eye)  # cos j -> entry (j, j)
        sin_part = eye[:, None, :] * signs[None]  # sin j -> column j, signed
        _BASIS[key] = torch.cat([cos_part, sin_part]).reshape(2 * dim, dim * dim)
    return _BASIS[key]


_BASIS: dict[tuple, torch.Tensor] = {}


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
        h = rms_norm(layer.input_layernorm, x)
        shape = (batch, width, -1, attn.head_dim)
        q = attn.q_proj(h).view(shape)
        k = attn.k_proj(h).view(shape)
        if hasattr(attn, "q_norm"):
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        x = x + attn.o_proj(attend(i, q, k, v, attn.scaling))
        x = x + layer.mlp(rms_norm(layer.post_attention_layernorm, x))
    return rms_norm(inner.norm, x)


def rotation_matrices(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos, sin (B, D) -> R (B, D, D) with x @ R[b] = HF's `x * cos + rotate_half(x) * sin`
    for a row vector x of row b (`rotate_half(x)` = cat(-x[D/2:], x[:D/2]))."""
    key = (cos.shape[-1], cos.dtype, cos.device)
    if key not in _ROTATE_HALF:  # made once, outside any CUDA graph capture
        dim = cos.shape[-1]
        half = torch.arange(dim // 2, device=cos.device)
        signs = torch.zeros((dim, dim), dtype=cos.dtype, device=cos.device)
        signs[half + dim // 2, half] = -1.0  # out[j] gets -x[j + D/2] sin[j] for j < D/2
        signs[half, half + dim // 2] = 1.0  # and x[j - D/2] sin[j] for j >= D/2
        _ROTATE_HALF[key] = signs
    return torch.diag_embed(cos) + _ROTATE_HALF[key] * sin[:, None, :]


_ROTATE_HALF: dict[tuple, torch.Tensor] = {}  # rotate_half as a signed permutation matrix


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm module's function as one `F.rms_norm` call: one fused kernel on CUDA
    where HF's module launches eight (upcast, square, mean, add, rsqrt, two products, cast).
    The product's rounding differs from HF's in low-precision dtypes (one rounding, not two);
    modules of another kind run as they are."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or getattr(norm, "weight", None) is None:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def prefix_attention(qk, v, prefix, own, slot: torch.Tensor) -> torch.Tensor:
    """Decoding attention of rows over a prefix they share plus their own keys, one softmax.

    `qk` (N, kv heads, n, g + 1, D): per prefix node, KV head and row, the g query heads that
    read the KV head (scaled) and then the row's new key; `v` (N, kv heads, n, D) its new
    values (views allowed), written to the own cache at `slot` first. `prefix` = (k, v (N,
    kv heads, W, D) contiguous, additive bias (N * kv heads, 1, W): `prefix_bias`); `own` =
    (k, v caches (N, kv heads, n, S_max, D), the width S attended, additive bias (S,) or None).
    Row n * i + r reads prefix i through one batched product per node and KV head (the prefix
    is never copied per row); query head h reads KV head h // g, HF's `repeat_kv` order.
    Returns (B, H * D), B = N * n. The prefix product runs over the keys' rows too (their
    scores are dropped): the queries are read in place, with no copy into a layout of their
    own. Every product writes a whole new tensor (the CPU's batched product loops over the
    batch when its output is a strided view): 9 kernels per call (10 in
    half precision, with the softmax's cast back).
    """
    (pk, pv, pbias), (ok_cache, ov_cache, own_width, obias) = prefix, own
    nodes, kv_heads, n, g1, dim = qk.shape
    g, width, batch = g1 - 1, pk.shape[2], nodes * n
    ok_cache.index_copy_(3, slot, qk[..., g:, :])
    ov_cache.index_copy_(3, slot, v.unsqueeze(3))
    pk3, pv3 = (x.view(nodes * kv_heads, width, dim) for x in (pk, pv))
    ok3, ov3 = (
        x[..., :own_width, :].view(batch * kv_heads, own_width, dim) for x in (ok_cache, ov_cache)
    )
    scores_p = torch.baddbmm(pbias, qk.view(nodes * kv_heads, n * g1, dim), pk3.transpose(1, 2))
    q_rows = qk[..., :g, :].view(batch * kv_heads, g, dim)
    if obias is None:
        scores_own = torch.bmm(q_rows, ok3.transpose(1, 2))
    else:
        scores_own = torch.baddbmm(obias, q_rows, ok3.transpose(1, 2))
    scores = torch.cat(
        [
            scores_p.view(nodes, kv_heads, n, g1, width)[..., :g, :],
            scores_own.view(nodes, kv_heads, n, g, own_width),
        ],
        dim=-1,
    )
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qk.dtype)
    probs_p = probs[..., :width].view(nodes * kv_heads, n * g, width)
    out = torch.bmm(probs_p, pv3).view(batch * kv_heads, g, dim)
    out.baddbmm_(probs[..., width:].view(batch * kv_heads, g, own_width), ov3)
    return out.view(nodes, kv_heads, n, g, dim).transpose(1, 2).reshape(batch, -1)


def prefix_bias(mask: torch.Tensor, dtype: torch.dtype, kv_heads: int) -> torch.Tensor:
    """`padding_bias` (N, W) laid out for `prefix_attention`: (N * kv_heads, 1, W)."""
    bias = padding_bias(mask, dtype)
    return bias[:, None, None, :].expand(-1, kv_heads, 1, -1).reshape(-1, 1, bias.shape[-1])


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
