"""Test-only: a reward part that differs between the rollouts of every group, by construction.

The end-to-end checks (`omgrpo.backends.verl.smoke.check_run`) need a step whose advantages
have both signs: only then does `pg/answer_weight_share` say anything (exactly 0 at w = 0,
> 0 at w = 1), and only then does an update move the policy (the KL of step 2, the exported
weights). With the methods' own rewards that depends on sampling: a toy base can give all G
rollouts of a prompt the same answer, and then the soft vote, the majority vote, GT and format
tie within the group. The harness therefore adds `harness_spread` to the tested runs'
`reward.parts`: rollout i of a group gets i * 1e-3. A group's total rewards are then never all
equal, so GRPO's advantages have both signs in every group (the tested methods' parts move in
steps of at least 1/64, more than the spread's 0.007 over G = 8; the PRM's scores are
continuous), while the methods' parts still dominate where they differ. Each part is logged on
its own (`reward/<part>`), so the methods' parts are checked as before.

Loaded in every verl process through `VERL_USE_EXTERNAL_MODULES` (after the plugin), the driver
included (its config composition imports verl before `validate_section` runs): it registers the
reward and adds it to the verl backend's supported parts. No product code knows of it.
"""

from __future__ import annotations

from omgrpo.backends.verl import config as verl_config
from omgrpo.core.rewards import RewardGroup, register_reward

NAME = "harness_spread"
STEP = 1e-3


@register_reward(NAME)
def harness_spread(group: RewardGroup) -> list[float]:
    """i * STEP for rollout i of the group: G distinct values."""
    return [STEP * i for i in range(group.size)]


if NAME not in verl_config.SUPPORTED_REWARDS:
    verl_config.SUPPORTED_REWARDS = (*verl_config.SUPPORTED_REWARDS, NAME)
