"""The memory plan of the native trainer: each stage's expected peak device memory, from a
model's `config.json` alone (the model is built on the meta device: exact parameter count, no
weights) and the composed config (`omgrpo plan`, and `omgrpo train` at setup).

Every stage holds the resident state plus its own transient; a stage fits when its peak is at
most `HEADROOM` of the device (the rest: CUDA context, allocator fragmentation, what the
formulas leave out). b = bytes per element of `model.dtype` (auto: bf16 on CUDA, fp32 on CPU);
P = parameters; L layers, h hidden, H heads, Hkv K/V heads, D head dim, I intermediate, V
vocab; p = rollout.max_prompt_len and T = rollout.max_new_tokens (every prompt and response
planned at its longest: a batch is padded to its longest row).

- **resident** (steady state, from step 2 on): weights P·b, the reference model P·b when
  algorithm.kl_coef > 0, gradients P·b (left allocated by the last optimizer step until the
  next update's `zero_grad`), AdamW's two moments 2·P·b (torch keeps them in the parameters'
  dtype).
- **K/V cache**, closed form: L · 2 · Hkv · D · b bytes per token. Generation (`_LeanKV`)
  holds the prompts' cache once per prompt and preallocates T new tokens for every row:
  tokens = prompts · p + rows · T. Dropping finished rows re-indexes K, then V, while the old
  copy is alive: up to 7/16 more (`KEEP_COPY`).
- **generation** (training rollouts, validation, CAR): K/V (with `KEEP_COPY`) + the prefill's
  working set of one layer over all prompt tokens, tokens · (b·(2h + 2·H·D + 2·Hkv·D + 3I) +
  8h) (the 8h: RMSNorm's fp32 copies), + sampling over rows × V: b + 12 bytes per element
  (fp32 probabilities, cumulative sums), b + 32 with top-p < 1 (sort values, int64 order).
  Today the training step generates all prompts_per_step · rollout.n rows at once (rollout
  chunking is not implemented yet: issue 25); validation in chunks of eval.batch_size rows;
  CAR in chunks of car.chunk_pairs pairs, each row's prompt p + 2 · car.max_solution_tokens +
  `CAR_TEMPLATE_TOKENS` copied per row.
- **scoring** (old / reference log-probs, no grad), m = algorithm.micro_batch_size rows: the
  micro-batch's prompt K/V, one layer's working set of a chunk of rows, and the logits: the
  fp32 logits, their fp32 log-softmax and the entropy's fp32 exp, 12 bytes per m·T·V element
  (16 with a self-certainty / entropy reward).
- **update**, m rows with grad: activations saved for backward, per token (p + T per row) and
  layer b·(2h + 4·H·D + 3·Hkv·D + 4I) + 8h (norm inputs in fp32, q/k/v, rotary q/k,
  attention output, the gated MLP's four I-wide tensors; + 4·(H·D + Hkv·D) for Qwen3's q/k
  norms), + the prompt K/V copied per row for attention, + the final norm and lm_head input;
  with gradient checkpointing: each layer's input b·h per token plus one layer recomputed
  (for Llama / Qwen2 / Qwen3 too: the update then runs HF's checkpointed forward, each row's
  prompt with it, instead of the lean scorer: `LEAN_SCORER_CHECKPOINTS`).
  Logits: 16 bytes per m·T·V element (model-dtype logits and their gradient, fp32 log-softmax,
  its gradient and the fp32 cast). Assumes a fused attention kernel (no T × T scores).
- **optimizer step**: foreach AdamW's P·b denominator.

Checked against a measurement on the CPU only (`omgrpo bench memory`: the backbones' layers and
head layout with every width / 16, docs/memory.md); never on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from omgrpo.generation.engine import LEAN_MODEL_TYPES
from omgrpo.models.loading import resolve_dtype

GIB = 2**30
HEADROOM = 0.9  # share of device memory a stage may plan to use
KEEP_COPY = 7 / 16  # decode's row drop: K (or V) re-indexed to <= 7/8 while the old is alive
CAR_TEMPLATE_TOKENS = 64  # CAR's pair prompt around the question and the two solutions
# Whether model.gradient_checkpointing=true checkpoints the update of a Llama / Qwen2 / Qwen3
# model. The lean scorer (generation/engine.lean_forward) cannot: it calls each block's modules
# directly, on a prompt cache HF's checkpointed layers drop in train mode. So under
# checkpointing the update runs HF's checkpointed forward instead (rollout.hf_checkpointing),
# with every row's whole prompt + response: what `activation_bytes` counts when checkpointed.
LEAN_SCORER_CHECKPOINTS = True
KNOBS = (
    "rollout.n",
    "trainer.prompts_per_step",
    "rollout.max_new_tokens",
    "eval.batch_size",
    "algorithm.micro_batch_size",
    "model.gradient_checkpointing",
    "model.dtype",
)


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

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K/V bytes per token of one row: layers × 2 × kv_heads × head_dim × bytes."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


@functools.lru_cache(maxsize=8)
def model_shape(model_dir: str) -> ModelShape:
    """The shape of the causal LM whose `config.json` is in `model_dir` (or a hub id), its
    parameters counted on the meta device (tied embeddings once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    heads = config.num_attention_heads
    return ModelShape(
        name=(getattr(config, "architectures", None) or [type(model).__name__])[0],
        model_type=config.model_type,
        params=sum(p.numel() for p in model.parameters()),
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


@dataclass(frozen=True)
class Sizes:
    """The config's numbers that set memory (one place, so knob searches can vary them)."""

    dtype: str
    dtype_bytes: int
    prompts: int  # prompts generated per step (with coreward: prompts_per_step × 2)
    prompt_copies: int  # 2 with coreward (each prompt and its paraphrase)
    n: int
    prompt_len: int
    new_tokens: int
    top_p: float
    micro: int
    old_pass: bool
    stats: bool
    ref: bool
    checkpointing: bool
    eval_rows: int  # 0: no validation
    eval_k: int
    eval_top_p: float
    car_rows: int  # 0: CAR off
    car_pairs_per_anchor: int
    car_prompt_len: int
    car_new_tokens: int
    car_top_p: float

    @property
    def rows(self) -> int:
        return self.prompts * self.n


def sizes_from_config(cfg: Any, device_type: str) -> Sizes:
    """The memory-relevant numbers of a composed config, on a `device_type` device."""
    dtype = resolve_dtype(cfg.model.dtype, torch.device(device_type))
    r, a = cfg.rollout, cfg.algorithm
    copies = 2 if "coreward" in cfg.reward.parts else 1
    prompts = cfg.trainer.prompts_per_step * copies
    rows = prompts * r.n
    mini = a.mini_batch_size or rows
    stats = bool({"self_certainty", "entropy"} & set(cfg.reward.parts))
    per_chunk = max(1, cfg.eval.batch_size // cfg.eval.k)  # rollout.sample's whole prompts
    eval_rows = min(cfg.eval.num_prompts, per_chunk) * cfg.eval.k if cfg.eval.every > 0 else 0
    per_anchor = r.n - 1
    if cfg.car.pairs_per_anchor is not None:
        per_anchor = min(per_anchor, cfg.car.pairs_per_anchor)
    solution = cfg.car.max_solution_tokens if cfg.car.max_solution_tokens > 0 else r.max_new_tokens
    return Sizes(
        dtype=str(dtype).removeprefix("torch."),
        dtype_bytes=dtype.itemsize,
        prompts=prompts,
        prompt_copies=copies,
        n=r.n,
        prompt_len=r.max_prompt_len,
        new_tokens=r.max_new_tokens,
        top_p=r.top_p,
        micro=a.micro_batch_size or mini,
        # trainer.single_update: one PPO epoch over one mini-batch reuses the update's forward
        old_pass=stats or not (a.ppo_epochs == 1 and mini >= rows),
        stats=stats,
        ref=a.kl_coef > 0,
        checkpointing=bool(cfg.model.gradient_checkpointing),
        eval_rows=eval_rows,
        eval_k=cfg.eval.k,
        eval_top_p=cfg.eval.top_p,
        car_rows=_car_rows(rows, per_anchor, cfg.car.chunk_pairs) if cfg.car.enable else 0,
        car_pairs_per_anchor=per_anchor,
        car_prompt_len=r.max_prompt_len + 2 * solution + CAR_TEMPLATE_TOKENS,
        car_new_tokens=cfg.car.max_new_tokens,
        car_top_p=cfg.car.top_p,
    )


def _car_rows(rollouts: int, per_anchor: int, chunk_pairs: int) -> int:
    """Pair rows of CAR's largest chunk: whole anchors of `per_anchor` pairs, at most
    `chunk_pairs` rows unless one anchor has more (generation/car._anchor_chunks)."""
    total = rollouts * per_anchor
    if per_anchor == 0:
        return 0
    return min(total, max(per_anchor, chunk_pairs // per_anchor * per_anchor))


# ----------------------------------------------------------------------------------------
# Bytes (module docstring: the formulas)
# ----------------------------------------------------------------------------------------
def kv_cache_bytes(shape: ModelShape, dtype_bytes: int, tokens: int) -> int:
    """Closed form: layers × 2 × kv_heads × head_dim × bytes × tokens."""
    return shape.kv_bytes_per_token(dtype_bytes) * tokens


def resident_bytes(shape: ModelShape, s: Sizes) -> dict[str, int]:
    """What stays on the device through a step (from step 2 on)."""
    weights = shape.params * s.dtype_bytes
    return {
        "weights": weights,
        "reference": weights if s.ref else 0,
        "gradients": weights,
        "adamw_state": 2 * weights,
    }


def _layer_work_bytes(shape: ModelShape, b: int) -> int:
    """One layer's working set per token without grad (input, norm in fp32, q/k/v, MLP)."""
    h, qd, kvd = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return b * (2 * h + 2 * qd + 2 * kvd + 3 * shape.intermediate) + 8 * h


def _layer_saved_bytes(shape: ModelShape, b: int) -> int:
    """Activations one layer saves for backward, per token."""
    h, qd, kvd = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    saved = b * (2 * h + 4 * qd + 3 * kvd + 4 * shape.intermediate) + 8 * h
    if shape.model_type == "qwen3":  # q/k RMSNorms upcast q and k to fp32
        saved += 4 * (qd + kvd)
    return saved


def _sampling_bytes(shape: ModelShape, b: int, rows: int, top_p: float) -> int:
    return rows * shape.vocab * (b + (32 if top_p < 1.0 else 12))


def generation_kv_bytes(shape: ModelShape, s: Sizes, prompts: int, rows: int, new: int) -> int:
    """K/V of `rows` rows of `prompts` prompts decoding `new` tokens: the lean decoder keeps
    each prompt once, the HF cache once per row."""
    prompt_rows = prompts if shape.lean else rows
    return kv_cache_bytes(shape, s.dtype_bytes, prompt_rows * s.prompt_len + rows * new)


def _generation_bytes(shape: ModelShape, s: Sizes, rows: int, group: int, top_p: float) -> int:
    prompts = math.ceil(rows / group)
    kv = generation_kv_bytes(shape, s, prompts, rows, s.new_tokens)
    prefill = prompts * s.prompt_len * _layer_work_bytes(shape, s.dtype_bytes)
    sampling = _sampling_bytes(shape, s.dtype_bytes, rows, top_p)
    return int(kv * (1 + KEEP_COPY)) + prefill + sampling


def _car_bytes(shape: ModelShape, s: Sizes, rows: int) -> int:
    # the prefix tree's last level copies each row's whole prompt cache
    kv = kv_cache_bytes(shape, s.dtype_bytes, rows * (s.car_prompt_len + s.car_new_tokens))
    prefill = rows * s.car_prompt_len * _layer_work_bytes(shape, s.dtype_bytes)
    return int(kv * (1 + KEEP_COPY)) + prefill + _sampling_bytes(shape, s.dtype_bytes, rows, 1.0)


def _scoring_bytes(shape: ModelShape, s: Sizes, micro: int) -> int:
    b, t = s.dtype_bytes, s.new_tokens
    chunk = math.ceil(micro / max(4, math.ceil(micro / 64)))  # engine.shared_prompt_logits
    prompts = kv_cache_bytes(shape, b, micro * s.prompt_len)
    per_layer_kv = shape.kv_bytes_per_token(b) // shape.layers
    work = chunk * ((s.prompt_len + t) * per_layer_kv + t * _layer_work_bytes(shape, b))
    return prompts + work + micro * t * shape.vocab * (16 if s.stats else 12)


def activation_bytes(shape: ModelShape, s: Sizes, micro: int, checkpointing: bool) -> int:
    """Activations of one update micro-batch of `micro` rows, saved for backward."""
    b, h = s.dtype_bytes, shape.hidden
    tokens = micro * (s.prompt_len + s.new_tokens)
    head = micro * s.new_tokens * (4 * h + b * h)  # final norm (fp32) and lm_head input
    if checkpointing:
        return tokens * (shape.layers * b * h + _layer_saved_bytes(shape, b)) + head
    row_prompt_kv = kv_cache_bytes(shape, b, micro * s.prompt_len)  # copied per row for SDPA
    return tokens * shape.layers * _layer_saved_bytes(shape, b) + row_prompt_kv + head


def update_checkpoints(shape: ModelShape, s: Sizes) -> bool:
    """Whether the update really checkpoints (`LEAN_SCORER_CHECKPOINTS`)."""
    return s.checkpointing and (LEAN_SCORER_CHECKPOINTS or not shape.lean)


def _update_bytes(shape: ModelShape, s: Sizes, micro: int) -> int:
    acts = activation_bytes(shape, s, micro, update_checkpoints(shape, s))
    return acts + micro * s.new_tokens * shape.vocab * 16


def stage_transients(shape: ModelShape, s: Sizes) -> dict[str, tuple[int, int]]:
    """Stage -> (rows at once, transient bytes) for the stages this config runs."""
    out = {"generation": (s.rows, _generation_bytes(shape, s, s.rows, s.n, s.top_p))}
    if s.car_rows:
        out["car"] = (s.car_rows, _car_bytes(shape, s, s.car_rows))
    if s.old_pass or s.ref:
        out["scoring"] = (s.micro, _scoring_bytes(shape, s, s.micro))
    out["update"] = (s.micro, _update_bytes(shape, s, s.micro))
    out["optimizer_step"] = (0, shape.params * s.dtype_bytes)
    if s.eval_rows:
        val = _generation_bytes(shape, s, s.eval_rows, s.eval_k, s.eval_top_p)
        out["validation"] = (s.eval_rows, val)
    return out


# ----------------------------------------------------------------------------------------
# The plan: peaks, verdict, the knobs that would make a stage fit
# ----------------------------------------------------------------------------------------
@dataclass
class Stage:
    name: str
    rows: int  # rows at once (generation, CAR, validation) or per forward (scoring, update)
    transient: int
    peak: int  # resident + transient
    fits: bool
    knobs: list[str] = field(default_factory=list)


@dataclass
class MemoryPlan:
    model_dir: str
    shape: ModelShape
    sizes: Sizes
    device_bytes: int
    resident: dict[str, int]
    components: dict[str, int]
    stages: list[Stage]
    generation_chunk_rows: int  # the largest generation chunk (whole prompts) that fits
    notes: list[str]

    @property
    def usable_bytes(self) -> int:
        return int(self.device_bytes * HEADROOM)

    @property
    def fits(self) -> bool:
        return all(stage.fits for stage in self.stages)

    def refusal(self) -> str | None:
        """What does not fit and the knobs that would make it fit; None when all fit."""
        if self.fits:
            return None
        failing = [st for st in self.stages if not st.fits]
        if any(st.name == "optimizer_step" for st in failing):
            # the resident state alone does not fit: no other stage's knob helps before this
            failing = [st for st in failing if st.name == "optimizer_step"] + [
                dataclasses.replace(st, knobs=[]) for st in failing if st.name != "optimizer_step"
            ]
        parts = [
            f"{st.name} needs {gib(st.peak)} GiB"
            + (f" (try {', '.join(st.knobs)})" if st.knobs else "")
            for st in failing
        ]
        head = f"does not fit on {gib(self.device_bytes)} GiB (a stage may use {gib(self.usable_bytes)})"
        text = f"{head}: {'; '.join(parts)}"
        names = {st.name for st in failing}
        if "generation" in names and "optimizer_step" not in names:
            text += (
                f". Generation would need chunks of at most {self.generation_chunk_rows} rows, "
                "and rollout chunking is not implemented yet (issue 25): shrink the step instead"
            )
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "model": {"dir": self.model_dir, **dataclasses.asdict(self.shape)},
            "sizes": dataclasses.asdict(self.sizes),
            "device_bytes": self.device_bytes,
            "device_gib": _g(self.device_bytes),
            "usable_bytes": self.usable_bytes,
            "usable_gib": _g(self.usable_bytes),
            "resident": {k: _entry(v) for k, v in self.resident.items()},
            "components": {k: _entry(v) for k, v in self.components.items()},
            "stages": [
                {
                    **dataclasses.asdict(st),
                    "transient_gib": _g(st.transient),
                    "peak_gib": _g(st.peak),
                }
                for st in self.stages
            ],
            "generation_rows": self.sizes.rows,
            "generation_chunk_rows": self.generation_chunk_rows,
            "generation_chunks_supported": False,
            "fits": self.fits,
            "refusal": self.refusal(),
            "knobs": list(KNOBS),
            "notes": self.notes,
        }


def gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _g(n: int) -> float:
    return round(n / GIB, 3)


def _entry(n: int) -> dict[str, float]:
    return {"bytes": n, "gib": _g(n)}


def plan_memory(
    cfg: Any, model_dir: str, device_bytes: int, device_type: str = "cuda"
) -> MemoryPlan:
    """The plan of `cfg` (a composed config) for the model whose config.json is in
    `model_dir`, on a `device_type` device of `device_bytes` bytes."""
    return build_plan(
        model_shape(str(model_dir)),
        sizes_from_config(cfg, device_type),
        device_bytes,
        str(model_dir),
    )


def build_plan(shape: ModelShape, s: Sizes, device_bytes: int, model_dir: str = "") -> MemoryPlan:
    resident = resident_bytes(shape, s)
    usable = int(device_bytes * HEADROOM)
    stages = []
    for name, (rows, transient) in stage_transients(shape, s).items():
        peak = sum(resident.values()) + transient
        knobs = [] if peak <= usable else stage_knobs(shape, s, name, usable)
        stages.append(Stage(name, rows, transient, peak, peak <= usable, knobs))
    fit_prompts = _largest(
        lambda p: _fits(shape, dataclasses.replace(s, prompts=p), "generation", usable), s.prompts
    )
    return MemoryPlan(
        model_dir=model_dir,
        shape=shape,
        sizes=s,
        device_bytes=device_bytes,
        resident=resident,
        components=_components(shape, s),
        stages=stages,
        generation_chunk_rows=fit_prompts * s.n,
        notes=_notes(shape, s),
    )


def _components(shape: ModelShape, s: Sizes) -> dict[str, int]:
    return {
        "kv_cache_generation": generation_kv_bytes(shape, s, s.prompts, s.rows, s.new_tokens),
        "kv_cache_per_token_row": shape.kv_bytes_per_token(s.dtype_bytes),
        "activations_update": activation_bytes(shape, s, s.micro, checkpointing=False),
        "activations_update_checkpointed": activation_bytes(shape, s, s.micro, checkpointing=True),
        "logits_update": s.micro * s.new_tokens * shape.vocab * 16,
    }


def _fits(shape: ModelShape, s: Sizes, stage: str, usable: int) -> bool:
    transients = stage_transients(shape, s)
    return (
        stage in transients
        and sum(resident_bytes(shape, s).values()) + transients[stage][1] <= usable
    )


def _largest(fits, hi: int) -> int:
    """The largest k in [1, hi] with fits(k) (monotone), 0 when none."""
    lo, best = 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def stage_knobs(shape: ModelShape, s: Sizes, stage: str, usable: int) -> list[str]:
    """Settings of today's knobs that make `stage` fit, each alone (the others unchanged)."""

    def best(key: str, hi: int, vary, scale: int = 1, low: int = 1) -> list[str]:
        k = _largest(lambda v: _fits(shape, dataclasses.replace(s, **vary(v)), stage, usable), hi)
        return [f"{key}={k * scale}"] if k >= low else []

    tokens = best("rollout.max_new_tokens", s.new_tokens, lambda t: {"new_tokens": t})
    if stage == "generation":
        per_step = best(
            "trainer.prompts_per_step",
            s.prompts // s.prompt_copies,
            lambda p: {"prompts": p * s.prompt_copies},
        )
        return per_step + best("rollout.n", s.n, lambda n: {"n": n}, low=2) + tokens
    if stage == "validation":
        k = s.eval_k
        return best("eval.batch_size", s.eval_rows // k, lambda q: {"eval_rows": q * k}, k) + tokens
    if stage == "car":
        a = s.car_pairs_per_anchor
        return best("car.chunk_pairs", s.car_rows // a, lambda q: {"car_rows": q * a}, a)
    if stage in ("scoring", "update"):
        knobs = best("algorithm.micro_batch_size", s.micro, lambda m: {"micro": m})
        checkpointed = dataclasses.replace(s, checkpointing=True)
        if (
            stage == "update"
            and not s.checkpointing
            and update_checkpoints(shape, checkpointed)
            and _fits(shape, checkpointed, stage, usable)
        ):
            knobs.append("model.gradient_checkpointing=true")
        return knobs + tokens
    # optimizer step: weights, reference, gradients and AdamW state are what it holds
    knobs = ["algorithm.kl_coef=0 (no reference model)"] if s.ref else []
    if s.dtype_bytes > 2:
        knobs.append("model.dtype=bf16")
    return [*knobs, "a larger device, or the verl backend with parameter / optimizer offload"]


def _notes(shape: ModelShape, s: Sizes) -> list[str]:
    notes = [
        f"generation_chunks_supported=false: a training step generates all {s.rows} rows at "
        "once; rollout chunking is not implemented yet (issue 25)",
        "planned: no GPU has run these figures; `omgrpo bench memory` checks them on the CPU "
        "(the backbones with every width / 16)",
    ]
    return notes


# ----------------------------------------------------------------------------------------
# Output, and the check `omgrpo train` runs at setup
# ----------------------------------------------------------------------------------------
STAGE_LABELS = {
    "generation": "generation (rollouts)",
    "car": "CAR pair answers",
    "scoring": "scoring (old/ref log-probs)",
    "update": "update (micro-batch)",
    "optimizer_step": "optimizer step",
    "validation": "validation",
}


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table (GiB) with its verdict."""
    shape, s, c = plan.shape, plan.sizes, plan.components
    res = " + ".join(f"{k} {gib(v)}" for k, v in plan.resident.items() if v)
    lines = [
        f"model     {shape.name} ({shape.model_type}): {shape.params:,} parameters, {s.dtype}",
        f"device    {gib(plan.device_bytes)} GiB; a stage may use "
        f"{gib(plan.usable_bytes)} GiB ({HEADROOM:.0%})",
        f"resident  {res} = {gib(sum(plan.resident.values()))} GiB",
        f"{'stage':<29}{'rows':>6}{'transient GiB':>15}{'peak GiB':>10}  fits",
    ]
    for st in plan.stages:
        rows = str(st.rows) if st.rows else ""
        lines.append(
            f"{STAGE_LABELS[st.name]:<29}{rows:>6}{gib(st.transient):>15}{gib(st.peak):>10}  "
            f"{'yes' if st.fits else 'NO'}"
        )
    lines += [
        f"K/V cache of the generation batch: {gib(c['kv_cache_generation'])} GiB "
        f"({c['kv_cache_per_token_row']:,} bytes per token per row)",
        f"update micro-batch of {s.micro} rows: activations {gib(c['activations_update'])} GiB "
        f"without / {gib(c['activations_update_checkpointed'])} GiB with gradient "
        f"checkpointing, logits {gib(c['logits_update'])} GiB",
        f"generation: {s.rows} rows at once; the largest chunk that fits: "
        f"{plan.generation_chunk_rows} rows (generation_chunks_supported: false)",
        *[f"note: {n}" for n in plan.notes],
        "verdict: fits" if plan.fits else f"verdict: {plan.refusal()}",
    ]
    return "\n".join(lines)


class MemoryPlanError(RuntimeError):
    """`omgrpo train` refuses a config whose plan does not fit the device."""


def check_memory_plan(cfg: Any, model_dir: str, device: torch.device) -> MemoryPlan | None:
    """At setup, before any weights load: on CUDA refuse a config that cannot fit the device
    (MemoryPlanError naming the stage and knobs); elsewhere print the plan's peak in one line.
    A model the planner cannot read is reported and not refused."""
    try:
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        plan = plan_memory(cfg, model_dir, total, device.type)
    except Exception as error:  # the plan advises; loading the model reports real errors
        print(f"memory plan: none ({type(error).__name__}: {error})")
        return None
    if device.type == "cuda" and not plan.fits:
        raise MemoryPlanError(
            f"omgrpo plan: this config {plan.refusal()} (`omgrpo plan` shows the table)"
        )
    top = max(plan.stages, key=lambda st: st.peak)
    memory = "GPU memory" if device.type == "cuda" else "RAM"
    print(
        f"memory plan ({device.type}, {plan.sizes.dtype}): peak {gib(top.peak)} GiB in "
        f"{top.name}, {gib(plan.device_bytes)} GiB of {memory}"
        + ("" if plan.fits else f"; {plan.refusal()}")
    )
    return plan
