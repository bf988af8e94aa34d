"""How many rows one generation chunk may hold: the engine's memory in closed form, and the
largest chunk that fits a budget (`chunk_rows`). The planner (`omgrpo.models.memory`, `omgrpo
plan`) and the samplers (`rollout.sample`, CAR's pair answers) both size chunks here, so the
plan says what the run does.

A chunk is whole prompts with all `group` of their rows, or, when not even one prompt's rows
fit, part of one prompt's rows (`row_chunks`). Memory of a chunk of `prompts` prompts and
`rows` rows (b bytes per element, p the longest prompt, T new tokens, module docstring of
`omgrpo.models.memory` for the symbols):

- K/V cache: layers x 2 x K/V heads x head dim x b bytes per token (`kv_cache_bytes`); the lean
  decoder holds each prompt once and allocates each row's own cache at T tokens when the chunk
  starts (static shapes, for CUDA graphs), the HF cache (and CAR, whose pair prompts are
  copied per row) holds the prompt per row. Dropping finished rows copies one layer's K or V
  while the old one is alive (1 / (2 · layers) of the cache).
- the prefill's working set of one layer over the prompt tokens (`layer_work_bytes`);
- the lean decoder's copy of every block's q/k/v weights, in the order it reads them
  (`omgrpo.generation.fused`; none with LoRA, whose layers run unfused: `ModelShape.fused`);
- sampling over rows x vocab: b + 12 bytes per element (fp32 probabilities, cumulative sums),
  b + 32 with top-p < 1 (sort values, int64 order); the rows' uniform draws, 4 bytes per row
  and new token.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from omgrpo.generation.fused import decoder_fusable, qkv_copy_bytes

# Decoder families `engine._LeanKV` implements: pre-norm blocks, rotary attention with grouped
# KV heads (optional per-head q/k norms, as Qwen3), gated MLP, no sliding window or logit
# soft-capping.
LEAN_MODEL_TYPES = {"llama", "qwen2", "qwen3"}
HEADROOM = 0.9  # share of device memory a stage may plan to use


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its exact parameter count and its shapes."""

    name: str
    model_type: str
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    lean: bool  # generated and scored by the engine's Llama-family path
    fused: bool = True  # ... with fused projections (no adapter layers: generation/fused.py)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K/V bytes per token of one row: layers × 2 × kv_heads × head_dim × bytes."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_config(cls, config, params: int, name: str | None = None) -> ModelShape:
        """The shape of a transformers `config` (a `PretrainedConfig`) with `params` parameters."""
        heads = config.num_attention_heads
        return cls(
            name=name or (getattr(config, "architectures", None) or [config.model_type])[0],
            model_type=config.model_type,
            params=params,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            lean=config.model_type in LEAN_MODEL_TYPES
            and not getattr(config, "use_sliding_window", False),
        )


def model_shape_of(model: torch.nn.Module) -> ModelShape | None:
    """The shape of a loaded causal LM, None when its config lacks a decoder's fields."""
    try:
        params = sum(p.numel() for p in model.parameters())
        shape = ModelShape.from_config(model.config, params, type(model).__name__)
    except (AttributeError, TypeError):
        return None
    return dataclasses.replace(shape, fused=decoder_fusable(model))


# ----------------------------------------------------------------------------------------
# Bytes
# ----------------------------------------------------------------------------------------
def kv_cache_bytes(shape: ModelShape, dtype_bytes: int, tokens: int) -> int:
    """Closed form: layers × 2 × kv_heads × head_dim × bytes × tokens."""
    return shape.kv_bytes_per_token(dtype_bytes) * tokens


def layer_work_bytes(shape: ModelShape, b: int) -> int:
    """One layer's working set per token without grad (input, norm in fp32, q/k/v, MLP)."""
    h, qd, kvd = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return b * (2 * h + 2 * qd + 2 * kvd + 3 * shape.intermediate) + 8 * h


def sampling_bytes(shape: ModelShape, b: int, rows: int, top_p: float) -> int:
    return rows * shape.vocab * (b + (32 if top_p < 1.0 else 12))


def kv_tokens(
    shape: ModelShape, prompts: int, rows: int, prompt_len: int, new_tokens: int, per_row: bool
) -> int:
    """Tokens in the K/V cache of a chunk: each prompt once (lean decoder) or once per row
    (HF cache, or `per_row` prompts as CAR's), plus `new_tokens` per row."""
    prompt_rows = rows if per_row or not shape.lean else prompts
    return prompt_rows * prompt_len + rows * new_tokens


