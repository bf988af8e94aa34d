"""The `omgrpo` section of a verl config, and composing verl's `ppo_trainer` with a preset.

A verl preset (`experiments/verl/<name>.yaml`) is verl's own `ppo_trainer` config (found through
`hydra.searchpath: pkg://verl.trainer.config`) with the paper's hyperparameters, plus a new
top-level `omgrpo` section: verl's dataclass-backed sections reject unknown keys, a new top-level
section is left alone. The section's schema is `OmgrpoVerlConfig`; a method preset from
`experiments/method/` (the same files the native trainer uses) is merged into it, so
`method=om_grpo_w050` works for both backends.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field, fields

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from omgrpo.config import (
    EXPERIMENTS_DIR,
    VALUE_RANGES,
    AlgorithmConfig,
    CollapseConfig,
    RewardConfig,
    read_yaml_with_libyaml,
    validate_algorithm,
)
from omgrpo.core.car import CarConfig
from omgrpo.core.process import aggregate
from omgrpo.errors import InputError, MissingDependency, check_int, check_number

VERL_PRESETS_DIR = EXPERIMENTS_DIR / "verl"

SUPPORTED_REWARDS: tuple[str, ...] = ("soft_vote", "format", "majority_vote", "gt", "process")
"""Reward parts the verl backend computes inside the agent loop (`process`: with the PRM actor of
`omgrpo.backends.verl.prm`). self_certainty / entropy need the policy's full token distributions
and coreward a paraphrase group: native trainer only."""

REQUIRED_KEYS: dict[str, str] = {
    "actor_rollout_ref.model.path": "/models/Qwen3-1.7B-Base",
    "data.train_files": "data/math_train.parquet",
    "data.val_files": "data/math500.parquet",
}
"""Keys a launch needs (with an example value); presets leave them null."""


@dataclass
class VerlRunSection:
    experiment: str = "paper"
    """Experiment name (the verl preset); with `variant` and the seed it makes
    trainer.experiment_name (`<experiment>__<variant>__s<seed>`, as the native run name)."""
    variant: str = "om_grpo"
    """Method or ablation (set by the method preset)."""
    root: str = "runs"
    """As the native `run.root` (sweep files set it for both backends): the run store is `<root>/<trainer.experiment_name>/`
    (`omgrpo.backends.verl.run_store`), verl's checkpoints in its `checkpoints/` folder."""
    log_rollouts_every: int = 5
    """As the native `trainer.log_rollouts_every`: write the step's rollouts to the run store
    every N steps (and at step 1)."""
    resume: bool | str = "auto"
    """As the native `run.resume`: `auto` (the default) and true continue the newest checkpoint
    in the run's checkpoint folder, or start where there is none (verl
    `trainer.resume_mode=auto`; true also allows `resume_path` with `trainer.resume_from_path`);
    false starts from scratch (`disable`), and the launch refuses a folder that already holds
    a checkpoint (RESUME_MODES)."""


VERL_ACTOR_KEYS: dict[str, str] = {
    "clip": "actor_rollout_ref.actor.clip_ratio",
    "clip_low": "actor_rollout_ref.actor.clip_ratio_low",
    "clip_high": "actor_rollout_ref.actor.clip_ratio_high",
    "kl_coef": "actor_rollout_ref.actor.kl_loss_coef",
    "agg": "actor_rollout_ref.actor.loss_agg_mode",
    "ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
    "mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
}
"""`AlgorithmConfig` fields verl's own actor config holds on this backend (and where)."""


@dataclass
class VerlRolloutSection:
    n: int = 8
    """G: rollouts per prompt; the presets set actor_rollout_ref.rollout.n to this."""


@dataclass
class VerlPrmServerSection:
    """Ray resources of the PRM actor (`omgrpo.backends.verl.prm`), used with the `process`
    reward."""

    num_gpus: float = 0.0
    """GPUs of the PRM actor, outside verl's resource pools (leave them free: fewer
    `trainer.n_gpus_per_node` than the node has); 0: the PRM runs on the CPU (tiny PRMs,
    tests)."""
    num_cpus: float = 1.0
    """CPUs Ray reserves for it."""


