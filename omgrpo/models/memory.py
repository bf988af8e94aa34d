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
  holds the prompts' cache once per prompt and allocates each row's cache at T new tokens:
  tokens = prompts · p + rows · T. Dropping finished rows copies one layer's K or V while the
  old one is alive: 1 / (2L) more.
- **generation** (training rollouts, validation, CAR), per chunk (`omgrpo.generation.budget`,
  the formulas the samplers size their chunks with): K/V (with the copy) + the prefill's
  working set of one layer over all prompt tokens, tokens · (b·(2h + 2·H·D + 2·Hkv·D + 3I) +
  8h) (the 8h: RMSNorm's fp32 copies), + sampling over rows × V: b + 12 bytes per element
  (fp32 probabilities, cumulative sums), b + 32 with top-p < 1 (sort values, int64 order), +
  the rows' uniform draws (4 bytes per row and new token), + the lean decoder's copy of the
  q/k/v weights, L · (H + 2·Hkv) · D · h · b (none with LoRA). A chunk is the most rows (whole
  prompts with their rollout.n rows, else part of one prompt's) whose transient fits what the
  resident state leaves of the device, or whose K/V holds at most rollout.max_batch_tokens
  tokens when that is set; validation at most eval.batch_size rows, CAR at most
  car.chunk_pairs pairs, each row's prompt p + 2 · car.max_solution_tokens +
  `CAR_TEMPLATE_TOKENS` copied per row. The run sizes its chunks from the free memory it
  measures before each generation, so its chunks may differ from the plan's; the samples do
  not (each row draws from its own stream).
- **scoring** (old / reference log-probs, no grad), m = algorithm.micro_batch_size rows: the
  micro-batch's prompt K/V, one layer's working set of a chunk of rows, and the logits: the
  fp32 logits, their fp32 log-softmax and the entropy's fp32 exp, 12 bytes per m·T·V element
  (the model-dtype logits are freed once cast; with a self-certainty / entropy reward its
  log-softmax is taken after the entropy's buffers are freed: 12 too). The scorer writes its
  chunks' logits into one output, so it never holds more (`omgrpo bench memory`: 3.05 copies
  of the logits measured on the shrunk Qwen3).
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
- **LoRA** (`model.lora.rank` r > 0, `LoraShape`): A adapter parameters, r · (in + out) per
  targeted module (counted on the meta device), in fp32 whatever b (peft's
  `autocast_adapter_dtype`). Resident: the base's weights P·b, no reference copy (the
  reference is the base with the adapters off), the adapters 4·A, their gradients 4·A and
  AdamW's moments 8·A; nothing for the frozen base weights. Optimizer step: 4·A. Update: a
  frozen linear keeps no input for a weight gradient, so a layer saves b·(2h + I) less per
  token (the q/k/v input, the MLP's input, down_proj's input); each adapter saves its input in
  fp32 (4 bytes per element: a copy per module over a bf16 / fp16 base; over an fp32 base the
  modules reading one tensor share it, q/k/v/o and gate/up: `layer_shared_inputs`; with
  dropout a dropped fp32 copy and its mask per module, 8 bytes per element: torch's CPU
  dropout keeps an fp32 mask, CUDA's fused one a 1-byte mask, 3 bytes less) and its rank-r
  output (4·r per module). Checked against the tensors autograd saves (tiny Qwen2 / Qwen3 /
  Llama layers on the CPU, tests/models/test_memory_lora.py): 1.04-1.15 of them. Generation
  and scoring are planned as without LoRA (the adapters' share of a forward's working set is
  left out).

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

from omgrpo.generation.budget import (
    HEADROOM,
    LEAN_MODEL_TYPES,  # noqa: F401  (re-exported: the planner's public names)
    ModelShape,
    chunk_rows,
    generation_bytes,
    kv_cache_bytes,
    kv_tokens,
    largest,
    layer_work_bytes,
)
from omgrpo.models.loading import resolve_dtype

GIB = 2**30
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
    "rollout.max_batch_tokens",
    "car.max_solution_tokens",
    "eval.batch_size",
    "algorithm.micro_batch_size",
    "model.gradient_checkpointing",
    "model.dtype",
)


# The config.json fields the plan reads (transformers' canonical names; a model class may
# store one under another name, e.g. GPT-2's n_layer, via its attribute_map).
PLANNED_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def check_model_config(model_dir: str) -> None:
    """Refuse, with an InputError naming the file and the field, a `model.path` the planner
    cannot plan truthfully: no such directory, no or unparsable config.json, no model_type, or
    a field of `PLANNED_FIELDS` missing (transformers would fill in its library default: a
    different model planned) or not a positive integer."""
    import json
    from pathlib import Path

    from omgrpo.errors import InputError

    path = Path(model_dir)
    expected = "a directory with the model's config.json (no weights needed)"
    if not path.exists():
        hub_id = not path.is_absolute() and not str(model_dir).startswith(".")
        if not hub_id or str(model_dir).count("/") != 1:
            raise InputError(
                "no such directory", key="model.path", found=str(model_dir), expected=expected
            )
        try:
            from transformers import AutoConfig

            AutoConfig.from_pretrained(model_dir)  # a hub id in the local cache
        except (OSError, ValueError) as e:
            raise InputError(
                "no such directory, and not a model in the local Hugging Face cache",
                key="model.path",
                found=str(model_dir),
                expected=expected,
            ) from e
        return
    if not path.is_dir():
        raise InputError(
            "not a directory", key="model.path", found=str(model_dir), expected=expected
        )
    file = path / "config.json"
    if not file.is_file():
        raise InputError("no config.json", file=path, key="model.path", expected=expected)
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"not valid JSON ({e})", file=file) from e
    if not isinstance(raw, dict):
        raise InputError("not a JSON object", file=file, found=type(raw).__name__)
    if not isinstance(raw.get("model_type"), str) or not raw["model_type"]:
        raise InputError(
            "no model_type", file=file, key="model_type", expected='e.g. "qwen2", "llama"'
        )
    from transformers import CONFIG_MAPPING

    if raw["model_type"] not in CONFIG_MAPPING:
        raise InputError(
            "unknown to this transformers",
            file=file,
            key="model_type",
            found=raw["model_type"],
            expected="a model type transformers knows",
        )
    aliases = getattr(CONFIG_MAPPING[raw["model_type"]], "attribute_map", {}) or {}
    for name in PLANNED_FIELDS:
        key = name if name in raw else aliases.get(name, name)
        if key not in raw:
            raise InputError(
                "missing (the plan would use the library's default: another model)",
                file=file,
                key=name,
                expected="a positive integer",
            )
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(file=file, key=key, found=value, expected="a positive integer")


