"""Fused projections for decoding: a block's q/k/v projections as one matrix, gate/up as another.

A decode step is a chain of small products; one product where there were three (q, k, v) or two
(gate, up) launches fewer kernels and reads the input once.

- gate/up: not a copy. The first time, the two modules' weights are moved into one tensor and
  each module's weight becomes a view of its rows (`param.data = view`), so the model keeps its
  parameters, their optimizer state and its memory, and the HF forward, `state_dict`,
  checkpoints and `save_pretrained` (which clones shared tensors) see the same values. Later
  calls find the rows adjacent and only view them.
- q/k/v: a copy made for each chunk a generation decodes (the weights change between
  generations; a chunk's copy is freed with it), its rows in the order the decoder wants its
  output: for each KV head, the query heads that read it and then the key head, then the
  values. One elementwise pass can then lay a step's queries and keys out by prefix node and
  scale them (`omgrpo.generation.engine.decode_forward`). It costs the projection's weights
  once more while a chunk decodes (`budget.generation_bytes` counts it).

Products with these matrices carry no gradient to the modules, so the decoder uses them only
without grad (`fuse_decoder` returns None with grad enabled). A projection that is not a plain
`torch.nn.Linear` (peft's LoRA layers, quantised layers) is left alone, and its block runs on its
modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedBlock:
    """One decoder block's fused weights."""

    qkv_weight: torch.Tensor  # (out features, hidden): per KV head its g query heads and its
    qkv_bias: torch.Tensor | None  # key head ((g + 1) * D rows), then every value head
    qk_width: int  # rows of the queries and keys
    qk_scale: torch.Tensor  # (kv heads, 1, g + 1, D): the attention scaling (queries) and
    # q_norm's / k_norm's weights, multiplied in after the unweighted RMSNorm (HF's order)
    qk_eps: float | None  # the norms' epsilon; None: the model has no q_norm / k_norm
    o_weight: torch.Tensor
    gate_up_weight: torch.Tensor  # (2 * intermediate, hidden): gate's rows, then up's (a view)
    down_weight: torch.Tensor


def fuse_decoder(model: torch.nn.Module) -> list[FusedBlock] | None:
    """Every block of a Llama-family decoder (`model.model.layers`) with its projections fused,
    or None where some block cannot be (a projection is not a plain Linear, o / down / gate /
    up carry a bias) or grad is enabled."""
    if torch.is_grad_enabled() or not decoder_fusable(model):
        return None
    return [_fuse_block(layer) for layer in model.model.layers]


def decoder_fusable(model: torch.nn.Module) -> bool:
    """Whether `fuse_decoder` fuses this model's blocks (under no grad)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers is not None and all(_fusable(layer) for layer in layers)


def qkv_copy_bytes(
    layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, b: int
) -> int:
    """Bytes of the q/k/v copies `fuse_decoder` makes for a generation (weights only)."""
    return layers * (heads + 2 * kv_heads) * head_dim * hidden * b


def _plain(module: torch.nn.Module) -> bool:
    return type(module) is torch.nn.Linear


def _fusable(layer: torch.nn.Module) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(m is not None and _plain(m) for m in linears):
        return False
    q, k, v, o, gate, up, down = linears
    if any(m.bias is not None for m in (o, gate, up, down)):
        return False
    if (q.bias is None) != (k.bias is None) or (q.bias is None) != (v.bias is None):
        return False
    if hasattr(attn, "q_norm"):
        qn, kn = attn.q_norm, attn.k_norm
        eps = getattr(qn, "variance_epsilon", None)
        if eps is None or eps != getattr(kn, "variance_epsilon", None):
            return False
        if getattr(qn, "weight", None) is None or getattr(kn, "weight", None) is None:
            return False
    return hasattr(mlp, "act_fn")


def _fuse_block(layer: torch.nn.Module) -> FusedBlock:
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    d = attn.head_dim
    kv_heads = k.out_features // d
    g = q.out_features // d // kv_heads

    def by_kv_head(qx: torch.Tensor, kx: torch.Tensor) -> torch.Tensor:
        """q's and k's rows (or biases) -> (kv heads, g + 1, D, ...), flattened to rows."""
        rest = qx.shape[1:]
        qh = qx.detach().view(kv_heads, g, d, *rest)
        kh = kx.detach().view(kv_heads, 1, d, *rest)
        return torch.cat([qh, kh], dim=1).view(-1, *rest)

    weight = torch.cat([by_kv_head(q.weight, k.weight), v.weight.detach()])
    bias = None
    if q.bias is not None:
        bias = torch.cat([by_kv_head(q.bias, k.bias), v.bias.detach()])
    scale = torch.ones((kv_heads, 1, g + 1, d), dtype=weight.dtype, device=weight.device)
    eps = None
    if hasattr(attn, "q_norm"):
        scale[:, :, :g] = attn.q_norm.weight.detach()
        scale[:, :, g] = attn.k_norm.weight.detach()
        eps = attn.q_norm.variance_epsilon
    scale[:, :, :g] *= attn.scaling
    return FusedBlock(
        qkv_weight=weight,
        qkv_bias=bias,
        qk_width=kv_heads * (g + 1) * d,
        qk_scale=scale,
        qk_eps=eps,
        o_weight=attn.o_proj.weight.detach(),
        gate_up_weight=shared_rows([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down_weight=mlp.down_proj.weight.detach(),
    )


def shared_rows(params: list[torch.Tensor]) -> torch.Tensor:
    """The parameters' rows stacked (dim 0) as one tensor sharing their storage: a view where
    they already lie one after another, else (the first time) a new tensor that each
    parameter's data is moved into (`param.data = its rows`)."""
    if _adjacent(params):
        first = params[0].detach()
        rows = sum(p.shape[0] for p in params)
        return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
    fused = torch.cat([p.detach() for p in params])
    for p, rows in zip(params, fused.split([p.shape[0] for p in params])):
        p.data = rows
    return fused


def _adjacent(params: list[torch.Tensor]) -> bool:
    first = params[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype for p in params):
        return False
    if any(p.shape[1:] != first.shape[1:] for p in params):
        return False
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr() + first.numel() * first.element_size()
    for p in params[1:]:
        if p.untyped_storage().data_ptr() != storage or p.data_ptr() != end:
            return False
        end += p.numel() * p.element_size()
    return True