@dataclass
class OmgrpoVerlConfig:
    """The `omgrpo` section of a verl config (method presets use the native trainer's keys)."""

    method: str = "om_grpo"
    """Name of the method preset merged into this section."""
    seed: int = 0
    """As the native `seed` (`seed=N` on the command line): part of trainer.experiment_name and
    so of the checkpoint folder, verl's data shuffle seed (`data.seed`), its rollout sampling
    seed and its mini-batch shuffle seed (presets: experiments/verl/paper.yaml)."""
    run: VerlRunSection = field(default_factory=VerlRunSection)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The native trainer's section; verl reads `answer_weight`, `answer_span` (the agent loop's
    answer masks), `top_entropy_quantile` and `random_mask` (the driver's generic masks),
    `format_only` and `adv_eps` (the others are verl's actor keys, `VERL_ACTOR_KEYS`, and must
    keep their defaults)."""
    rollout: VerlRolloutSection = field(default_factory=VerlRolloutSection)
    car: CarConfig = field(default_factory=CarConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    prm_server: VerlPrmServerSection = field(default_factory=VerlPrmServerSection)


RESUME_MODES: dict[bool | str, tuple[str, ...]] = {
    False: ("disable",),
    True: ("auto", "resume_path"),
    "auto": ("auto",),
}
"""`omgrpo.run.resume` -> the verl `trainer.resume_mode`s that mean the same; the first is set
unless trainer.resume_mode is given on the command line. verl's own default, `auto`, would
make a fresh run silently continue whatever its checkpoint folder holds."""

SEED_KEYS: tuple[str, ...] = (
    "data.seed",
    "actor_rollout_ref.rollout.seed",
    "actor_rollout_ref.actor.data_loader_seed",
)
"""verl's seeds that follow `omgrpo.seed`: data shuffle, rollout sampling, mini-batch shuffle."""

JOB_GPUS_VAR = "OMGRPO_JOB_GPUS"
"""How many GPUs a job of `omgrpo sweep --jobs` / `--agent` has (`omgrpo.sweep.job_split`):
`trainer.n_gpus_per_node` unless given."""

SCHEMA_NAME = "omgrpo_verl_schema"
AGENT_LOOP_MANAGER = "omgrpo.backends.verl.agent_loop.OmgrpoAgentLoopManager"


def register_schema() -> None:
    """Store the section's schema for the presets' defaults list (`/omgrpo_verl_schema@omgrpo`),
    once per process, and have YAML read by libyaml (omgrpo.config.read_yaml_with_libyaml)."""
    read_yaml_with_libyaml()
    cs = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in cs.repo:
        cs.store(name=SCHEMA_NAME, node=OmgrpoVerlConfig)


def available_presets() -> list[str]:
    return sorted(p.stem for p in VERL_PRESETS_DIR.glob("paper*.yaml") if p.stem != "paper")


def _require_verl() -> None:
    if importlib.util.find_spec("verl") is None:
        raise MissingDependency(
            "backend=verl needs verl: install the extra with `pip install 'omgrpo[verl]'` "
            "(after torch, so pip does not pull another torch build)"
        )


def _translate(overrides: list[str]) -> list[str]:
    """The native command line's spellings: `method=X` picks the method preset merged into the
    `omgrpo` section (Hydra spells that default `method@omgrpo`); `seed=N` and `run.*=...` are
    the section's `omgrpo.seed` and `omgrpo.run.*` (verl's config has neither key)."""
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key == "method":
            item = f"method@omgrpo={value}"
        elif sep and (key == "seed" or key.startswith("run.")):
            item = f"omgrpo.{item}"
        out.append(item)
    return out


def _given(overrides: list[str] | None, key: str) -> bool:
    return any(o.partition("=")[0].lstrip("+~") == key for o in overrides or [])


def compose_verl(experiment: str, overrides: list[str] | None = None) -> DictConfig:
    """verl's `ppo_trainer` config composed with `experiments/verl/<experiment>.yaml`, the
    method preset and `overrides` (Hydra syntax; `method=X` selects a method preset), checked
    by `validate_section`. Does not start Ray and does not import verl's trainer."""
    from hydra import compose, initialize_config_dir

    _require_verl()
    preset = VERL_PRESETS_DIR / f"{experiment}.yaml"
    if not preset.is_file() or experiment not in available_presets():
        raise InputError(
            f"no verl preset '{experiment}' ({preset})",
            key="experiment",
            expected=f"one of {', '.join(available_presets())}",
        )
    register_schema()
    with initialize_config_dir(version_base="1.3", config_dir=str(EXPERIMENTS_DIR)):
        cfg = compose(config_name=f"verl/{experiment}", overrides=_translate(list(overrides or [])))
    with open_dict(cfg):
        cfg.pop("hydra", None)
        if not _given(list(overrides or []), "trainer.resume_mode"):
            cfg.trainer.resume_mode = _resume_modes(cfg.omgrpo.run.resume)[0]
        # a job of `omgrpo sweep --jobs` / `--agent` sees only its slice of the GPUs
        if (gpus := os.environ.get(JOB_GPUS_VAR)) and not _given(
            overrides, "trainer.n_gpus_per_node"
        ):
            count = int(gpus) if gpus.strip().isdigit() else gpus
            cfg.trainer.n_gpus_per_node = check_int(count, JOB_GPUS_VAR, minimum=1)
    validate_section(cfg)
    return cfg


def section(cfg: DictConfig) -> DictConfig:
    """The `omgrpo` section of a full verl config, with a clear error if it is absent."""
    node = cfg.get("omgrpo")
    if node is None:
        raise InputError(
            "the verl config has no `omgrpo` section: compose it with an experiments/verl preset "
            "(omgrpo train backend=verl experiment=...)"
        )
    return node


GRPO_EPS = 1e-6
"""verl's GRPO estimator fixes its epsilon (`compute_grpo_outcome_advantage(epsilon=1e-6)`)."""


def validate_section(cfg: DictConfig) -> None:
    """Fail fast on values the verl backend cannot run, naming the key and the valid options.

    Besides the `omgrpo` section this rejects verl settings that would put gradient back on
    answer tokens behind the outcome mask (entropy bonus, other policy losses, KL in the
    reward) or make the two backends disagree silently.
    """
    om = section(cfg)
    unsupported = [p for p in om.reward.parts if p not in SUPPORTED_REWARDS]
    if unsupported:
        raise InputError(
            f"omgrpo.reward.parts: {unsupported} not supported by the verl backend "
            f"(supported: {', '.join(SUPPORTED_REWARDS)}); use the native trainer for them"
        )
    try:  # shared with the native trainer, whose checks raise ValueError naming the key
        validate_algorithm(om.algorithm, "omgrpo.algorithm")
    except InputError:
        raise
    except ValueError as e:
        raise InputError(str(e)) from e
    _check_process(om)
    _check_verl_owned(om)
    _check_ranges(cfg, om)
    _check_group_size(cfg, om)
    _check_masking(cfg)
    _check_generic_masks(cfg, om)
    _check_dapo(cfg, om)
    _check_advantage(cfg, om)
    _check_seed_and_resume(cfg, om)
    mode = OmegaConf.select(cfg, "trainer.v1.trainer_mode")
    if mode != "omgrpo":
        raise InputError(f"trainer.v1.trainer_mode must be 'omgrpo' for OM-GRPO, got {mode!r}")
    manager = OmegaConf.select(cfg, "actor_rollout_ref.rollout.agent.agent_loop_manager_class")
    if manager != AGENT_LOOP_MANAGER:
        raise InputError(
            "actor_rollout_ref.rollout.agent.agent_loop_manager_class must be "
            f"{AGENT_LOOP_MANAGER} (group rewards and answer spans), got {manager!r}"
        )
    if OmegaConf.select(cfg, "algorithm.adv_estimator") != "grpo":
        raise InputError("algorithm.adv_estimator must be 'grpo' (answer weighting follows it)")


def _check_process(om: DictConfig) -> None:
    """The `process` reward needs a PRM checkpoint (the toy PRM is the native trainer's)."""
    if "process" not in om.reward.parts:
        return
    try:
        aggregate([], om.reward.prm.aggregate)  # names the valid aggregations
    except ValueError as e:
        raise InputError(str(e), key="omgrpo.reward.prm.aggregate") from e
    if not om.reward.prm.path:
        raise InputError(
            "omgrpo.reward.prm.path is null, which means the toy PRM (native trainer only): "
            "point it at a PRM checkpoint for reward 'process' on verl (docs/prm.md)"
        )
    check_int(om.reward.prm.batch_size, "omgrpo.reward.prm.batch_size", minimum=1)
    check_number(om.prm_server.num_gpus, "omgrpo.prm_server.num_gpus", minimum=0)
    check_number(om.prm_server.num_cpus, "omgrpo.prm_server.num_cpus", minimum=0)


_ABSENT = object()

VERL_RANGES: tuple[tuple[str, str, float | None, float | None, bool], ...] = (
    ("data.train_batch_size", "int", 1, None, False),
    ("trainer.n_gpus_per_node", "int", 1, None, False),
    ("trainer.nnodes", "int", 1, None, False),
    ("trainer.total_epochs", "int", 1, None, False),
    ("trainer.total_training_steps", "int", 1, None, True),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", "int", 1, None, False),
    ("actor_rollout_ref.actor.ppo_epochs", "int", 1, None, False),
    ("actor_rollout_ref.actor.optim.lr", "float>", 0, None, False),
    ("actor_rollout_ref.rollout.temperature", "float", 0, None, False),
    ("actor_rollout_ref.rollout.top_p", "float>", 0, 1, False),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", "float>", 0, 1, False),
    ("actor_rollout_ref.rollout.val_kwargs.n", "int", 1, None, False),
)
"""verl keys the presets set whose nonsense values verl 0.9.1's `validate_config` lets through
(data.train_batch_size=0, trainer.n_gpus_per_node=0, a top_p of 0 or above 1): the same ranges
as `omgrpo.config.VALUE_RANGES`, checked before Ray starts (`_check_ranges`)."""


def _check_range_table(cfg: DictConfig, table, prefix: str = "") -> None:
    for key, kind, low, high, nullable in table:
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is _ABSENT:
            continue  # a key this config does not have (the native trainer's trainer.*, ...)
        if kind == "int":
            check_int(value, prefix + key, minimum=low, maximum=high, allow_none=nullable)
        else:
            check_number(
                value,
                prefix + key,
                minimum=low,
                maximum=high,
                exclusive_minimum=kind == "float>",
                allow_none=nullable,
            )


def _check_ranges(cfg: DictConfig, om: DictConfig) -> None:
    """The native trainer's ranges (`omgrpo.config.VALUE_RANGES`) of the keys the section
    shares with it (seed, rollout.n, algorithm.*, reward.*, collapse.*), named `omgrpo.<key>`,
    the section's own numbers and `VERL_RANGES`: seed=-1 or omgrpo.collapse.patience=0 went to
    verl unchecked."""
    _check_range_table(om, VALUE_RANGES, "omgrpo.")
    check_int(om.run.log_rollouts_every, "omgrpo.run.log_rollouts_every", minimum=1)
    _check_range_table(cfg, VERL_RANGES)


def _check_verl_owned(om: DictConfig) -> None:
    """An algorithm key verl holds itself would be silently ignored: name verl's key."""
    defaults = {f.name: f.default for f in fields(AlgorithmConfig)}
    for key, verl_key in VERL_ACTOR_KEYS.items():
        if om.algorithm[key] != defaults[key]:
            raise InputError(
                f"omgrpo.algorithm.{key}={om.algorithm[key]} is not read by the verl backend; "
                f"set {verl_key} instead"
            )


def _check_group_size(cfg: DictConfig, om: DictConfig) -> None:
    """G: the workers read `actor_rollout_ref.rollout.n`; the presets set it from
    `omgrpo.rollout.n`, and an override of only one of them must not go unnoticed."""
    n = OmegaConf.select(cfg, "actor_rollout_ref.rollout.n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise InputError(
            f"actor_rollout_ref.rollout.n (G, rollouts per prompt) must be at least 2 for group "
            f"rewards and GRPO, got {n!r}"
        )
    if om.rollout.n != n:
        raise InputError(
            f"actor_rollout_ref.rollout.n={n} but omgrpo.rollout.n={om.rollout.n}: verl's workers "
            "generate actor_rollout_ref.rollout.n rollouts per prompt; set omgrpo.rollout.n "
            "(the presets derive actor_rollout_ref.rollout.n from it)"
        )


def _check_masking(cfg: DictConfig) -> None:
    """verl settings that would put answer-token gradient back behind the outcome mask."""
    entropy_coeff = OmegaConf.select(cfg, "actor_rollout_ref.actor.entropy_coeff", default=0)
    if float(entropy_coeff or 0) != 0.0:
        raise InputError(
            f"actor_rollout_ref.actor.entropy_coeff must be 0, got {entropy_coeff}: verl's "
            "entropy bonus covers every response token, answer tokens included, which undoes "
            "outcome masking (OM-GRPO masks answer tokens in the PG and KL terms)"
        )
    loss_mode = OmegaConf.select(
        cfg, "actor_rollout_ref.actor.policy_loss.loss_mode", default="vanilla"
    )
    if loss_mode != "vanilla":
        raise InputError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode must be 'vanilla', got "
            f"{loss_mode!r}: omgrpo masks answer tokens by scaling the per-token advantage, "
            "which is exact only for the token-level clipped surrogate (others, e.g. gspo, "
            "kl_cov, clip_cov, mix sequence-level ratios or add terms over every token)"
        )
    if OmegaConf.select(cfg, "algorithm.use_kl_in_reward", default=False):
        raise InputError(
            "algorithm.use_kl_in_reward must be false: verl's in-reward KL penalty covers every "
            "response token, answer tokens included, which undoes outcome masking; use the KL "
            "loss (actor_rollout_ref.actor.use_kl_loss, weighted on answer tokens by omgrpo)"
        )