@functools.lru_cache(maxsize=8)
def model_shape(model_dir: str) -> ModelShape:
    """The shape of the causal LM whose `config.json` is in `model_dir` (or a hub id), its
    parameters counted on the meta device (tied embeddings once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # config.json is the only input here: what transformers cannot build from it is named
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except OSError:  # no such directory or hub id: check_model_config names it
        raise
    except Exception as e:  # a field of the wrong type or value (transformers validates some)
        from omgrpo.errors import InputError

        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise InputError(
            f"transformers cannot build the model from it ({first})",
            file=os.path.join(model_dir, "config.json"),
        ) from e
    name = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    return ModelShape.from_config(config, sum(p.numel() for p in model.parameters()), name)


LORA_BYTES = 4  # peft keeps adapters in fp32 (omgrpo.models.lora.ADAPTER_DTYPE)


@dataclass(frozen=True)
class LoraShape:
    """The LoRA adapters of a model (`model.lora.*`), as the plan counts them."""

    rank: int
    params: int  # A: r · (in + out) summed over the targeted modules
    modules: int  # targeted modules in the whole model
    layer_modules: int  # ... in one decoder layer
    layer_inputs: int  # the input widths of one layer's targeted modules, summed
    layer_shared_inputs: int  # ... counting once the modules of one parent reading one width
    dropout: bool  # model.lora.dropout > 0


@functools.lru_cache(maxsize=8)
def _linear_layers(model_dir: str) -> tuple[tuple[str, int, int], ...]:
    """(module name, in, out) of every linear layer of the model whose `config.json` is in
    `model_dir`, and of its embeddings (num_embeddings, dim), built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            out.append((name, module.in_features, module.out_features))
        elif isinstance(module, torch.nn.Embedding):
            out.append((name, module.num_embeddings, module.embedding_dim))
    return tuple(out)


