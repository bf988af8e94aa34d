"""verl presets, the `omgrpo` section, the dry-run CLI and the trainer's wiring (CPU, real verl).

Every preset in experiments/verl/ composes with verl's own `ppo_trainer` config, passes verl's
`validate_config`, converts to verl's dataclasses, and carries the paper's hyperparameters
(appendix "Implementation Details").
"""

from __future__ import annotations

try:
    import verl  # noqa: F401
except ModuleNotFoundError as exc:  # CI runs these with real verl: say how to get it
    raise ModuleNotFoundError(
        "tests/test_verl_*.py need verl: install with pip install -e '.[dev,verl]' (or make setup)"
    ) from exc

import pytest
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.utils.config import omega_conf_to_dataclass

from omgrpo import cli
from omgrpo.backends.verl.config import (
    AGENT_LOOP_MANAGER,
    available_presets,
    compose_verl,
    missing_keys,
)
from omgrpo.backends.verl.launch import check_verl
from omgrpo.backends.verl.loss import omgrpo_ppo_loss
from omgrpo.backends.verl.trainer import OmgrpoTrainer, validation_aliases
from omgrpo.core.answers import Grader
from omgrpo.errors import InputError

PRESETS = ["paper_llama3p2_3b", "paper_qwen2p5_7b", "paper_qwen3_1p7b"]
LAUNCH = [
    "actor_rollout_ref.model.path=/models/m",
    "data.train_files=train.parquet",
    "data.val_files=val.parquet",
]


def test_the_three_backbones_have_presets():
    # each also on one 80 GB GPU (tests/models/test_verl_memory.py)
    assert available_presets() == sorted([*PRESETS, *(f"{p}_1gpu" for p in PRESETS)])


@pytest.fixture(scope="module", params=PRESETS)
def preset_cfg(request):
    return request.param, compose_verl(request.param, LAUNCH)


@pytest.mark.slow
def test_preset_has_the_papers_hyperparameters(preset_cfg):
    name, cfg = preset_cfg
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert cfg.data.train_batch_size == 128 and rollout.n == 8
    assert cfg.data.max_prompt_length == 512 and cfg.data.max_response_length == 3072
    assert cfg.trainer.total_epochs == 6
    optim = actor.optim
    assert optim.optimizer == "AdamW" and optim.lr == pytest.approx(3e-6)
    assert list(optim.betas) == [0.9, 0.999] and optim.override_optimizer_config.eps == 1e-8
    assert optim.lr_scheduler_type == "cosine" and optim.lr_warmup_steps_ratio == 0.1
    assert actor.use_kl_loss and actor.kl_loss_coef == 0.005 and actor.kl_loss_type == "low_var_kl"
    assert actor.clip_ratio == actor.clip_ratio_low == actor.clip_ratio_high == 0.2
    assert actor.loss_agg_mode == "token-mean" and actor.entropy_coeff == 0
    # entropy/answer|reasoning come from the old-log-prob pass: no entropy in the update graph
    assert not actor.calculate_entropy
    # 32 prompts x G = 256 rollouts per optimizer step, the native paper preset's mini-batch
    assert actor.ppo_mini_batch_size * rollout.n == 256
    assert actor.policy_loss.loss_mode == "vanilla"
    assert cfg.reward.custom_reward_function.reward_kwargs.math_verify is True
    assert rollout.name == "vllm" and rollout.temperature == 1.0 and rollout.top_p == 1.0
    assert rollout.val_kwargs.temperature == 0.8 and rollout.val_kwargs.top_p == 0.95
    assert rollout.val_kwargs.do_sample
    assert rollout.agent.agent_loop_manager_class == AGENT_LOOP_MANAGER
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_in_reward
    assert cfg.trainer.v1.trainer_mode == "omgrpo"
    assert cfg.reward.custom_reward_function.path == "pkg://omgrpo.backends.verl.reward"
    om = cfg.omgrpo
    assert om.method == "om_grpo" and om.algorithm.answer_weight == 0.0 and om.car.enable
    assert list(om.reward.parts) == ["soft_vote", "format"]
    assert cfg.trainer.experiment_name == f"{name}__om_grpo__s0"


def test_preset_passes_verls_own_checks(preset_cfg):
    _, cfg = preset_cfg
    check_verl(cfg)  # verl.utils.config.validate_config, as main_ppo runs it
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    algo = omega_conf_to_dataclass(cfg.algorithm)
    assert (
        actor.kl_loss_coef == 0.005 and rollout.val_kwargs.n == 4 and algo.adv_estimator == "grpo"
    )
    assert rollout.agent.agent_loop_manager_class == AGENT_LOOP_MANAGER