DAPO_ROW_ENGINES: tuple[str, ...] = ("fsdp", "fsdp2")
"""The actor strategies dynamic sampling and the overlong filter run on: their engine reads
`loss_mask` only to count the loss's tokens (`omgrpo.backends.verl.dapo`); Megatron's also
masks its logits processing with it."""


def _check_dapo(cfg: DictConfig, om: DictConfig) -> None:
    """The DAPO options that need the step's rows (`omgrpo.backends.verl.dapo`; the values
    themselves are checked as the native trainer's): the overlong buffer fits in verl's length
    limit, and the options that drop rollouts from the loss need an FSDP actor."""
    algo = om.algorithm
    buffer = algo.get("overlong_buffer")
    limit = OmegaConf.select(cfg, "actor_rollout_ref.rollout.response_length")
    if buffer is not None and limit is not None and buffer > limit:
        raise InputError(
            "the penalty ramps over the last overlong_buffer tokens before verl's length limit",
            key="omgrpo.algorithm.overlong_buffer",
            found=buffer,
            expected=f"at most actor_rollout_ref.rollout.response_length ({limit})",
        )
    strategy = OmegaConf.select(cfg, "actor_rollout_ref.actor.strategy")
    for key in ("dynamic_sampling", "overlong_filter"):
        if algo.get(key) and strategy not in DAPO_ROW_ENGINES:
            raise InputError(
                f"true needs an FSDP actor, but actor_rollout_ref.actor.strategy is "
                f"{strategy!r}: the kept rollouts reach the loss through verl's loss_mask, which "
                "the FSDP engines use only to count the loss's tokens (Megatron's also masks with it)",
                key=f"omgrpo.algorithm.{key}",
                expected=f"actor_rollout_ref.actor.strategy {' or '.join(DAPO_ROW_ENGINES)}",
            )