def lora_shape(model_dir: str, lora: Any) -> LoraShape | None:
    """The adapters `lora` (a `model.lora` config node) puts on the model in `model_dir`; None
    when LoRA is off (rank 0). A module is targeted as peft matches names: its name is a
    target, or ends with `.` + a target."""
    rank = int(lora.rank)
    if rank <= 0:
        return None
    targets = list(lora.target_modules)
    hits = [
        (name, fan_in, fan_out)
        for name, fan_in, fan_out in _linear_layers(str(model_dir))
        if any(name == t or name.endswith("." + t) for t in targets)
    ]
    if not hits:
        raise ValueError(f"model.lora.target_modules={targets} match no module of {model_dir}")
    layer = [(n, i) for n, i, _ in hits if ".layers.0." in f".{n}"]
    return LoraShape(
        rank=rank,
        params=sum(rank * (i + o) for _, i, o in hits),
        modules=len(hits),
        layer_modules=len(layer),
        layer_inputs=sum(i for _, i in layer),
        layer_shared_inputs=sum(i for _, i in {(n.rsplit(".", 1)[0], i) for n, i in layer}),
        dropout=float(lora.dropout) > 0,
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
    max_batch_tokens: int | None = None  # rollout.max_batch_tokens (None: sized from memory)
    lora: LoraShape | None = None  # model.lora.* (None: full fine-tuning; `plan_memory` sets it)

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
        # update.single_update: one PPO epoch over one mini-batch reuses the update's forward;
        # the top-entropy mask's entropy comes from a pass of its own (trainer.old_pass)
        old_pass=stats
        or getattr(a, "top_entropy_quantile", None) is not None
        or not (a.ppo_epochs == 1 and mini >= rows),
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
        max_batch_tokens=r.max_batch_tokens,
    )


def _car_rows(rollouts: int, per_anchor: int, chunk_pairs: int) -> int:
    """Pair rows of CAR's largest chunk: whole anchors of `per_anchor` pairs, at most
    `chunk_pairs` rows (an anchor with more is split: generation/car._anchor_chunks)."""
    total = rollouts * per_anchor
    if per_anchor == 0:
        return 0
    whole = chunk_pairs // per_anchor * per_anchor
    return min(total, whole if whole else chunk_pairs)


# ----------------------------------------------------------------------------------------
# Bytes (module docstring: the formulas)
# ----------------------------------------------------------------------------------------
def resident_bytes(shape: ModelShape, s: Sizes) -> dict[str, int]:
    """What stays on the device through a step (from step 2 on)."""
    weights = shape.params * s.dtype_bytes
    if s.lora is not None:  # the base frozen: no reference copy, no gradients, no moments
        adapters = s.lora.params * LORA_BYTES
        return {
            "weights": weights,
            "reference": 0,
            "adapters": adapters,
            "gradients": adapters,
            "adamw_state": 2 * adapters,
        }
    return {
        "weights": weights,
        "reference": weights if s.ref else 0,
        "gradients": weights,
        "adamw_state": 2 * weights,
    }


def trainable_bytes(shape: ModelShape, s: Sizes) -> int:
    """Bytes of the trained parameters (all weights, or the LoRA adapters)."""
    if s.lora is not None:
        return s.lora.params * LORA_BYTES
    return shape.params * s.dtype_bytes


