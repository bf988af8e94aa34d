"""The `omgrpo` V1 trainer: verl's synchronous trainer with OM-GRPO's pieces wired in.

Registered with `@register_trainer("omgrpo")` (selected by `trainer.v1.trainer_mode=omgrpo`) when
`import verl` loads the plugin. On top of `PPOTrainerSync` it:

- stays in sync mode: verl compares `trainer_mode == "sync"` in several places (replay buffer
  class, refills, checkpoints), so the mode is set back to "sync" before the replay buffer is
  built; a trainer under its own name would otherwise get async behaviour;
- installs `omgrpo_ppo_loss` (KL weighted on answer tokens) on the actor workers after init;
- weights the advantages on answer tokens right after verl's GRPO step (`_compute_advantage`);
- logs omgrpo's metrics: `kl/answer`, `kl/reasoning`, `entropy/answer`, `entropy/reasoning`
  (from the loss), `reward/*`, `answers/*`, `acc/train`, `car/*` and `collapse/*` (from the
  rollouts' records), CAR's wall-clock span as `timing_s/car` (inside `timing_s/gen`: CAR runs
  in the generation stage), and `val/acc` / `val/pass@k` aliases of verl's validation metrics.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl import DataProto
from verl.trainer.distillation import is_distillation_enabled
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.padding import response_to_nested

from omgrpo.backends.verl import ANSWER_MASK_KEY, FORMAT_SCORE_KEY, RECORD_KEY
from omgrpo.backends.verl.advantage import apply_answer_weighting
from omgrpo.backends.verl.config import section, validate_section
from omgrpo.backends.verl.loss import omgrpo_ppo_loss
from omgrpo.backends.verl.metrics import step_metrics
from omgrpo.diagnostics import CollapseDetector

__all__ = ["TRAINER_NAME", "OmgrpoTrainer", "rename_loss_metrics"]

TRAINER_NAME = "omgrpo"

# Metrics the loss reports (verl prefixes them with "actor/") -> omgrpo's names.
_LOSS_METRICS = ("kl/answer", "kl/reasoning", "entropy/answer", "entropy/reasoning")


def rename_loss_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Move `actor/kl/answer` & co. to omgrpo's names (in place; returns `metrics`)."""
    for name in _LOSS_METRICS:
        if f"actor/{name}" in metrics:
            metrics[name] = metrics.pop(f"actor/{name}")
    return metrics


def validation_aliases(metrics: dict[str, Any]) -> dict[str, float]:
    """`val/acc` (mean@N accuracy) and `val/pass@k` (best@N of acc), averaged over data sources,
    from verl's `val-core/<source>/acc/...` metrics."""
    out = {}
    for alias, pattern in (("val/acc", "/acc/mean@"), ("val/pass@k", "/acc/best@")):
        values = [
            float(v)
            for k, v in metrics.items()
            if k.startswith("val-core/") and pattern in k and not k.endswith("/std")
        ]
        if values:
            out[alias] = float(np.mean(values))
    return out


