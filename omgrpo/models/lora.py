"""LoRA on the native trainer, through peft (`model.lora.*`, docs/real-models.md "LoRA").

`apply_lora` wraps a loaded Hugging Face causal LM in peft's `PeftModel`. peft replaces the
targeted `nn.Linear` modules of the model in place by LoRA layers (the frozen base layer plus
rank-r adapters A and B, kept in fp32 whatever the base's dtype: peft's
`autocast_adapter_dtype`), so the Hugging Face model itself (`PeftModel.get_base_model()`, the
same object as before) computes W x + (alpha / r) B A x. The trainer keeps that model as its
policy: the engine (`omgrpo.generation.engine`) calls its modules (`model.model.layers[i]
.self_attn.q_proj`, ...) and reads `model.config.model_type`, which the `PeftModel` wrapper does
not expose the same way. The wrapper is kept beside it for what only peft does: switching the
adapters off (`adapters_off`, the KL term's reference: the frozen base, no second copy of the
weights), the adapters' state (`adapter_state_dict`, `load_adapter_state`: what a checkpoint
holds) and merging them into the base weights (`merge_adapters`, for `omgrpo export`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

ADAPTER_DTYPE = torch.float32
"""peft keeps the adapters in fp32 over a bf16 / fp16 base (its `autocast_adapter_dtype`), so
their gradients and AdamW moments are fp32 too (`omgrpo.models.memory` plans 4 bytes each)."""


def lora_enabled(model_cfg: Any) -> bool:
    """Whether `model.lora.rank` > 0 (a config without a `lora` section: no)."""
    lora = getattr(model_cfg, "lora", None)
    return lora is not None and int(lora.rank) > 0


def apply_lora(model: torch.nn.Module, lora_cfg: Any, seed: int) -> Any:
    """`model` (a Hugging Face causal LM) with LoRA adapters, as a peft `PeftModel`; `model`
    itself is changed in place (its targeted linear layers become LoRA layers, every base
    weight is frozen) and stays `PeftModel.get_base_model()`. B starts at zero, so the model
    computes what it did before; A's random start is drawn from a generator seeded with
    `seed`, leaving the global RNG as it was."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora_cfg.target_modules)
    config = LoraConfig(
        r=int(lora_cfg.rank),
        lora_alpha=float(lora_cfg.alpha),
        lora_dropout=float(lora_cfg.dropout),
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    # peft draws A's Kaiming-uniform start from the global CPU RNG (before moving A to the
    # base's device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, config)
        except ValueError as error:
            raise ValueError(
                f"model.lora.target_modules={targets}: {error} (the model's module names: "
                f"{', '.join(linear_names(model)[:12])}, ...)"
            ) from error


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last name parts of `model`'s linear layers (what target_modules names)."""
    names = dict.fromkeys(
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    )
    return list(names)


@contextmanager
def adapters_off(peft_model: Any) -> Iterator[torch.nn.Module]:
    """The Hugging Face model with its adapters switched off for the duration: the frozen
    base, computed by the same modules and weights as the policy (peft's
    `disable_adapter()`)."""
    with peft_model.disable_adapter():
        yield peft_model.get_base_model()


def adapter_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapters' weights (peft's keys, as in its `adapter_model.safetensors`), nothing of
    the base."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(peft_model).items()}


def load_adapter_state(peft_model: Any, state: dict[str, torch.Tensor]) -> None:
    """Load `adapter_state_dict`'s output into `peft_model`'s adapters; raises ValueError when
    a key is unknown or an adapter weight is left out (e.g. other target modules)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = set(get_peft_model_state_dict(peft_model))
    if set(state) != expected:
        unknown, missing = sorted(set(state) - expected), sorted(expected - set(state))
        raise ValueError(
            f"the checkpoint's LoRA adapters do not match the model's: unknown {unknown[:4]}, "
            f"missing {missing[:4]} ({len(unknown)} / {len(missing)} in all)"
        )
    result = set_peft_model_state_dict(peft_model, state)
    if result.unexpected_keys:
        raise ValueError(f"LoRA adapters not loaded: {result.unexpected_keys[:4]}")


def merge_adapters(peft_model: Any) -> torch.nn.Module:
    """The plain Hugging Face model with the adapters merged into its weights (W + (alpha /
    r) B A, rounded to the base's dtype), the LoRA layers gone (peft's `merge_and_unload`),
    every weight requiring grad again as `from_pretrained` leaves it (peft froze them; frozen,
    the merged toy model's log-probs differed from its exported directory's by 4.8e-7 on the
    CPU, with the same weights: why was not analysed). Changes the model's weights in place:
    call it on a copy, never on a training policy."""
    return peft_model.merge_and_unload().requires_grad_(True)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all of them in full fine-tuning, the adapters'
    with LoRA (peft freezes the rest)."""
    return [p for p in model.parameters() if p.requires_grad]