def _layer_saved_bytes(shape: ModelShape, b: int, lora: LoraShape | None = None) -> int:
    """Activations one layer saves for backward, per token (with `lora`: the frozen base's
    and the adapters', module docstring)."""
    h, qd, kvd = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    saved = b * (2 * h + 4 * qd + 3 * kvd + 4 * shape.intermediate) + 8 * h
    if shape.model_type == "qwen3":  # q/k RMSNorms upcast q and k to fp32
        saved += 4 * (qd + kvd)
    if lora is None:
        return saved
    saved -= b * (2 * h + shape.intermediate)  # inputs kept only for the frozen weights' grads
    if lora.dropout:  # a dropped fp32 copy and its mask (fp32 on the CPU) per module
        inputs = (LORA_BYTES + 4) * lora.layer_inputs
    elif b != LORA_BYTES:  # an fp32 copy per module
        inputs = LORA_BYTES * lora.layer_inputs
    else:  # the modules' own inputs, shared
        inputs = LORA_BYTES * lora.layer_shared_inputs
    return saved + inputs + LORA_BYTES * lora.rank * lora.layer_modules


def generation_kv_bytes(shape: ModelShape, s: Sizes, prompts: int, rows: int, new: int) -> int:
    """K/V of `rows` rows of `prompts` prompts decoding `new` tokens: the lean decoder keeps
    each prompt once, the HF cache once per row."""
    tokens = kv_tokens(shape, prompts, rows, s.prompt_len, new, per_row=False)
    return kv_cache_bytes(shape, s.dtype_bytes, tokens)


def chunk_generation_bytes(shape: ModelShape, s: Sizes, rows: int, group: int, top_p: float) -> int:
    """A chunk of `rows` rollout or validation rows, `group` per prompt."""
    return generation_bytes(
        shape,
        s.dtype_bytes,
        prompts=math.ceil(rows / group),
        rows=rows,
        prompt_len=s.prompt_len,
        new_tokens=s.new_tokens,
        top_p=top_p,
    )


def _car_bytes(shape: ModelShape, s: Sizes, rows: int) -> int:
    # the prefix tree's last level copies each row's whole prompt cache
    return generation_bytes(
        shape,
        s.dtype_bytes,
        prompts=rows,
        rows=rows,
        prompt_len=s.car_prompt_len,
        new_tokens=s.car_new_tokens,
        top_p=s.car_top_p,
        per_row=True,
    )


def _chunk(shape: ModelShape, s: Sizes, stage: str, budget: int | None) -> int:
    """Rows of the largest chunk of a generation stage, as the sampler sizes it
    (`omgrpo.generation.budget.chunk_rows`): `budget` bytes of transient, or
    rollout.max_batch_tokens when set."""
    if stage == "car":
        rows, group, prompt_len, new, top_p = (
            s.car_rows,
            1,
            s.car_prompt_len,
            s.car_new_tokens,
            s.car_top_p,
        )
    elif stage == "validation":
        rows, group, prompt_len, new, top_p = (
            s.eval_rows,
            s.eval_k,
            s.prompt_len,
            s.new_tokens,
            s.eval_top_p,
        )
    else:
        rows, group, prompt_len, new, top_p = s.rows, s.n, s.prompt_len, s.new_tokens, s.top_p
    got = chunk_rows(
        shape,
        s.dtype_bytes,
        rows=rows,
        group=group,
        prompt_len=prompt_len,
        new_tokens=new,
        top_p=top_p,
        per_row=stage == "car",
        max_batch_tokens=s.max_batch_tokens,
        budget_bytes=None if s.max_batch_tokens is not None else budget,
    )
    return _car_rows(rows, s.car_pairs_per_anchor, got) if stage == "car" else got


def _scoring_bytes(shape: ModelShape, s: Sizes, micro: int) -> int:
    b, t = s.dtype_bytes, s.new_tokens
    chunk = math.ceil(micro / max(4, math.ceil(micro / 64)))  # engine.shared_prompt_logits
    prompts = kv_cache_bytes(shape, b, micro * s.prompt_len)
    per_layer_kv = shape.kv_bytes_per_token(b) // shape.layers
    work = chunk * ((s.prompt_len + t) * per_layer_kv + t * layer_work_bytes(shape, b))
    return prompts + work + micro * t * shape.vocab * 12  # module docstring: 3 fp32 copies


