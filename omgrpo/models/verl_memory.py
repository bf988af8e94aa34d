"""The per-GPU memory plan of a verl run (`omgrpo plan backend=verl ...`), and the one-GPU
settings the `*_1gpu` verl presets take from it (`one_gpu_settings`).

verl colocates the FSDP actor, the reference model and vLLM on each GPU and runs them one
after another; vLLM sleeps (weights and K/V cache released) while the actor trains. P
parameters, n = GPUs (FSDP shards the actor's state n ways), the actor's master weights in
`fsdp_config.model_dtype` (fp32: m = 4 bytes), compute in bf16 (2 bytes). Stages, per GPU:

- **rollout** (vLLM awake): vLLM's pool, `gpu_memory_utilization` × the device, plus the
  actor state verl leaves on the GPU meanwhile: master weights m·P/n unless `param_offload`,
  AdamW's two moments 2·m·P/n unless `optimizer_offload` (gradients are freed after each
  update). vLLM's pool itself must hold its bf16 weights 2·P/tp, a prefill of
  `max_num_batched_tokens` tokens (one layer's working set), fp32 logits of `max_num_seqs`
  rows and the K/V cache (`vllm_sequences`: how many sequences of
  prompt + response tokens it holds at once).
- **log_prob** (old log-probs with entropy, and the reference pass; the reference's weights
  are CPU-offloaded by verl and gathered a unit at a time): the actor state as in rollout,
  one FSDP unit gathered in bf16, and a micro-batch of `log_prob_max_token_len_per_gpu`
  tokens: one layer's working set and the logits, 16 bytes per token × vocab (bf16 logits,
  their fp32 cast, log-softmax, entropy's softmax; verl's torch path, without flash-attn's
  fused cross-entropy).
- **update** (the actor's micro-batch of `ppo_max_token_len_per_gpu` tokens): master weights,
  gradients (m·P/n each) and AdamW's moments (2·m·P/n), which verl loads back onto the GPU
  for the update even with param / optimizer offload; none of them with FSDP2's
  `offload_policy` (kept on the CPU, AdamW steps there). Plus one gathered unit, the
  activations (checkpointed: each layer's bf16 input per token plus one layer recomputed,
  the native plan's formula) and the logits, 16 bytes per token × vocab.

The formulas are the native plan's (`omgrpo.models.memory`) where the work is the same; the
vLLM and FSDP parts follow verl 0.9.1's code (`workers/engine/fsdp/transformer_impl.py`).
Planned only: verl has never run on a GPU in this project.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from omgrpo.generation.budget import layer_work_bytes
from omgrpo.models.memory import (
    GIB,
    HEADROOM,
    ModelShape,
    _layer_saved_bytes,
    model_shape,
)

BF16 = 2
LOGIT_BYTES = 16  # per token × vocab element, log-prob pass and update alike (docstring)
MIN_SEQUENCES = 8  # a one-GPU preset's vLLM pool holds at least one group of G = 8 rollouts
MAX_UTILIZATION = 0.85  # vLLM's share; the CUDA context and the allocator need the rest
TOKEN_STEP = 1024  # the one-GPU presets' token budgets are multiples of this
MAX_TOKENS = 32768  # verl's default log-prob budget: no use going above it
MODEL_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class VerlSettings:
    """The verl keys that set per-GPU memory."""

    gpus: int
    tp: int
    gpu_memory_utilization: float
    param_offload: bool
    optimizer_offload: bool
    offload_policy: bool  # FSDP2 CPU offload of weights, gradients and AdamW (strategy fsdp2)
    master_bytes: int  # bytes per element of fsdp_config.model_dtype
    ppo_max_token_len: int
    log_prob_max_token_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    checkpointing: bool
    prompt_len: int
    response_len: int


def verl_settings(cfg: Any) -> VerlSettings:
    """The memory-relevant settings of a composed verl config (`compose_verl`)."""
    a = cfg.actor_rollout_ref
    fsdp, r = a.actor.fsdp_config, a.rollout
    return VerlSettings(
        gpus=int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes),
        tp=int(r.tensor_model_parallel_size),
        gpu_memory_utilization=float(r.gpu_memory_utilization),
        param_offload=bool(fsdp.param_offload),
        optimizer_offload=bool(fsdp.optimizer_offload),
        offload_policy=bool(fsdp.offload_policy) and a.actor.strategy == "fsdp2",
        master_bytes=MODEL_DTYPE_BYTES[str(fsdp.model_dtype)],
        ppo_max_token_len=int(a.actor.ppo_max_token_len_per_gpu),
        log_prob_max_token_len=int(
            max(a.ref.log_prob_max_token_len_per_gpu, r.log_prob_max_token_len_per_gpu)
        ),
        max_num_batched_tokens=int(r.max_num_batched_tokens),
        max_num_seqs=int(r.max_num_seqs),
        checkpointing=bool(a.model.enable_gradient_checkpointing),
        prompt_len=int(cfg.data.max_prompt_length),
        response_len=int(cfg.data.max_response_length),
    )


def _unit_bytes(shape: ModelShape) -> int:
    """The largest FSDP unit gathered in bf16: a decoder layer or the embedding."""
    embedding = shape.vocab * shape.hidden
    layer = (shape.params - embedding) // shape.layers
    return BF16 * max(layer, embedding)


def _actor_between(shape: ModelShape, st: VerlSettings) -> int:
    """Actor state left on the GPU outside the update (rollout, log-prob passes)."""
    if st.offload_policy:
        return 0
    per = st.master_bytes * shape.params // st.gpus
    return (0 if st.param_offload else per) + (0 if st.optimizer_offload else 2 * per)


def vllm_bytes(shape: ModelShape, st: VerlSettings, device_bytes: int) -> dict[str, int]:
    """vLLM's pool split: weights, prefill activations, K/V cache; and the sequences of
    prompt + response tokens the K/V cache holds at once."""
    pool = int(st.gpu_memory_utilization * device_bytes)
    weights = BF16 * shape.params // st.tp
    # one layer's working set over a full prefill batch, and fp32 logits of the rows sampled
    prefill = st.max_num_batched_tokens * layer_work_bytes(shape, BF16) // st.tp
    prefill += st.max_num_seqs * shape.vocab * 4
    kv = pool - weights - prefill
    per_seq = shape.kv_bytes_per_token(BF16) // st.tp * (st.prompt_len + st.response_len)
    return {
        "pool": pool,
        "weights": weights,
        "prefill": prefill,
        "kv_cache": kv,
        "sequences": max(0, kv) // per_seq,
    }


def verl_stages(shape: ModelShape, st: VerlSettings, device_bytes: int) -> dict[str, int]:
    """Stage -> peak bytes on one GPU (module docstring)."""
    unit, between = _unit_bytes(shape), _actor_between(shape, st)
    lp = st.log_prob_max_token_len
    log_prob = lp * (layer_work_bytes(shape, BF16) + shape.vocab * LOGIT_BYTES)
    tokens = st.ppo_max_token_len
    if st.checkpointing:
        acts = tokens * (shape.layers * BF16 * shape.hidden + _layer_saved_bytes(shape, BF16))
    else:
        acts = tokens * shape.layers * _layer_saved_bytes(shape, BF16)
    state = 0 if st.offload_policy else 4 * st.master_bytes * shape.params // st.gpus
    return {
        "rollout": between + int(st.gpu_memory_utilization * device_bytes),
        "log_prob": between + unit + log_prob,
        "update": state + unit + acts + tokens * shape.vocab * LOGIT_BYTES,
    }


@dataclass
class VerlPlan:
    model_dir: str
    shape: ModelShape
    settings: VerlSettings
    device_bytes: int
    stages: dict[str, int]
    vllm: dict[str, int]

    @property
    def usable_bytes(self) -> int:
        return int(self.device_bytes * HEADROOM)

    @property
    def problems(self) -> list[str]:
        out = [
            f"{name} needs {peak / GIB:.1f} GiB"
            for name, peak in self.stages.items()
            if peak > self.usable_bytes
        ]
        if self.vllm["sequences"] < 1:
            out.append("vLLM's pool holds no whole sequence (raise gpu_memory_utilization)")
        if self.settings.ppo_max_token_len < self.settings.prompt_len + self.settings.response_len:
            out.append("ppo_max_token_len_per_gpu is below one prompt + response")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": "verl",
            "model": {"dir": self.model_dir, **asdict(self.shape)},
            "settings": asdict(self.settings),
            "device_gib": round(self.device_bytes / GIB, 3),
            "usable_gib": round(self.usable_bytes / GIB, 3),
            "stages_gib": {k: round(v / GIB, 3) for k, v in self.stages.items()},
            "vllm_gib": {k: round(v / GIB, 3) for k, v in self.vllm.items() if k != "sequences"},
            "vllm_sequences": self.vllm["sequences"],
            "host_gib_offloaded": round(self.host_bytes / GIB, 3),
            "fits": self.fits,
            "problems": self.problems,
            "note": "planned, not measured: verl has never run on a GPU in this project",
        }

    @property
    def host_bytes(self) -> int:
        """CPU memory the offloaded state takes (the reference model's weights always)."""
        st, p = self.settings, self.shape.params
        actor = 4 * st.master_bytes * p if st.offload_policy else 0
        if not st.offload_policy:
            actor += st.master_bytes * p if st.param_offload else 0
            actor += 2 * st.master_bytes * p if st.optimizer_offload else 0
        return actor + st.master_bytes * p  # the reference model (forward only, offloaded)


def build_verl_plan(
    shape: ModelShape, st: VerlSettings, device_bytes: int, model_dir: str = ""
) -> VerlPlan:
    return VerlPlan(
        model_dir,
        shape,
        st,
        device_bytes,
        verl_stages(shape, st, device_bytes),
        vllm_bytes(shape, st, device_bytes),
    )


def plan_verl(cfg: Any, model_dir: str, device_bytes: int) -> VerlPlan:
    """The per-GPU plan of a composed verl config for the model whose config.json is in
    `model_dir`."""
    return build_verl_plan(model_shape(str(model_dir)), verl_settings(cfg), device_bytes, model_dir)


def format_verl_plan(plan: VerlPlan) -> str:
    st, v = plan.settings, plan.vllm
    offload = (
        "FSDP2 offload_policy (weights, gradients, AdamW on the CPU)"
        if st.offload_policy
        else f"param_offload={st.param_offload}, optimizer_offload={st.optimizer_offload}"
    )
    lines = [
        f"model     {plan.shape.name}: {plan.shape.params:,} parameters (verl, per GPU of {st.gpus})",
        f"device    {plan.device_bytes / GIB:.1f} GiB; a stage may use {plan.usable_bytes / GIB:.1f}",
        f"offload   {offload}",
        f"vLLM      {st.gpu_memory_utilization:.2f} of the device: weights {v['weights'] / GIB:.1f}"
        f" + prefill {v['prefill'] / GIB:.1f} + K/V {v['kv_cache'] / GIB:.1f} GiB"
        f" ({v['sequences']} sequences of {st.prompt_len + st.response_len} tokens at once)",
        *[f"{name:<10}{peak / GIB:>8.1f} GiB" for name, peak in plan.stages.items()],
        f"host      {plan.host_bytes / GIB:.1f} GiB of CPU memory for offloaded state",
        "verdict: fits" if plan.fits else f"verdict: does not fit: {'; '.join(plan.problems)}",
    ]
    return "\n".join(lines)


def one_gpu_settings(
    shape: ModelShape, device_bytes: int, prompt_len: int, response_len: int
) -> VerlSettings:
    """The one-GPU settings the `*_1gpu` presets use: the least offload that fits (none,
    then param + optimizer offload, then FSDP2's offload_policy), the largest token budgets
    (multiples of TOKEN_STEP up to MAX_TOKENS) and the largest vLLM share (steps of 0.05 up
    to MAX_UTILIZATION) whose stages fit, with vLLM holding MIN_SEQUENCES sequences."""
    base = VerlSettings(
        gpus=1,
        tp=1,
        gpu_memory_utilization=0.0,
        param_offload=False,
        optimizer_offload=False,
        offload_policy=False,
        master_bytes=4,
        ppo_max_token_len=0,
        log_prob_max_token_len=0,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        checkpointing=True,
        prompt_len=prompt_len,
        response_len=response_len,
    )
    for offload in (
        {},
        {"param_offload": True, "optimizer_offload": True},
        {"offload_policy": True},
    ):
        fitted = _fit_budgets(shape, replace(base, **offload), device_bytes)
        if fitted is not None:
            return fitted
    raise ValueError(f"{shape.name} does not fit one GPU of {device_bytes / GIB:.0f} GiB with verl")


def _fit_budgets(shape: ModelShape, st: VerlSettings, device_bytes: int) -> VerlSettings | None:
    """`st` with the largest token budgets and vLLM share that fit; None when one cannot."""
    usable = int(device_bytes * HEADROOM)

    def fits(name: str, **kw) -> bool:
        return verl_stages(shape, replace(st, **kw), device_bytes)[name] <= usable

    def holds(util: float) -> bool:
        pool = vllm_bytes(shape, replace(st, gpu_memory_utilization=util), device_bytes)
        return pool["sequences"] >= MIN_SEQUENCES

    least = math.ceil((st.prompt_len + st.response_len) / TOKEN_STEP) * TOKEN_STEP
    budgets = range(MAX_TOKENS, least - 1, -TOKEN_STEP)
    ppo = next((t for t in budgets if fits("update", ppo_max_token_len=t)), 0)
    lp = next((t for t in budgets if fits("log_prob", log_prob_max_token_len=t)), 0)
    shares = [round(MAX_UTILIZATION - 0.05 * i, 2) for i in range(int(MAX_UTILIZATION / 0.05))]
    util = next((u for u in shares if fits("rollout", gpu_memory_utilization=u) and holds(u)), 0)
    if not (ppo and lp and util):
        return None
    return replace(
        st, ppo_max_token_len=ppo, log_prob_max_token_len=lp, gpu_memory_utilization=util
    )


def preset_overrides(st: VerlSettings) -> dict[str, Any]:
    """The verl keys of `st`, as a one-GPU preset sets them."""
    a, strategy = "actor_rollout_ref", "fsdp2" if st.offload_policy else "fsdp"
    return {
        "trainer.n_gpus_per_node": st.gpus,
        f"{a}.rollout.gpu_memory_utilization": st.gpu_memory_utilization,
        # verl copies actor.strategy into the actor's engine config; the reference's is set here
        f"{a}.actor.strategy": strategy,
        f"{a}.actor.fsdp_config.strategy": strategy,
        f"{a}.ref.fsdp_config.strategy": strategy,
        f"{a}.actor.fsdp_config.param_offload": st.param_offload,
        f"{a}.actor.fsdp_config.optimizer_offload": st.optimizer_offload,
        f"{a}.actor.fsdp_config.offload_policy": st.offload_policy,
        f"{a}.actor.ppo_max_token_len_per_gpu": st.ppo_max_token_len,
        f"{a}.ref.log_prob_max_token_len_per_gpu": st.log_prob_max_token_len,
        f"{a}.rollout.log_prob_max_token_len_per_gpu": st.log_prob_max_token_len,
    }