@pytest.mark.slow
def test_method_presets_land_in_the_omgrpo_section():
    cfg = compose_verl("paper_qwen3_1p7b", ["method=om_grpo_no_car_n16"])
    assert cfg.omgrpo.method == "om_grpo_no_car_n16" and not cfg.omgrpo.car.enable
    assert cfg.actor_rollout_ref.rollout.n == 16  # G follows the method preset
    cfg = compose_verl(
        "paper_qwen3_1p7b", ["method=om_grpo_format_only", "omgrpo.car.max_new_tokens=12"]
    )
    assert cfg.omgrpo.algorithm.format_only and cfg.omgrpo.car.max_new_tokens == 12
    assert missing_keys(cfg) == [
        "actor_rollout_ref.model.path",
        "data.train_files",
        "data.val_files",
    ]


@pytest.mark.slow
def test_unsupported_or_bad_values_fail_with_the_key():
    with pytest.raises(ValueError, match=r"omgrpo\.reward\.parts.*self_certainty"):
        compose_verl("paper_qwen3_1p7b", ["method=self_certainty"])
    # one range for w on both backends (omgrpo.config.validate_algorithm): w >= 0
    with pytest.raises(ValueError, match=r"omgrpo\.algorithm\.answer_weight must be >= 0"):
        compose_verl("paper_qwen3_1p7b", ["omgrpo.algorithm.answer_weight=-0.5"])
    cfg = compose_verl("paper_qwen3_1p7b", ["omgrpo.algorithm.answer_weight=1.5"])
    assert cfg.omgrpo.algorithm.answer_weight == 1.5  # as the native trainer accepts
    with pytest.raises(ValueError, match=r"omgrpo\.algorithm\.agg 'mean'"):
        compose_verl("paper_qwen3_1p7b", ["omgrpo.algorithm.agg=mean"])
    with pytest.raises(ValueError, match=r"omgrpo\.algorithm\.answer_span 'last'"):
        compose_verl("paper_qwen3_1p7b", ["omgrpo.algorithm.answer_span=last"])
    # the agent loop builds its answer masks with the section's span (the method preset's)
    closing = compose_verl("paper_qwen3_1p7b", ["method=om_grpo_no_car_closing"])
    assert closing.omgrpo.algorithm.answer_span == "closing"
    # an algorithm key verl holds in its own actor config would be ignored: say where it is
    with pytest.raises(ValueError, match=r"kl_coef=0.1 .*actor_rollout_ref\.actor\.kl_loss_coef"):
        compose_verl("paper_qwen3_1p7b", ["omgrpo.algorithm.kl_coef=0.1"])
    with pytest.raises(ValueError, match=r"trainer\.v1\.trainer_mode"):
        compose_verl("paper_qwen3_1p7b", ["trainer.v1.trainer_mode=sync"])
    with pytest.raises(InputError, match="paper_qwen3_1p7b"):
        compose_verl("paper_qwen3", [])


@pytest.mark.slow
def test_every_refusal_of_the_section_is_an_input_error():
    """compose_verl's refusals are InputErrors (a clean exit 2 from `omgrpo train` and `omgrpo
    plan backend=verl`, which printed a traceback for them): the native ranges of the keys the
    section shares (named omgrpo.<key>) and the verl keys `validate_config` lets through."""
    for override, key in [
        ("seed=-1", "omgrpo.seed (found -1"),
        ("omgrpo.collapse.patience=0", "omgrpo.collapse.patience (found 0"),
        ("omgrpo.rollout.n=0", "omgrpo.rollout.n (found 0"),
        ("omgrpo.run.log_rollouts_every=0", "omgrpo.run.log_rollouts_every (found 0"),
        ("data.train_batch_size=0", "data.train_batch_size (found 0"),
        ("actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.top_p (found 1.5"),
        ("omgrpo.algorithm.answer_weight=-1", "omgrpo.algorithm.answer_weight must be >= 0"),
    ]:
        with pytest.raises(InputError) as caught:
            compose_verl("paper_qwen3_1p7b", [override])
        assert key in str(caught.value), override