def _check_generic_masks(cfg: DictConfig, om: DictConfig) -> None:
    """`top_entropy_quantile` reads the entropy verl stores in its old-log-prob pass, which
    rollout-correction bypass mode skips."""
    if om.algorithm.get("top_entropy_quantile") is None:
        return
    corr = OmegaConf.select(cfg, "algorithm.rollout_correction", default=None)
    if corr and corr.get("bypass_mode", False):
        raise InputError(
            "omgrpo.algorithm.top_entropy_quantile needs the per-token entropy of verl's "
            "old-log-prob pass, which algorithm.rollout_correction.bypass_mode=true skips: "
            "turn bypass mode off or the mask off"
        )


def _check_advantage(cfg: DictConfig, om: DictConfig) -> None:
    eps = float(om.algorithm.adv_eps)
    if eps != GRPO_EPS:
        raise InputError(
            f"omgrpo.algorithm.adv_eps must be {GRPO_EPS} on verl, got {eps}: verl's GRPO "
            "estimator fixes its epsilon, and the format-only advantage uses the same"
        )
    norm = OmegaConf.select(cfg, "algorithm.norm_adv_by_std_in_grpo", default=True)
    if om.algorithm.format_only and not norm:
        raise InputError(
            "algorithm.norm_adv_by_std_in_grpo=false with omgrpo.algorithm.format_only=true: "
            "the format-only advantage on answer tokens is std-normalised (as in the native "
            "trainer), so the two advantages would use different scales"
        )