def activation_bytes(shape: ModelShape, s: Sizes, micro: int, checkpointing: bool) -> int:
    """Activations of one update micro-batch of `micro` rows, saved for backward."""
    b, h = s.dtype_bytes, shape.hidden
    tokens = micro * (s.prompt_len + s.new_tokens)
    head = micro * s.new_tokens * (4 * h + b * h)  # final norm (fp32) and lm_head input
    layer = _layer_saved_bytes(shape, b, s.lora)
    if checkpointing:
        return tokens * (shape.layers * b * h + layer) + head
    row_prompt_kv = kv_cache_bytes(shape, b, micro * s.prompt_len)  # copied per row for SDPA
    return tokens * shape.layers * layer + row_prompt_kv + head


def update_checkpoints(shape: ModelShape, s: Sizes) -> bool:
    """Whether the update really checkpoints (`LEAN_SCORER_CHECKPOINTS`)."""
    return s.checkpointing and (LEAN_SCORER_CHECKPOINTS or not shape.lean)


def _update_bytes(shape: ModelShape, s: Sizes, micro: int) -> int:
    acts = activation_bytes(shape, s, micro, update_checkpoints(shape, s))
    return acts + micro * s.new_tokens * shape.vocab * 16


def stage_transients(
    shape: ModelShape, s: Sizes, budget: int | None = None
) -> dict[str, tuple[int, int]]:
    """Stage -> (rows at once, transient bytes) for the stages this config runs; generation,
    CAR and validation in chunks of at most `budget` transient bytes (None: unbounded) or
    rollout.max_batch_tokens K/V tokens."""
    rows = _chunk(shape, s, "generation", budget)
    out = {"generation": (rows, chunk_generation_bytes(shape, s, rows, s.n, s.top_p))}
    if s.car_rows:
        car = _chunk(shape, s, "car", budget)
        out["car"] = (car, _car_bytes(shape, s, car))
    if s.old_pass or s.ref:
        out["scoring"] = (s.micro, _scoring_bytes(shape, s, s.micro))
    out["update"] = (s.micro, _update_bytes(shape, s, s.micro))
    out["optimizer_step"] = (0, trainable_bytes(shape, s))
    if s.eval_rows:
        val = _chunk(shape, s, "validation", budget)
        out["validation"] = (val, chunk_generation_bytes(shape, s, val, s.eval_k, s.eval_top_p))
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
    generation_chunk_rows: int  # rows of the largest rollout chunk (`stage_transients`)
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
        return f"{head}: {'; '.join(parts)}"

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
            "generation_chunks_supported": True,
            "chunk_rows": {st.name: st.rows for st in self.stages if st.name in CHUNKED},
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
    sizes = sizes_from_config(cfg, device_type)
    lora = getattr(cfg.model, "lora", None)
    shape = model_shape(str(model_dir))
    if lora is not None:
        sizes = dataclasses.replace(sizes, lora=lora_shape(str(model_dir), lora))
    if sizes.lora is not None:  # peft's layers decode unfused: no q/k/v copy
        shape = dataclasses.replace(shape, fused=False)
    return build_plan(shape, sizes, device_bytes, str(model_dir))


def build_plan(shape: ModelShape, s: Sizes, device_bytes: int, model_dir: str = "") -> MemoryPlan:
    resident = resident_bytes(shape, s)
    usable = int(device_bytes * HEADROOM)
    budget = usable - sum(resident.values())  # what the chunks of a generation stage may use
    stages = []
    for name, (rows, transient) in stage_transients(shape, s, budget).items():
        peak = sum(resident.values()) + transient
        knobs = [] if peak <= usable else stage_knobs(shape, s, name, usable)
        stages.append(Stage(name, rows, transient, peak, peak <= usable, knobs))
    return MemoryPlan(
        model_dir=model_dir,
        shape=shape,
        sizes=s,
        device_bytes=device_bytes,
        resident=resident,
        components=_components(shape, s, stages[0].rows),
        stages=stages,
        generation_chunk_rows=stages[0].rows,
        notes=_notes(s, stages[0].rows),
    )