@pytest.mark.parametrize("method", ["prm", "prm_om"])
@pytest.mark.slow
def test_the_prm_methods_compose_and_pass_verls_own_checks(method):
    """The process reward on verl: the method preset lands in the `omgrpo` section, the config
    passes verl's validate_config and dataclasses; the PRM actor's resources default to the CPU."""
    path = "/models/math-shepherd-mistral-7b-prm"
    cfg = compose_verl(
        "paper_qwen3_1p7b",
        [*LAUNCH, f"method={method}", f"omgrpo.reward.prm.path={path}"],
    )
    check_verl(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.kl_loss_coef == 0.005
    om = cfg.omgrpo
    assert list(om.reward.parts) == ["process", "format"] and om.reward.prm.path == path
    assert om.algorithm.answer_weight == (1.0 if method == "prm" else 0.0) and not om.car.enable
    assert (om.prm_server.num_gpus, om.prm_server.num_cpus) == (0.0, 1.0)
    with pytest.raises(ValueError, match=r"omgrpo\.reward\.prm\.path is null.*toy PRM"):
        compose_verl("paper_qwen3_1p7b", [f"method={method}"])
    with pytest.raises(ValueError, match=r"aggregate 'median'.*min, last, mean, product"):
        compose_verl(
            "paper_qwen3_1p7b",
            [
                f"method={method}",
                f"omgrpo.reward.prm.path={path}",
                "omgrpo.reward.prm.aggregate=median",
            ],
        )


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("actor_rollout_ref.actor.entropy_coeff=0.001", r"entropy_coeff must be 0.*answer tokens"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", r"loss_mode must be 'vanilla'"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", r"loss_mode.*'clip_cov'"),
        ("algorithm.use_kl_in_reward=true", r"use_kl_in_reward must be false.*masking"),
        ("actor_rollout_ref.rollout.n=4", r"actor_rollout_ref\.rollout\.n=4.*omgrpo\.rollout\.n=8"),
        ("omgrpo.rollout.n=1", r"omgrpo\.rollout\.n \(found 1; expected an integer >= 2\)"),
        ("omgrpo.algorithm.adv_eps=1e-4", r"omgrpo\.algorithm\.adv_eps must be 1e-06"),
    ],
)
@pytest.mark.slow
def test_settings_that_undo_outcome_masking_are_rejected(override, match):
    with pytest.raises(ValueError, match=match):
        compose_verl("paper_qwen3_1p7b", [override])


