"""The native trainer end to end on a tiny toy config: resume, bad input, NaN handling."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from omgrpo.backends.native import trainer as trainer_module
from omgrpo.backends.native import update as update_module
from omgrpo.backends.native.trainer import train
from omgrpo.config import compose
from omgrpo.tracking.store import RunStore

pytestmark = pytest.mark.slow

VOLATILE = ("time/", "mem/", "perf/")

# Self-Certainty beside OM-GRPO's vote and format parts: a continuous reward, so every group
# has reward spread and every step updates the weights and the optimizer state a resume must
# restore (the 5-step tiny base earns the vote and format parts 0 everywhere on some machines:
# nothing trains, and a resume that lost the weights or the optimizer state still matched)
SPREAD = "reward.parts=[soft_vote,format,self_certainty]"


def _metrics(run_dir):
    df = RunStore(run_dir).read_metrics()
    return df[[c for c in df.columns if not c.startswith(VOLATILE)]]


def test_resume_continues_a_killed_run_exactly(tiny_overrides):
    common = [*tiny_overrides, "trainer.steps=4", "trainer.save_every=2", SPREAD]
    full = train(compose([*common, "run.name=full"]))
    killed = train(compose([*common, "run.name=killed"]), stop_after=3)  # dies after step 3
    assert RunStore(killed).latest_checkpoint().name == "step_000002"
    resumed = train(compose([*common, "run.name=killed", "run.resume=true"]))
    assert resumed == killed
    a, b = _metrics(full), _metrics(resumed)
    assert list(a["train/step"]) == [0, 1, 2, 3, 4]
    assert (a["grad/norm"].dropna() > 0).all() and a["grad/norm"].count() == 4  # it trained
    pd.testing.assert_frame_equal(a, b)
    assert RunStore(resumed).read_status()["state"] == "finished"


def test_resume_refuses_a_checkpoint_from_another_config(tiny_overrides):
    common = [*tiny_overrides, "trainer.steps=2", "run.name=x"]
    train(compose(common))
    with pytest.raises(ValueError, match=r"algorithm.kl_coef: 0.005 -> 0.1"):
        train(compose([*common, "run.resume=true", "algorithm.kl_coef=0.1"]))


def test_refuses_to_overwrite_a_run_with_resume_false(tiny_overrides):
    cfg = compose([*tiny_overrides, "trainer.steps=1", "run.name=y", "run.resume=false"])
    train(cfg)
    with pytest.raises(FileExistsError, match=r"run\.resume=auto"):
        train(cfg)


def test_unknown_reward_is_rejected_before_any_work(tiny_overrides):
    with pytest.raises(ValueError, match="unknown reward 'votes'; valid rewards: coreward"):
        train(compose([*tiny_overrides, "reward.parts=[votes]"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.agg=mean", "unknown algorithm.agg 'mean'; valid: token-mean"),
        ("task.name=gsm", "unknown task 'gsm'; valid tasks: files, toy"),
        ("rollout.n=1", "rollout.n must be >= 2"),
        ("algorithm.answer_weight=-1", "answer_weight must be >= 0"),
        ("rollout.max_batch_tokens=0", "rollout.max_batch_tokens must be >= 1 or null"),
        ("algorithm.top_entropy_quantile=1.5", r"top_entropy_quantile must be in \(0, 1\]"),
        ("algorithm.random_mask=last", "unknown algorithm.random_mask 'last'"),
    ],
)
def test_bad_config_values_fail_fast(tiny_overrides, override, message):
    with pytest.raises(ValueError, match=message):
        train(compose([*tiny_overrides, override]))


def test_unknown_preset_lists_the_valid_ones():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match=r"(?s)Available options in 'method'.*om_grpo"):
        compose(["method=nope"])


def test_nan_loss_skips_the_step_then_aborts_after_three(tiny_overrides, tmp_path, monkeypatch):
    real = update_module.step_loss
    calls = {"n": 0}

    def nan_on_first_call(*args, **kwargs):
        calls["n"] += 1
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] == 1 else loss), metrics

    monkeypatch.setattr(update_module, "step_loss", nan_on_first_call)
    run = train(compose([*tiny_overrides, "trainer.steps=3", "run.name=one-nan"]))
    df = RunStore(run).read_metrics()
    assert list(df["train/skipped_steps"].dropna()) == [1, 1, 1]

    def always_nan(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(update_module, "step_loss", always_nan)
    with pytest.raises(FloatingPointError, match="NaN/inf for 3 steps in a row"):
        train(compose([*tiny_overrides, "trainer.steps=5", "run.name=all-nan"]))
    # step 3 failed; status.json's `step` (and the error's) is the last one that completed
    status = RunStore(tmp_path / "runs" / "all-nan").read_status()
    assert status["state"] == "failed" and status["reason"] == "non-finite loss"
    assert (status["step"], status["failed_step"], status["error"]["step"]) == (2, 3, 2)


def test_untrained_model_garbage_never_crashes(tiny_overrides):
    # No warm start: responses are random characters, mostly without a boxed answer.
    run = train(
        compose([*tiny_overrides, "model.warm_start.steps=0", "trainer.steps=2", "run.name=z"])
    )
    df = RunStore(run).read_metrics()
    assert df["answers/extract_rate"].dropna().max() < 0.5
    rollouts = RunStore(run).read_rollouts()
    assert rollouts.loc[rollouts["answer"].isna(), "reward_format"].eq(0).all()


@pytest.mark.parametrize("method", ["gt", "mv", "self_certainty", "entropy", "coreward"])
def test_every_baseline_method_trains(tiny_overrides, method):
    run = train(compose([*tiny_overrides, f"method={method}", "trainer.steps=1"]))
    row = RunStore(run).read_metrics().iloc[-1]
    part = {"mv": "majority_vote"}.get(method, method)
    assert f"reward/{part}" in row and pd.notna(row[f"reward/{part}"])
    assert run.name == f"toy__{method}__s0"


def test_test_time_training_trains_on_the_evaluation_split(tiny_overrides):
    run = train(compose([*tiny_overrides, "task.ttt=true", "trainer.steps=1", "run.name=ttt"]))
    rollouts = RunStore(run).read_rollouts()
    assert rollouts["prompt_id"].str.startswith("test-").all()


def test_rollouts_table_has_the_documented_columns(tiny_overrides):
    run = train(compose([*tiny_overrides, "trainer.steps=1", "run.name=cols"]))
    cols = set(RunStore(run).read_rollouts().columns)
    expected = {"step", "prompt_id", "text", "answer", "label", "correct", "reward", "advantage"}
    assert expected | {"reward_soft_vote", "reward_format"} <= cols


@pytest.mark.e2e
def test_cli_train_end_to_end(tiny_overrides, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "omgrpo", "train", *tiny_overrides, "trainer.steps=2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "toy__om_grpo__s0"
    assert "run finished" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in rows] == [0, 1, 2]
    assert {"reward/soft_vote", "reward/format", "kl/answer", "time/gen"} <= set(rows[1])
    assert (run_dir / "config.yaml").exists()
    assert (run_dir / "checkpoints" / "step_000002" / "COMPLETE").exists()
    state = torch.load(run_dir / "checkpoints/step_000002/state.pt", weights_only=False)
    assert state["config"]["algorithm"]["answer_weight"] == 0.0


def test_collapse_detector_ends_the_run_cleanly(tiny_overrides):
    # thresholds any batch meets: detection at step 2 (patience 2), then a clean stop
    run = train(
        compose(
            [
                *tiny_overrides,
                "trainer.steps=5",
                "run.name=col",
                "collapse.max_unique_per_prompt=100",
                "collapse.min_mode_share=0",
                "collapse.patience=2",
                "collapse.stop=true",
            ]
        )
    )
    df = RunStore(run).read_metrics()
    assert list(df["train/step"]) == [0, 1, 2]
    assert df["collapse/detected_step"].dropna().tolist() == [2]
    assert RunStore(run).read_status()["state"] == "collapsed"
    assert {
        "answers/confidently_wrong",
        "answers/label_flip_rate",
        "answers/grading_timeouts",
        "recovery/zero_pass_prompts",
    } <= set(df.columns)
    assert df["answers/grading_timeouts"].dropna().eq(0).all()  # integer answers: exact path


def test_car_enlarges_the_pool_but_not_the_training_batch(tiny_overrides):
    run = train(
        compose(
            [
                *tiny_overrides,
                "car.enable=true",
                "car.max_new_tokens=4",
                "trainer.steps=1",
                "run.name=car",
            ]
        )
    )
    row = RunStore(run).read_metrics().iloc[-1]
    G, prompts = 4, 2
    assert row["car/num_pairs"] == prompts * G * (G - 1)
    assert G <= row["car/pool_size"] <= G + G * (G - 1)
    assert {"time/car", "car/position_bias", "car/top_vote_acc", "answers/top_vote_acc"} <= set(
        row.index
    )
    rollouts = RunStore(run).read_rollouts()
    assert len(rollouts) == prompts * G  # pair answers are validators, never trained on


def test_peak_rss_is_kib_on_linux_and_bytes_on_macos():
    # getrusage's ru_maxrss: KiB on Linux, bytes on macOS; 3 GiB either way
    assert trainer_module.max_rss_gib(3 * 2**20, platform="linux") == 3.0
    assert trainer_module.max_rss_gib(3 * 2**30, platform="darwin") == 3.0


def test_every_logged_metric_is_in_the_metric_table(tiny_overrides, metric_table):
    """docs/metrics.md documents every name a native run logs (training with CAR and the
    gradient probe, validation); the token-level metrics come per role."""
    run = train(
        compose([*tiny_overrides, "trainer.steps=2", "trainer.grad_probe_every=1", "run.name=m"])
    )
    names = set(RunStore(run).read_metrics().columns)
    assert metric_table.undocumented(names, "native") == []
    roles = ("answer", "reasoning", "result", "format", "other")
    token_level = {f"{m}/{r}" for m in ("kl", "entropy") for r in roles}
    assert token_level | {"answer/frac", "clip/frac", "ratio/mean", "val/pass@2"} <= names
    # process quality and the guess kinds, in training and validation (tasks/test_toy_process.py)
    process = ("line_acc", "informativeness", "support", "chain_acc", "guess_truncated")
    assert {f"{p}/{m}_easy" for p in ("answers", "val") for m in process} <= names
    assert not any(n.endswith(("_sum", "_count")) for n in names)  # only the means are logged


# ----------------------------------------------------------------------------------------------
# Study v4's generic masks, trained: on the shipped toy base (it boxes its answers, so the spans
# the masks read are not empty), 2 prompts x 4 rollouts a step
# ----------------------------------------------------------------------------------------------


def _shipped(tmp_path, base_cache, method, *extra):
    return compose(
        [
            "task.n_val=8",
            "eval.every=0",
            "trainer.prompts_per_step=2",
            "rollout.n=4",
            "trainer.progress=false",
            "tracking.mlflow=false",
            "tracking.wandb=false",
            "optim.lr=1e-4",
            f"model.cache_dir={base_cache}",
            f"run.root={tmp_path / 'runs'}",
            f"method={method}",
            *extra,
        ]
    )


def _trained(run_dir):
    df = RunStore(run_dir).read_metrics()
    assert (df["answers/extract_rate"] > 0.5).all() and df["grad/norm"].notna().all()
    return df


def test_closing_only_masks_the_closing_token_and_eos(tmp_path, base_cache):
    run = train(_shipped(tmp_path, base_cache, "om_grpo_no_car_closing_only", "trainer.steps=1"))
    df = _trained(run)
    # w = 0 on the answer role, which is the closing_only span: what is masked is the answer
    assert (df["mask/frac"] > 0).all()
    assert df["mask/frac"].tolist() == pytest.approx(df["answer/frac"].tolist(), rel=1e-12)
    # the toy BPE's `}.` holds no digit: none of the box's content is masked
    assert (df["mask/answer_overlap"] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_entropy_trains_the_steps_top_fifth(tmp_path, base_cache, temperature):
    cfg = _shipped(
        tmp_path,
        base_cache,
        "om_grpo_no_car_top_entropy",
        "trainer.steps=1",
        f"rollout.temperature={temperature}",
    )
    df = _trained(train(cfg))
    # about 80% of the step's response tokens masked: at most 80% and a token (8 rollouts of
    # >= 10 tokens), fewer when entropies tie at the threshold (the rollouts of a prompt share
    # their first tokens' contexts, so those entropies tie), which are all trained
    assert 0.7 < df["mask/frac"].iloc[0] <= 0.8 + 0.0125
    assert 0 <= df["mask/answer_overlap"].iloc[0] <= 1
    assert df["answer/frac"].iloc[0] > 0  # the answer role is still the paper's span


def test_random_mask_is_the_answers_size_and_resumes_exactly(tmp_path, base_cache, metric_table):
    common = ["trainer.steps=2", "trainer.save_every=1"]
    method = "om_grpo_no_car_random_mask"
    full = train(_shipped(tmp_path, base_cache, method, *common, "run.name=full"))
    df = _trained(full)
    # per rollout as many tokens as its boxed span (the answer role, w = 1 here) holds
    assert df["mask/frac"].tolist() == pytest.approx(df["answer/frac"].tolist(), rel=1e-12)
    assert (df["mask/answer_overlap"] < 0.5).all()  # random tokens are mostly reasoning
    assert metric_table.undocumented(set(df.columns), "native") == []
    # the draw is a function of (seed, step, rollout): a killed run resumes it exactly
    killed = train(_shipped(tmp_path, base_cache, method, *common, "run.name=k"), stop_after=1)
    train(_shipped(tmp_path, base_cache, method, *common, "run.name=k", "run.resume=true"))
    pd.testing.assert_frame_equal(_metrics(full), _metrics(killed))


def test_a_finished_run_from_before_the_mask_keys_is_skipped_not_refused(tiny_overrides):
    """A run whose config.yaml has no `algorithm.top_entropy_quantile` / `random_mask` (written
    before they existed) is the same config as today's, where both are null (off)."""
    cfg = compose([*tiny_overrides, "trainer.steps=1", "run.name=old"])
    run = train(cfg)
    path = run / "config.yaml"
    text = path.read_text()
    old = "".join(
        line
        for line in text.splitlines(keepends=True)
        if not line.lstrip().startswith(("top_entropy_quantile:", "random_mask:"))
    )
    assert old != text
    path.write_text(old)
    assert train(cfg) == run  # skipped: it finished under this config
    assert "skipping" in trainer_module.skip_message(cfg)
    with pytest.raises(ValueError, match=r"algorithm.random_mask: '<absent>' -> 'boxed'"):
        trainer_module.skip_message(
            compose(
                [*tiny_overrides, "trainer.steps=1", "run.name=old", "algorithm.random_mask=boxed"]
            )
        )
