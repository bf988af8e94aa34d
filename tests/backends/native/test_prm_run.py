"""`method=prm` end to end on the tiny toy config, with a toy PRM trained for a few steps: the
PRM's step scores reach the reward, the metrics and the rollouts table; the PRM never trains."""

import pytest
import torch

from omgrpo.backends.native.run import setup
from omgrpo.backends.native.trainer import LoopState, train, train_step
from omgrpo.config import compose
from omgrpo.core.process import split_steps
from omgrpo.tracking.store import RunStore

pytestmark = pytest.mark.slow

PRM = ["method=prm", "reward.prm.toy.steps=3", "reward.prm.toy.check_problems=8"]


def test_a_prm_run_logs_step_scores(tiny_overrides, metric_table):
    run = train(compose([*tiny_overrides, *PRM, "trainer.steps=2", "reward.prm.aggregate=mean"]))
    metrics = RunStore(run).read_metrics()
    last = metrics.iloc[-1]
    for name in ("reward/process", "prm/step_score_mean", "prm/aggregate_mean"):
        assert 0.0 <= last[name] <= 1.0, name
    assert last["prm/unscored_share"] == 0.0
    assert metric_table.undocumented(set(metrics.columns), "native") == []
    rollouts = RunStore(run).read_rollouts()
    for text, scores, reward in zip(
        rollouts["text"], rollouts["prm_step_scores"], rollouts["reward_process"]
    ):
        values = [float(x) for x in scores.split()]
        assert len(values) == len(split_steps(text))  # one score per line of the response
        mean = sum(values) / len(values) if values else 0.0
        assert reward == pytest.approx(mean, abs=1e-4)  # scores are logged to 4 decimals


def test_the_prm_never_trains(tiny_overrides):
    """After an update the policy has moved, the PRM has not: frozen, in eval mode, and none of
    its tensors in the optimizer."""
    run = setup(compose([*tiny_overrides, *PRM, "run.name=frozen", "optim.lr=1e-2"]))
    prm_before = {k: v.clone() for k, v in run.prm.model.state_dict().items()}
    policy_before = {k: v.clone() for k, v in run.policy.state_dict().items()}
    train_step(run, LoopState(step=1), run.train_problems[:2])
    prm_after = run.prm.model.state_dict()
    assert all(torch.equal(prm_before[k], prm_after[k]) for k in prm_before)
    assert any(not torch.equal(policy_before[k], v) for k, v in run.policy.state_dict().items())
    assert not run.prm.model.training
    assert not any(p.requires_grad for p in run.prm.model.parameters())
    in_optimizer = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for p in run.prm.model.parameters()}


def test_a_real_run_must_name_its_prm(tiny_overrides, tmp_path):
    cfg = compose([*tiny_overrides, *PRM, f"reward.prm.path={tmp_path / 'missing'}"])
    with pytest.raises(FileNotFoundError, match=r"reward\.prm\.path"):
        setup(cfg)