@register_trainer(TRAINER_NAME)
class OmgrpoTrainer(PPOTrainerSync):
    """verl's sync PPO trainer running OM-GRPO (module docstring)."""

    def __init__(self, config: Any):
        validate_section(config)
        if is_distillation_enabled(config.get("distillation")):
            raise ValueError("the omgrpo trainer replaces ppo_loss: disable distillation")
        self.omgrpo = section(config)
        self._last_majority: dict[str, str] = {}
        collapse = self.omgrpo.collapse
        self._collapse = CollapseDetector(
            collapse.max_unique_per_prompt, collapse.min_mode_share, collapse.patience
        )
        super().__init__(config)

    def _build_replay_buffer(self) -> Any:
        # Runs inside PPOTrainer.__init__ right after trainer_mode is read from the config.
        self.trainer_mode = "sync"
        self.parameter_sync_step = self.config.trainer.v1.get("sync", {}).get(
            "parameter_sync_step", 1
        )
        return super()._build_replay_buffer()

    def make_loss_fn(self) -> partial:
        """The actor loss to install on the workers: built from the same actor config the
        workers use (as verl builds the critic's loss on the driver)."""
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        return partial(
            omgrpo_ppo_loss,
            config=actor_config,
            answer_weight=float(self.omgrpo.algorithm.answer_weight),
        )

    def on_init_end(self) -> None:
        self.actor_rollout_wg.set_loss_fn(self.make_loss_fn())
        print(self.describe())
        super().on_init_end()

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        batch = super()._compute_advantage(batch, metrics)
        algo = self.omgrpo.algorithm
        fields = ["uid", "response_mask", "advantages", ANSWER_MASK_KEY]
        if algo.format_only:
            fields.append(FORMAT_SCORE_KEY)
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=fields
        )
        nested_mask = data["response_mask"]
        proto = DataProto(batch=data.to_padded_tensor())
        proto.non_tensor_batch["uid"] = np.array(proto.batch.pop("uid").tolist(), dtype=object)
        apply_answer_weighting(
            proto, float(algo.answer_weight), bool(algo.format_only), float(algo.adv_eps)
        )
        out = TensorDict(
            {
                key: response_to_nested(proto.batch[key], nested_mask)
                for key in ("advantages", ANSWER_MASK_KEY)
            },
            batch_size=len(batch),
        )
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)

    def _omgrpo_step_metrics(self, batch: KVBatchMeta) -> dict[str, float]:
        keys = [k for k, t in zip(batch.keys, batch.tags) if not t.get("is_padding", False)]
        if not keys:
            return {}
        data = tq.kv_batch_get(
            keys=keys,
            partition_id=batch.partition_id,
            select_fields=["uid", "extra_fields", "rm_scores"],
        )
        extra = data["extra_fields"].tolist()
        records = [e.get(RECORD_KEY) if isinstance(e, dict) else None for e in extra]
        if any(r is None for r in records):
            raise RuntimeError(
                "training rollouts carry no omgrpo record: they were not scored by the omgrpo "
                "agent loop, so their rewards are verl's per-sample ones; set "
                "actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                "omgrpo.backends.verl.agent_loop.OmgrpoAgentLoopManager"
            )
        rewards = [float(x) for x in data["rm_scores"].to_padded_tensor().sum(-1).tolist()]
        return step_metrics(
            data["uid"].tolist(),
            records,
            rewards,
            confident_share=float(self.omgrpo.collapse.confident_share),
            last_majority=self._last_majority,
        )

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch) -> None:
        rename_loss_metrics(metrics)
        om_metrics = self._omgrpo_step_metrics(batch)
        if "car/span_s" in om_metrics:
            # verl turns timing_raw[k] into timing_s/k; CAR overlaps generation (timing_s/gen).
            timing_raw["car"] = om_metrics["car/span_s"]
            om_metrics["time/car"] = om_metrics["car/span_s"]
        if "answers/unique_per_prompt" in om_metrics:
            if self._collapse.update(global_steps, om_metrics):
                print(f"omgrpo: collapse detected at step {global_steps}")
            detected = self._collapse.state["detected_step"]
            om_metrics["collapse/detected_step"] = math.nan if detected is None else detected
        metrics.update(om_metrics)
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)

    def _val_metrics_update(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        metrics = super()._val_metrics_update(*args, **kwargs)
        metrics.update(validation_aliases(metrics))
        return metrics

    def describe(self) -> str:
        """One line for logs: what this trainer runs."""
        om = self.omgrpo
        return (
            f"omgrpo trainer: method={om.method} w={om.algorithm.answer_weight} "
            f"format_only={om.algorithm.format_only} car={om.car.enable} "
            f"rewards={OmegaConf.to_container(om.reward.parts)}"
        )