def generation_bytes(
    shape: ModelShape,
    dtype_bytes: int,
    *,
    prompts: int,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    top_p: float,
    per_row: bool = False,
) -> int:
    """Peak transient bytes of generating one chunk (module docstring)."""
    b = dtype_bytes
    kv = kv_cache_bytes(shape, b, kv_tokens(shape, prompts, rows, prompt_len, new_tokens, per_row))
    copy = kv // (2 * shape.layers)  # one layer's K or V copied (finished rows dropped)
    prefill = (rows if per_row else prompts) * prompt_len * layer_work_bytes(shape, b)
    draws = rows * new_tokens * 4
    fused = 0
    if shape.lean and shape.fused:
        dims = (shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.hidden)
        fused = qkv_copy_bytes(*dims, b)
    return kv + copy + prefill + sampling_bytes(shape, b, rows, top_p) + draws + fused


# ----------------------------------------------------------------------------------------
# Chunks
# ----------------------------------------------------------------------------------------
def _chunk(size: int, group: int) -> tuple[int, int]:
    """(prompts, rows) of a chunk of at most `size` rows: whole groups, else part of one."""
    return (1, size) if size < group else (size // group, size // group * group)


def chunk_rows(
    shape: ModelShape | None,
    dtype_bytes: int,
    *,
    rows: int,
    group: int,
    prompt_len: int,
    new_tokens: int,
    top_p: float,
    per_row: bool = False,
    max_rows: int | None = None,
    max_batch_tokens: int | None = None,
    budget_bytes: int | None = None,
) -> int:
    """Rows per generation chunk: the most of `rows` (a multiple of `group` when at least one
    group fits) with at most `max_rows` rows, at most `max_batch_tokens` K/V tokens
    (`kv_tokens`) and at most `budget_bytes` of `generation_bytes`. At least 1 (a single row
    that exceeds a bound is still generated: the plan reports it). Without a shape only
    `max_rows` applies."""
    hi = min(rows, max_rows or rows)
    if shape is None or (max_batch_tokens is None and budget_bytes is None):
        return _chunk(max(1, hi), group)[1]

    def fits(size: int) -> bool:
        prompts, n = _chunk(size, group)
        tokens = kv_tokens(shape, prompts, n, prompt_len, new_tokens, per_row)
        if max_batch_tokens is not None and tokens > max_batch_tokens:
            return False
        need = generation_bytes(
            shape,
            dtype_bytes,
            prompts=prompts,
            rows=n,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            top_p=top_p,
            per_row=per_row,
        )
        return budget_bytes is None or need <= budget_bytes

    return _chunk(max(1, largest(fits, hi)), group)[1]


def largest(fits, hi: int) -> int:
    """The largest k in [1, hi] with fits(k) (monotone), 0 when none."""
    lo, best = 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def row_chunks(prompts: int, group: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of `prompts` x `group` rows (rows [i*group, (i+1)*group) belong to
    prompt i) in chunks of at most `chunk` rows: whole prompts when `chunk` >= `group`, else
    pieces of one prompt's rows. Every chunk decodes rows of its prompts `group`-wise."""
    total = prompts * group
    if chunk >= group:
        step = chunk // group * group
        return [(lo, min(lo + step, total)) for lo in range(0, total, step)]
    return [
        (p * group + lo, p * group + min(lo + chunk, group))
        for p in range(prompts)
        for lo in range(0, group, chunk)
    ]


def free_memory_bytes(device: torch.device) -> int | None:
    """What a generation chunk may use now on `device`: on CUDA the smaller of `HEADROOM` of
    the card less what tensors hold and what the driver reports free (plus what torch's
    allocator holds unused); on the CPU `HEADROOM` of the available RAM; None elsewhere."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - allocated
        return max(0, min(int(HEADROOM * total) - allocated, free + cached))
    if device.type == "cpu":
        return int(HEADROOM * _available_ram())
    return None


def _available_ram() -> int:
    """MemAvailable (free plus reclaimable page cache), or free pages without /proc."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def model_chunk_rows(
    model: torch.nn.Module,
    *,
    rows: int,
    group: int,
    prompt_len: int,
    new_tokens: int,
    top_p: float,
    per_row: bool = False,
    max_rows: int | None = None,
    max_batch_tokens: int | None = None,
) -> int:
    """`chunk_rows` for a loaded model on its device: `max_batch_tokens` when given, else the
    device's free memory now (`free_memory_bytes`)."""
    param = next(model.parameters(), None)
    shape = model_shape_of(model) if param is not None else None
    budget = None
    if shape is not None and max_batch_tokens is None:
        budget = free_memory_bytes(param.device)
    return chunk_rows(
        shape,
        param.dtype.itemsize if param is not None else 4,
        rows=rows,
        group=group,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        top_p=top_p,
        per_row=per_row,
        max_rows=max_rows,
        max_batch_tokens=max_batch_tokens,
        budget_bytes=budget,
    )