@pytest.mark.slow
def test_format_only_needs_std_normalised_grpo():
    compose_verl("paper_qwen3_1p7b", ["algorithm.norm_adv_by_std_in_grpo=false"])  # allowed
    with pytest.raises(ValueError, match=r"norm_adv_by_std_in_grpo=false.*format_only"):
        compose_verl(
            "paper_qwen3_1p7b",
            ["method=om_grpo_format_only", "algorithm.norm_adv_by_std_in_grpo=false"],
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["experiment=paper_qwen3"], "no verl preset 'paper_qwen3'"),
        (
            ["experiment=paper_qwen3_1p7b", "algorithm.use_kl_in_reward=true"],
            "use_kl_in_reward must be false",
        ),
    ],
)
@pytest.mark.slow
def test_cli_reports_bad_presets_and_settings(capsys, args, message):
    code = cli.main(["train", "backend=verl", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("omgrpo train backend=verl: ") and message in err


@pytest.mark.slow
def test_dry_run_prints_the_composed_config_without_ray(capsys):
    import ray

    code = cli.main(["train", "backend=verl", "experiment=paper_llama3p2_3b", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and not ray.is_initialized()
    for line in (
        "trainer_mode: omgrpo",
        "name: vllm",
        "kl_loss_coef: 0.005",
        "train_batch_size: 128",
        "max_response_length: 3072",
        "experiment_name: paper_llama3p2_3b__om_grpo__s0",
        "answer_weight: 0.0",
    ):
        assert line in out, line
    assert "# to launch, also set: actor_rollout_ref.model.path=" in out


@pytest.mark.slow
def test_launch_without_required_keys_stops_before_ray(capsys):
    import ray

    code = cli.main(["train", "backend=verl", "experiment=paper_qwen3_1p7b"])
    assert code == 2 and not ray.is_initialized()
    assert "set actor_rollout_ref.model.path" in capsys.readouterr().err


@pytest.mark.slow
def test_launch_runs_verls_run_ppo_with_the_composed_config(monkeypatch):
    """Without --dry-run the CLI hands the composed config to verl's run function (stubbed
    here: a real run needs Ray, GPUs and vLLM)."""
    import verl.trainer.main_ppo as main_ppo

    calls = []
    monkeypatch.setattr(
        main_ppo, "run_ppo", lambda cfg, task_runner_class: calls.append((cfg, task_runner_class))
    )
    code = cli.main(["train", "backend=verl", "experiment=paper_qwen3_1p7b", "method=mv", *LAUNCH])
    assert code == 0 and len(calls) == 1
    cfg, runner = calls[0]
    assert runner is main_ppo.TaskRunnerV1
    assert cfg.trainer.v1.trainer_mode == "omgrpo" and cfg.omgrpo.method == "mv"
    assert cfg.actor_rollout_ref.model.path == "/models/m"


@pytest.mark.slow
def test_two_seeds_get_two_checkpoint_folders_and_their_own_shuffle_seeds():
    runs = {
        seed: compose_verl("paper_qwen3_1p7b", [*LAUNCH, *args])
        for seed, args in ((0, []), (1, ["seed=1"]), (7, ["omgrpo.seed=7"]))
    }
    folders = {seed: cfg.trainer.default_local_dir for seed, cfg in runs.items()}
    assert folders[0] == "runs/paper_qwen3_1p7b__om_grpo__s0/checkpoints"
    assert folders[1] == "runs/paper_qwen3_1p7b__om_grpo__s1/checkpoints"
    assert len(set(folders.values())) == 3
    for seed, cfg in runs.items():
        assert cfg.omgrpo.seed == seed and cfg.trainer.experiment_name.endswith(f"__s{seed}")
        assert cfg.data.seed == seed  # verl's shuffle (create_rl_sampler's generator seed)
        assert cfg.actor_rollout_ref.rollout.seed == seed
        assert cfg.actor_rollout_ref.actor.data_loader_seed == seed
        check_verl(cfg)
    # a run name without the seed would let seeds share a folder again
    with pytest.raises(ValueError, match=r"does not name the seed \(__s1\)"):
        compose_verl("paper_qwen3_1p7b", [*LAUNCH, "seed=1", "trainer.experiment_name=mine"])
    with pytest.raises(ValueError, match=r"data\.seed=3 but omgrpo\.seed=0"):
        compose_verl("paper_qwen3_1p7b", [*LAUNCH, "data.seed=3"])


@pytest.mark.slow
def test_run_resume_sets_verls_resume_mode():
    def mode(*args):
        return compose_verl("paper_qwen3_1p7b", [*LAUNCH, *args]).trainer.resume_mode

    assert mode() == "auto"  # run.resume=auto, the default: continue the run there, if any
    assert mode("run.resume=auto") == "auto"
    assert mode("run.resume=false") == "disable"
    assert mode("run.resume=true") == "auto"
    assert mode("omgrpo.run.resume=true") == "auto"
    path = "trainer.resume_from_path=checkpoints/x/global_step_5"
    assert mode("run.resume=true", "trainer.resume_mode=resume_path", path) == "resume_path"
    with pytest.raises(ValueError, match=r"resume_mode=auto with omgrpo\.run\.resume=false"):
        mode("run.resume=false", "trainer.resume_mode=auto")
    with pytest.raises(ValueError, match=r"trainer\.resume_mode=disable with omgrpo\.run\.resume"):
        mode("run.resume=true", "trainer.resume_mode=disable")
    with pytest.raises(ValueError, match=r"run\.resume='sometimes': use auto, true or false"):
        mode("run.resume=sometimes")


@pytest.mark.slow
def test_a_fresh_launch_refuses_a_used_checkpoint_folder(tmp_path, monkeypatch, capsys):
    import verl.trainer.main_ppo as main_ppo

    calls = []
    monkeypatch.setattr(main_ppo, "run_ppo", lambda cfg, task_runner_class: calls.append(cfg))
    folder = tmp_path / "ckpt"
    args = ["train", "backend=verl", "experiment=paper_qwen3_1p7b", *LAUNCH]
    # seed 0's folder holds a verl checkpoint (the folder keeps the run name, as the check asks)
    args.append(f"trainer.default_local_dir={folder}/${{trainer.experiment_name}}")
    used = folder / "paper_qwen3_1p7b__om_grpo__s0"
    (used / "global_step_5").mkdir(parents=True)
    (used / "latest_checkpointed_iteration.txt").write_text("5")
    assert cli.main([*args, "run.resume=false"]) == 2 and calls == []
    err = capsys.readouterr().err
    assert f"{used} already holds a run" in err and "run.resume=auto" in err
    assert cli.main([*args, "seed=1", "run.resume=false"]) == 0  # seed 1: its own, empty folder
    assert cli.main([*args, "run.resume=true"]) == 0  # continues seed 0's checkpoint
    assert cli.main(args) == 0  # so does the default, run.resume=auto
    assert [c.trainer.resume_mode for c in calls] == ["disable", "auto", "auto"]


@pytest.mark.slow
def test_trainer_stays_in_sync_mode_and_installs_the_loss():
    cfg = compose_verl("paper_qwen3_1p7b", [*LAUNCH, "omgrpo.algorithm.answer_weight=0.25"])
    trainer = OmgrpoTrainer(cfg)  # no Ray: the workers are built later, in init()
    assert trainer.trainer_mode == "sync"
    assert type(trainer.replay_buffer) is ReplayBuffer
    assert not isinstance(trainer.replay_buffer, ReplayBufferAsync)
    loss_fn = trainer.make_loss_fn()
    assert loss_fn.func is omgrpo_ppo_loss and loss_fn.keywords["answer_weight"] == 0.25
    assert loss_fn.keywords["config"].kl_loss_coef == 0.005
    # a separate KL weight on answer tokens reaches the loss; the PG weight w stays 0.25
    anchored = compose_verl("paper_qwen3_1p7b", [*LAUNCH, "method=om_grpo_kl_anchor"])
    assert anchored.omgrpo.algorithm.answer_weight == 0.0
    assert OmgrpoTrainer(anchored).make_loss_fn().keywords["answer_weight"] == 1.0


@pytest.mark.slow
def test_math_verify_switch_reaches_driver_and_reward_workers():
    cfg = compose_verl("paper_qwen3_1p7b", [*LAUNCH, "omgrpo.reward.math_verify=false"])
    assert cfg.reward.custom_reward_function.reward_kwargs.math_verify is False
    trainer = OmgrpoTrainer(cfg)  # the driver's metrics grade with a Grader from its section
    assert Grader.from_config(trainer.omgrpo.reward).math_verify is False


def test_validation_metric_names():
    """`val/acc` and `val/pass@<k>` from the per-sample `acc`, as the native trainer defines
    them (pass@k: any of a prompt's k samples correct; verl's bootstrap best@4 would give
    1 - (3/4)^4 = 0.68 for prompt b), averaged over data sources."""
    sources = ["math"] * 8 + ["aime"] * 4
    uids = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    acc = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    got = validation_aliases(sources, uids, {"acc": acc, "score": [0.0] * 12})
    # math: acc (0.75 + 0.25) / 2, pass (1 + 1) / 2; aime: 0 and 0
    assert got == pytest.approx({"val/acc": 0.25, "val/pass@4": 0.5})
    assert validation_aliases(sources, uids, {"score": [0.0] * 12}) == {}


@pytest.mark.slow
def test_the_generic_masks_reach_the_section_and_bad_values_name_the_key():
    default = compose_verl("paper_qwen3_1p7b").omgrpo.algorithm
    assert default.top_entropy_quantile is None and default.random_mask is None
    for method, key, value in [
        ("om_grpo_no_car_closing_only", "answer_span", "closing_only"),
        ("om_grpo_no_car_top_entropy", "top_entropy_quantile", 0.2),
        ("om_grpo_no_car_random_mask", "random_mask", "boxed"),
    ]:
        algo = compose_verl("paper_qwen3_1p7b", [f"method={method}"]).omgrpo.algorithm
        assert algo[key] == value, method
    with pytest.raises(ValueError, match=r"omgrpo\.algorithm\.top_entropy_quantile must be in"):
        compose_verl("paper_qwen3_1p7b", ["omgrpo.algorithm.top_entropy_quantile=1.5"])
    with pytest.raises(ValueError, match=r"unknown omgrpo\.algorithm\.random_mask 'last'"):
        compose_verl("paper_qwen3_1p7b", ["omgrpo.algorithm.random_mask=last"])
    # the entropy mask reads verl's old-log-prob pass, which bypass mode skips
    with pytest.raises(ValueError, match=r"top_entropy_quantile.*bypass_mode"):
        compose_verl(
            "paper_qwen3_1p7b",
            ["method=om_grpo_no_car_top_entropy", "algorithm.rollout_correction.bypass_mode=true"],
        )
