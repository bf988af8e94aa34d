"""The `omgrpo` V1 trainer: verl's synchronous trainer with OM-GRPO's pieces wired in.

Registered with `@register_trainer("omgrpo")` (selected by `trainer.v1.trainer_mode=omgrpo`) when
`import verl` loads the plugin. On top of `PPOTrainerSync` it:

- stays in sync mode: verl compares `trainer_mode == "sync"` in several places (replay buffer
  class, refills, checkpoints), so the mode is set back to "sync" before the replay buffer is
  built; a trainer under its own name would otherwise get async behaviour;
- installs `omgrpo_ppo_loss` (KL weighted on answer tokens) on the actor workers after init;
- weights the advantages on answer tokens right after verl's GRPO step (`_compute_advantage`),
  and draws the generic masks (`omgrpo.core.masks`: advantage 0, and KL weight 0 in the loss,
  on their tokens; `mask/frac`, `mask/answer_overlap`);
- runs the DAPO options that need the step's rows (`omgrpo.backends.verl.dapo`) right before
  verl's GRPO step: the overlong penalty in the rewards, the rows dynamic sampling and the
  overlong filter keep in the loss (`dapo/*`);
- logs omgrpo's metrics: `kl/answer`, `kl/reasoning`, `answer/frac` (from the loss),
  `entropy/answer`, `entropy/reasoning` (from the loss when the actor computes entropy in the
  update, else from the entropy verl stores in the old-log-prob pass), `reward/*`,
  `answers/*`, `acc/train`, `car/*` and `collapse/*` (from the rollouts' records), CAR's
  wall-clock span as `timing_s/car` (inside `timing_s/gen`: CAR runs in the generation stage),
  and `val/acc` / `val/pass@<k>` of verl's validation samples (the native trainer's
  definitions, docs/metrics.md);
- with `omgrpo.collapse.stop`, ends training after the step in which collapse is detected
  (the step is logged; verl's loop then exits as after its last step, without an extra
  checkpoint or validation: the native trainer's `collapsed` stop);
- grades with `omgrpo.reward` (budget, math-verify on/off) in the driver's metrics, as the
  agent-loop workers and verl's reward workers do (a `Grader` per stage, nothing process-wide);
- writes the omgrpo run store (`omgrpo.backends.verl.run_store`): a tracking backend put into
  the `Tracking` verl's `fit` builds, the rollout table of every logged step (step 1 and every
  `omgrpo.run.log_rollouts_every`) with each rollout's GRPO advantage A_i, each validation's
  per-problem rows (`problems.parquet`, `validation_problems`), and the run's
  status (`running`, then `finished` / `collapsed`, or `failed` / `killed` with the error).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta
from verl.trainer.distillation import is_distillation_enabled
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.tracking import Tracking

from omgrpo.backends.verl import ANSWER_MASK_KEY, FORMAT_SCORE_KEY, RECORD_KEY, span_mask_key
from omgrpo.backends.verl.advantage import generic_masks, weight_jagged
from omgrpo.backends.verl.config import section, validate_section
from omgrpo.backends.verl.dapo import dapo_fields, dapo_read_fields, drops_rows
from omgrpo.backends.verl.loss import loss_metric_means, omgrpo_ppo_loss
from omgrpo.backends.verl.metrics import records_step, records_texts, validation_problems
from omgrpo.backends.verl.record import RolloutRecord
from omgrpo.backends.verl.run_store import BACKEND_NAME, RunStoreBackend, run_dir, store_config
from omgrpo.core.accuracy import avg_at_k, mean_pass_at_k
from omgrpo.core.answers import Grader
from omgrpo.core.dapo import dapo_on
from omgrpo.core.diagnostics import CollapseDetector
from omgrpo.core.losses import token_means, token_roles, token_stats
from omgrpo.core.masks import mask_spans
from omgrpo.core.step import LoopState, rollout_table
from omgrpo.tracking.store import RunStore

__all__ = [
    "TRAINER_NAME",
    "OmgrpoTrainer",
    "entropy_split",
    "row_advantages",
    "validation_aliases",
]

TRAINER_NAME = "omgrpo"


def entropy_split(
    entropy: torch.Tensor, response_mask: torch.Tensor, answer_mask: torch.Tensor
) -> dict[str, float]:
    """`entropy/answer` and `entropy/reasoning` of (B, T) per-token entropies: the token means
    of `token_stats` (nan when there is no such token), as every backend computes them."""
    stats = token_stats({"entropy": entropy}, token_roles(response_mask, answer_mask))
    return {k: v for k, v in token_means(stats).items() if k.startswith("entropy/")}


def row_advantages(data: Any) -> list[float]:
    """Each row's GRPO advantage A_i from verl's per-token `advantages` (the estimator
    broadcasts A_i over the response; read before answer weighting): the mean over the row's
    response tokens (0 for a row without any, e.g. balance-batch padding)."""
    adv = data["advantages"].to_padded_tensor(0.0).float()
    mask = data["response_mask"].to_padded_tensor(0).float()
    return ((adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()


def validation_aliases(
    data_sources: Sequence[str], sample_uids: Sequence[str], extra: Mapping[str, Sequence[Any]]
) -> dict[str, float]:
    """`val/acc` (avg@k) and `val/pass@<k>` (share of prompts with at least one of their k
    samples correct) from the per-sample `acc` of verl's validation (`reward_extra_infos_dict`),
    as the native trainer (`omgrpo.core.accuracy`), averaged over data sources; k is the number of
    samples per prompt (the largest, should prompts differ). verl's own `best@k` is a
    bootstrap estimate with replacement, lower than pass@k, so it is not reused."""
    per_prompt: dict[tuple[str, str], list[float]] = defaultdict(list)
    for source, uid, acc in zip(data_sources, sample_uids, extra.get("acc") or []):
        if acc is not None:
            per_prompt[(str(source), str(uid))].append(float(acc))
    if not per_prompt:
        return {}
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for (source, _), accs in per_prompt.items():
        by_source[source].append(accs)
    k = max(len(accs) for accs in per_prompt.values())
    return {
        "val/acc": float(np.mean([avg_at_k(p) for p in by_source.values()])),
        f"val/pass@{k}": float(
            np.mean([mean_pass_at_k([[x > 0 for x in a] for a in p]) for p in by_source.values()])
        ),
    }


@register_trainer(TRAINER_NAME)
class OmgrpoTrainer(PPOTrainerSync):
    """verl's sync PPO trainer running OM-GRPO (module docstring)."""

    def __init__(self, config: Any):
        validate_section(config)
        if is_distillation_enabled(config.get("distillation")):
            raise ValueError("the omgrpo trainer replaces ppo_loss: disable distillation")
        self.omgrpo = section(config)
        self._loop = LoopState()  # label flips and collapse across steps, as the native loop
        collapse = self.omgrpo.collapse
        self._collapse = CollapseDetector(
            collapse.max_unique_per_prompt, collapse.min_mode_share, collapse.patience
        )
        self._collapse.state = self._loop.collapse
        self._row_advantages: dict[Any, float] = {}  # batch key -> A_i, until the step is logged
        self._tracking: Tracking | None = None
        self.run_store: RunStoreBackend | None = None  # made in `fit` (total steps known)
        super().__init__(config)

    @property
    def logger(self) -> Tracking | None:
        """verl's `Tracking` of this run (built by `fit`)."""
        return self._tracking

    @logger.setter
    def logger(self, tracking: Tracking) -> None:
        # verl's `fit` builds its `Tracking` and assigns it here: the run store joins verl's
        # backends (W&B, MLflow, file, console), as verl 0.9.1 has no backend registry.
        if self.run_store is not None and BACKEND_NAME not in tracking.logger:
            tracking.logger[BACKEND_NAME] = self.run_store
        self._tracking = tracking

    def fit(self, agent_loop_manager: Any) -> None:
        """verl's `fit`, recorded in the run store: `running`, then `finished` or `collapsed`
        (a collapse stop), or `failed` / `killed` with the error (`RunStore.recording_failures`).
        """
        store = RunStore(run_dir(self.config))
        base = self.config.actor_rollout_ref.model.path
        self.run_store = RunStoreBackend(store, self.total_training_steps, base)
        with store.recording_failures():
            self.run_store.start(store_config(self.config), int(self.global_steps))
            super().fit(agent_loop_manager)
            last = int(self.global_steps) - 1  # fit counts one past the last step it logged
            detected = self._collapse.state["detected_step"]
            if detected is not None and self.omgrpo.collapse.stop:
                self.run_store.status("collapsed", last, collapse_step=detected)
            else:
                self.run_store.status("finished", last)

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
        algo = self.omgrpo.algorithm
        kl_weight = algo.answer_weight if algo.answer_kl_weight is None else algo.answer_kl_weight
        # the PG weight w is applied to the advantages; the loss weights the KL term only
        extra = {"dapo_rows": True} if drops_rows(algo) else {}
        return partial(
            omgrpo_ppo_loss, config=actor_config, answer_weight=float(kl_weight), **extra
        )

    def on_init_end(self) -> None:
        self.actor_rollout_wg.set_loss_fn(self.make_loss_fn())
        print(self.describe())
        super().on_init_end()

    def _old_entropy_stored(self) -> bool:
        """verl stores `entropy` in its old-log-prob pass, except in rollout-correction bypass
        mode (old log-probs taken from the rollout, no forward pass)."""
        corr = self.config.algorithm.get("rollout_correction", None)
        return not (corr and corr.get("bypass_mode", False))

    def _dapo(self, batch: KVBatchMeta, metrics: dict) -> None:
        """The DAPO options on the step's stored rows, before verl's GRPO step reads their
        rewards (`omgrpo.backends.verl.dapo.dapo_fields`)."""
        algo = self.omgrpo.algorithm
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=dapo_read_fields(algo)
        )
        real = [not tag.get("is_padding", False) for tag in batch.tags]
        fields, dapo_metrics = dapo_fields(
            data,
            real,
            algo,
            int(self.config.actor_rollout_ref.rollout.response_length),
            str(self.config.actor_rollout_ref.actor.loss_agg_mode),
        )
        metrics.update(dapo_metrics)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        if dapo_on(self.omgrpo.algorithm):
            self._dapo(batch, metrics)
        batch = super()._compute_advantage(batch, metrics)
        algo = self.omgrpo.algorithm
        fields = ["uid", "response_mask", "advantages", ANSWER_MASK_KEY]
        if algo.format_only:
            fields.append(FORMAT_SCORE_KEY)
        with_entropy = self._old_entropy_stored()
        if with_entropy:
            fields.append("entropy")
        spans = [span_mask_key(span) for span in mask_spans(algo)]
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=fields + spans
        )
        self._row_advantages.update(zip(batch.keys, row_advantages(data)))
        masked = None
        if spans:  # a generic mask: drawn over the step's rows (a row's position: its rollout
            # index), with the step verl is running (`fit` counts it in global_steps)
            masked, mask_metrics = generic_masks(
                data, algo, seed=int(self.omgrpo.seed), step=int(self.global_steps)
            )
            metrics.update(mask_metrics)
        drop = ["entropy", *spans] if with_entropy else spans
        out = weight_jagged(
            data.exclude(*drop) if drop else data,
            float(algo.answer_weight),
            bool(algo.format_only),
            float(algo.adv_eps),
            masked,
        )
        if with_entropy:
            # Padding rows have response_mask 0 (and, after weighting, no answer tokens).
            metrics.update(
                entropy_split(
                    data["entropy"].to_padded_tensor(0.0),
                    data["response_mask"].to_padded_tensor(0),
                    out[ANSWER_MASK_KEY].to_padded_tensor(0),
                )
            )
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)

    def _omgrpo_step_metrics(self, batch: KVBatchMeta, step: int) -> dict[str, float]:
        """omgrpo's metrics of the step; the step's rollout table goes to the run store."""
        advantages, self._row_advantages = self._row_advantages, {}
        keys = [k for k, t in zip(batch.keys, batch.tags) if not t.get("is_padding", False)]
        if not keys:
            return {}
        data = tq.kv_batch_get(
            keys=keys,
            partition_id=batch.partition_id,
            select_fields=["uid", "extra_fields", "rm_scores"],
        )
        # `get` gives the NonTensorStack (`data[key]` would give a plain linked list).
        extra = data.get("extra_fields").tolist()
        records = [e.get(RECORD_KEY) if isinstance(e, dict) else None for e in extra]
        if any(r is None for r in records):
            raise RuntimeError(
                "training rollouts carry no omgrpo record: they were not scored by the omgrpo "
                "agent loop, so their rewards are verl's per-sample ones; set "
                "actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                "omgrpo.backends.verl.agent_loop.OmgrpoAgentLoopManager"
            )
        rewards = data.select("rm_scores").to_padded_tensor()["rm_scores"].sum(-1).tolist()
        uids = data.get("uid").tolist()
        records = [RolloutRecord.from_dict(r) for r in records]
        metrics, step_batch = records_step(
            uids,
            records,
            rewards,
            confident_share=float(self.omgrpo.collapse.confident_share),
            state=self._loop,
            grader=Grader.from_config(self.omgrpo.reward),
            advantages=[advantages.get(k, math.nan) for k in keys],
        )
        every = max(int(self.omgrpo.run.log_rollouts_every), 1)
        if self.run_store is not None and (step == 1 or step % every == 0):
            table = rollout_table(step, step_batch, records_texts(uids, records))
            self.run_store.add_rollouts(step, table)
        return metrics

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch) -> None:
        loss_metric_means(metrics)
        om_metrics = self._omgrpo_step_metrics(batch, global_steps)
        if "car/span_s" in om_metrics:
            # verl turns timing_raw[k] into timing_s/k; CAR overlaps generation (timing_s/gen).
            timing_raw["car"] = om_metrics["car/span_s"]
            om_metrics["time/car"] = om_metrics["car/span_s"]
        if "answers/unique_per_prompt" in om_metrics:
            if self._collapse.update(global_steps, om_metrics):
                print(f"omgrpo: collapse detected at step {global_steps}")
                if self.omgrpo.collapse.stop:
                    self._stop_after(global_steps)
            detected = self._collapse.state["detected_step"]
            om_metrics["collapse/detected_step"] = math.nan if detected is None else detected
        metrics.update(om_metrics)
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)

    def _stop_after(self, step: int) -> None:
        """End training after `step`: verl's `fit` loop runs while `global_steps <=
        total_training_steps` and increments `global_steps` after logging the step, so it
        exits (through `on_train_end`) as after a normal last step, minus the last-step
        checkpoint and validation, like the native trainer's collapse stop."""
        print(f"omgrpo: omgrpo.collapse.stop=true: ending training after step {step}")
        self.total_training_steps = step

    def _val_metrics_update(
        self, data_sources, sample_uids, reward_extra_infos_dict, *args: Any, **kwargs: Any
    ) -> dict[str, float]:
        metrics = super()._val_metrics_update(
            data_sources, sample_uids, reward_extra_infos_dict, *args, **kwargs
        )
        metrics.update(validation_aliases(data_sources, sample_uids, reward_extra_infos_dict))
        problems = validation_problems(self.global_steps, sample_uids, reward_extra_infos_dict)
        if problems is not None and self.run_store is not None:
            self.run_store.add_problems(self.global_steps, problems)  # problems.parquet
        return metrics

    def describe(self) -> str:
        """One line for logs: what this trainer runs."""
        om = self.omgrpo
        return (
            f"omgrpo trainer: method={om.method} w={om.algorithm.answer_weight} "
            f"format_only={om.algorithm.format_only} car={om.car.enable} "
            f"rewards={OmegaConf.to_container(om.reward.parts)}"
        )
