"""OM-GRPO on verl: a plugin for an unforked verl, pinned exactly (docs/verl.md).

`import verl` loads the `verl.plugins` entry point `omgrpo` (`omgrpo.backends.verl.plugin`) in
every process, which registers the trainer `omgrpo` (`trainer.v1.trainer_mode=omgrpo`). The
pieces, one module each:

| module      | what it changes in verl                                                        |
|-------------|--------------------------------------------------------------------------------|
| reward      | `compute_score`: per-sample format score, `pred` (validation maj@N), `acc`     |
|             | (diagnostic)                                                                   |
| agent_loop  | agent-loop worker that waits for a prompt's G rollouts, runs CAR on the policy's |
|             | rollout servers, scores the group (`omgrpo.core.step.score_step`: soft vote + CAR   |
|             | pool, format), presets each rollout's reward and records its answer tokens     |
| prm         | the `process` reward's PRM in its own Ray actor: loads the checkpoint, scores  |
|             | the groups' responses batched across groups within each group's budget        |
| advantage   | per-token advantages: w on answer tokens (or the format advantage), 0 on the   |
|             | tokens of the generic masks (`omgrpo.core.masks`)                              |
| loss        | replacement of verl's `ppo_loss`: the KL term weighted by w on answer tokens   |
|             | (and 0 on the generic masks' tokens); the DAPO options' kept rows              |
| dapo        | the DAPO options (`omgrpo.core.dapo`): overlong penalty in the rewards before  |
|             | verl's GRPO step, the rows the loss keeps in verl's `loss_mask`                |
| record      | `RolloutRecord`: the typed record each rollout carries from agent loop to metrics |
| metrics     | the step's `StepBatch` from the rollouts' records -> `omgrpo.core.step.step_metrics` |
| trainer     | the `omgrpo` V1 trainer (sync mode) wiring the above                           |
| config      | the `omgrpo` config section and composing verl's `ppo_trainer` with a preset   |
| launch      | `omgrpo train backend=verl ...` (`--dry-run` prints the composed config)       |
| data        | problems as verl's RL parquet rows (the toy world's for the smoke / CPU tests)  |
| smoke       | GPU smoke test (`scripts/gpu_smoke.sh`) and its checks of a run's logged metrics |

Nothing here imports verl at package import time, so `omgrpo.backends.verl.config` can explain
a missing extra instead of failing with an ImportError.
"""

VERL_VERSION = "0.9.1"
"""The one verl release this plugin is written and tested against (pinned by `omgrpo[verl]`)."""

ANSWER_MASK_KEY = "omgrpo_answer_mask"
"""Per-token field (response length, int64) set by the agent loop: 1 on answer-span tokens."""

TOKEN_MASK_KEY = "omgrpo_token_mask"
"""Per-token field (response length, int64) set by the driver's advantage step with a generic
mask on (`omgrpo.core.masks`): 1 on the tokens taken out of training (weight 0 in the PG and KL
terms)."""

SPAN_MASK_PREFIX = "omgrpo_span_"
"""Per-token fields `omgrpo_span_<span>` (response length, int64) set by the agent loop with a
generic mask on: 1 on the tokens of a span the masks read (`omgrpo.core.masks.mask_spans`)."""


def span_mask_key(span: str) -> str:
    """The field holding `span`'s token mask (`SPAN_MASK_PREFIX`)."""
    return SPAN_MASK_PREFIX + span


FORMAT_SCORE_KEY = "omgrpo_format"
"""Per-rollout field (float32): the format reward, for the format-only advantage."""

TRUNCATED_KEY = "omgrpo_truncated"
"""Per-rollout field (int64, 0/1) set by the agent loop with `algorithm.overlong_filter` on: 1
when the response was cut by the length limit (`omgrpo.core.dapo.truncated_rows`)."""

RECORD_KEY = "omgrpo"
"""Key in a rollout's `extra_fields` holding what the driver's diagnostics need."""

__all__ = [
    "ANSWER_MASK_KEY",
    "FORMAT_SCORE_KEY",
    "RECORD_KEY",
    "SPAN_MASK_PREFIX",
    "TOKEN_MASK_KEY",
    "TRUNCATED_KEY",
    "VERL_VERSION",
    "span_mask_key",
]
