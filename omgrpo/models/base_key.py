"""A toy base's key: the sha256 of everything that determines its weights (architecture, SFT
settings, toy-world ranges), under which the base is cached and shipped
(`omgrpo.models.toy.ensure_toy_base`). Apart from the model code, so that the reports and the
sweep planner name a run's base without importing torch and transformers."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omgrpo.tasks.toy import ToyWorldSpec

# Bump when the toy model or the warm-start recipe changes, so stale caches are not reused.
TOY_BASE_VERSION = 1


# The world's fields before the shortcut worlds existed: always in the key.
_FAITHFUL_FIELDS = ("min_steps", "max_steps", "max_start", "max_operand", "max_factor", "max_value")


def _world_key(spec: ToyWorldSpec) -> dict[str, Any]:
    """The world part of a base's key: shortcut-world fields only where they differ from their
    defaults, so bases of the faithful world keep the key they had before those fields existed."""
    defaults = ToyWorldSpec()
    key = {
        k: v for k, v in spec.__dict__.items() if k in _FAITHFUL_FIELDS or v != getattr(defaults, k)
    }
    if spec.hard_share > 0:
        # 2: de-duplication keeps each draw's difficulty (docs/toy-worlds.md, world v2)
        key["generator"] = 2
    return key


def toy_base_recipe(model_cfg: Any, task_cfg: Any) -> dict[str, Any]:
    """Everything that determines a toy base's weights; its sha256 is the base's key."""
    warm_start = dict(model_cfg.warm_start)
    # neither changes the weights: checks are measured after training, `shipped` says where
    # the weights come from
    warm_start.pop("check_problems", None)
    warm_start.pop("shipped", None)
    if not warm_start.get("car_share"):  # bases trained before CAR batches existed keep their key
        warm_start.pop("car_share", None)
    spec = {
        "version": TOY_BASE_VERSION,
        # char bases keep the key they had before the tokenizer became a setting
        **({} if model_cfg.tokenizer == "char" else {"tokenizer": model_cfg.tokenizer}),
        "arch": [
            model_cfg.hidden_size,
            model_cfg.num_layers,
            model_cfg.num_heads,
            model_cfg.num_kv_heads,
        ],
        "warm_start": warm_start,
        "world": _world_key(ToyWorldSpec.from_config(task_cfg)),
        "task_seed": task_cfg.seed,
    }
    return spec


def recipe_key(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def toy_base_key(model_cfg: Any, task_cfg: Any) -> str:
    return recipe_key(toy_base_recipe(model_cfg, task_cfg))