def _components(shape: ModelShape, s: Sizes, chunk: int) -> dict[str, int]:
    prompts = math.ceil(chunk / s.n)
    return {
        # all of a step's rows at once (what an unchunked sampler would hold), and one chunk
        "kv_cache_generation": generation_kv_bytes(shape, s, s.prompts, s.rows, s.new_tokens),
        "kv_cache_generation_chunk": generation_kv_bytes(shape, s, prompts, chunk, s.new_tokens),
        "kv_cache_per_token_row": shape.kv_bytes_per_token(s.dtype_bytes),
        "activations_update": activation_bytes(shape, s, s.micro, checkpointing=False),
        "activations_update_checkpointed": activation_bytes(shape, s, s.micro, checkpointing=True),
        "logits_update": s.micro * s.new_tokens * shape.vocab * 16,
    }


def _fits(shape: ModelShape, s: Sizes, stage: str, usable: int) -> bool:
    resident = sum(resident_bytes(shape, s).values())
    transients = stage_transients(shape, s, usable - resident)
    return stage in transients and resident + transients[stage][1] <= usable


def stage_knobs(shape: ModelShape, s: Sizes, stage: str, usable: int) -> list[str]:
    """Settings of today's knobs that make `stage` fit, each alone (the others unchanged)."""

    def best(key: str, hi: int, vary, scale: int = 1, low: int = 1) -> list[str]:
        k = largest(lambda v: _fits(shape, dataclasses.replace(s, **vary(v)), stage, usable), hi)
        return [f"{key}={k * scale}"] if k >= low else []

    tokens = best("rollout.max_new_tokens", s.new_tokens, lambda t: {"new_tokens": t})
    if stage in CHUNKED and s.max_batch_tokens is not None:
        # an explicit chunk too large for the device: sizing from the free memory may fit
        auto = dataclasses.replace(s, max_batch_tokens=None)
        if _fits(shape, auto, stage, usable):
            return ["rollout.max_batch_tokens=null"]
    if stage in ("generation", "validation"):
        return tokens  # chunks shrink to one row: only a row's length is left
    if stage == "car":
        base = s.car_prompt_len - 2 * _solution_tokens(s)
        return best(
            "car.max_solution_tokens",
            _solution_tokens(s),
            lambda t: {"car_prompt_len": base + 2 * t},
        )
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
    knobs = ["algorithm.kl_coef=0 (no reference model)"] if s.ref and s.lora is None else []
    if s.dtype_bytes > 2:
        knobs.append("model.dtype=bf16")
    return [*knobs, "a larger device, or the verl backend with parameter / optimizer offload"]


def _solution_tokens(s: Sizes) -> int:
    return (s.car_prompt_len - s.prompt_len - CAR_TEMPLATE_TOKENS) // 2


def _notes(s: Sizes, chunk: int) -> list[str]:
    sized = (
        f"rollout.max_batch_tokens={s.max_batch_tokens}"
        if s.max_batch_tokens is not None
        else "the memory the resident state leaves (the run measures its free memory)"
    )
    return [
        f"generation in chunks: {chunk} of the step's {s.rows} rows at once, sized by {sized}; "
        "the samples do not depend on the chunks",
        "planned: `omgrpo bench memory` checks the three backbones' generation, scoring and "
        "update against a measurement, on the CPU (widths / 16) and on a GPU (real widths, "
        "bf16; docs/memory.md)",
    ]


# ----------------------------------------------------------------------------------------
# Output, and the check `omgrpo train` runs at setup
# ----------------------------------------------------------------------------------------
CHUNKED = ("generation", "car", "validation")  # stages generated in chunks
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
        *(
            [
                f"lora      rank {s.lora.rank} on {s.lora.modules} modules: "
                f"{s.lora.params:,} adapter parameters, fp32; the base frozen, the reference "
                "is the base with the adapters off"
            ]
            if s.lora is not None
            else []
        ),
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
        f"K/V cache of a generation chunk: {gib(c['kv_cache_generation_chunk'])} GiB (all "
        f"{s.rows} rows at once: {gib(c['kv_cache_generation'])} GiB; "
        f"{c['kv_cache_per_token_row']:,} bytes per token per row)",
        f"update micro-batch of {s.micro} rows: activations {gib(c['activations_update'])} GiB "
        f"without / {gib(c['activations_update_checkpointed'])} GiB with gradient "
        f"checkpointing, logits {gib(c['logits_update'])} GiB",
        f"generation: {s.rows} rows per step, in chunks of {plan.generation_chunk_rows} rows",
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