def _check_seed_and_resume(cfg: DictConfig, om: DictConfig) -> None:
    """Two seeds must not share a checkpoint folder, and a fresh run must not resume one."""
    for key in SEED_KEYS:
        value = OmegaConf.select(cfg, key)
        if value != om.seed:
            raise InputError(f"{key}={value} but omgrpo.seed={om.seed}: set seed=N (it sets both)")
    folder = str(OmegaConf.select(cfg, "trainer.default_local_dir"))
    if not re.search(rf"__s{om.seed}(?![0-9])", folder):
        raise InputError(
            f"trainer.default_local_dir {folder!r} does not name the seed (__s{om.seed}): runs of "
            "different seeds would share it and resume each other's checkpoints; keep "
            "trainer.experiment_name's __s${omgrpo.seed} (experiments/verl/paper.yaml)"
        )
    mode = OmegaConf.select(cfg, "trainer.resume_mode")
    allowed = _resume_modes(om.run.resume)
    if mode not in allowed:
        fits = [str(k).lower() for k, modes in RESUME_MODES.items() if mode in modes]
        raise InputError(
            f"trainer.resume_mode={mode} with omgrpo.run.resume={str(om.run.resume).lower()}: "
            f"use {' or '.join(allowed)} (or set run.resume={' or '.join(fits) or 'true'})"
        )


def _resume_modes(resume: bool | str) -> tuple[str, ...]:
    """RESUME_MODES[resume], with a clear error for a value that is not auto / true / false."""
    if resume not in RESUME_MODES:
        raise InputError(f"omgrpo.run.resume={resume!r}: use auto, true or false")
    return RESUME_MODES[resume]


def missing_keys(cfg: DictConfig) -> list[str]:
    """Required keys (REQUIRED_KEYS) still null or missing."""
    out = []
    for key in REQUIRED_KEYS:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent)
        if node is None or OmegaConf.is_missing(node, leaf) or node.get(leaf) in (None, ""):
            out.append(key)
    return out


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML (null required keys stay null)."""
    return OmegaConf.to_yaml(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))
