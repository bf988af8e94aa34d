"""`omgrpo train backend=verl experiment=<preset> [overrides...] [--dry-run]`.

Composes verl's `ppo_trainer` config with `experiments/verl/<preset>.yaml` (and the method preset
named by `method=...`), checks it with verl's own `validate_config`, then either prints it
(`--dry-run`: no Ray, no GPU, runs on a laptop) or launches verl's `run_ppo` with verl's V1
TaskRunner, exactly as `python -m verl.trainer.main_ppo` would after composing.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, open_dict

from omgrpo.backends.verl.config import (
    REQUIRED_KEYS,
    available_presets,
    compose_verl,
    missing_keys,
    to_yaml,
)

USAGE = """usage: omgrpo train backend=verl experiment=<preset> [overrides...] [--dry-run]

presets (experiments/verl/): {presets}
overrides: verl keys (data.train_files=..., trainer.n_gpus_per_node=4, ...), omgrpo.* keys
  (omgrpo.algorithm.answer_weight=0.25, omgrpo.car.enable=false, ...), method=<method preset>,
  seed=N (run name, checkpoint folder, verl's seeds) and run.resume=auto|true|false
  (trainer.resume_mode)
--dry-run: print the composed config (resolved YAML) and exit without starting Ray
"""


def parse(args: list[str]) -> tuple[str | None, list[str], bool, bool]:
    """(experiment, overrides, dry_run, help) from `omgrpo train` arguments."""
    experiment, overrides, dry_run, want_help = None, [], False, False
    for arg in args:
        if arg in {"--dry-run", "--dry_run"}:
            dry_run = True
        elif arg in {"-h", "--help"}:
            want_help = True
        elif arg.startswith("backend="):
            continue
        elif arg.startswith("experiment="):
            experiment = arg.partition("=")[2]
        else:
            overrides.append(arg)
    return experiment, overrides, dry_run, want_help


def check_verl(cfg: DictConfig) -> None:
    """verl's own config validation (the checks `verl.trainer.main_ppo.main` runs); a setting it
    rejects (a ValueError or a failed assertion in verl) is an InputError with verl's words."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from omgrpo.errors import InputError

    try:
        validate_config(
            config=cfg,
            use_reference_policy=need_reference_policy(cfg),
            use_critic=need_critic(cfg),
        )
    except (ValueError, AssertionError) as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"verl's config check refused it: {e}") from e


def check_checkpoint_folder(cfg: DictConfig) -> None:
    """As the native trainer: a run that is not resumed (`run.resume=false`, verl's
    `resume_mode=disable`) refuses a checkpoint folder that already holds a verl checkpoint,
    rather than writing a second run's checkpoints among the first's."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    if cfg.trainer.resume_mode != "disable":
        return
    folder = Path(cfg.trainer.default_local_dir).expanduser().absolute()
    latest = find_latest_ckpt_path(str(folder))
    if latest is not None:
        raise FileExistsError(
            f"{folder} already holds a run (checkpoint {latest}); pass run.resume=auto to "
            "continue it, or another seed / omgrpo.run.variant / trainer.default_local_dir"
        )


def launch(cfg: DictConfig) -> None:
    """Start verl's V1 training run (Ray) with `cfg`."""
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.utils.device import auto_set_device

    # Imported here too so that a broken install fails with its message (verl would log it at
    # DEBUG and then not know the `omgrpo` trainer).
    import omgrpo.backends.verl.plugin  # noqa: F401

    # Ray's processes may run elsewhere than the launch's folder: the run store and the
    # checkpoints (inside it) go where the launch's relative path points.
    with open_dict(cfg):
        cfg.omgrpo.run.root = str(Path(cfg.omgrpo.run.root).expanduser().absolute())
    auto_set_device(cfg)
    check_verl(cfg)
    check_checkpoint_folder(cfg)
    run_ppo(cfg, task_runner_class=TaskRunnerV1)


def main(args: list[str]) -> int:
    """`omgrpo train backend=verl ...`; bad input raises InputError (`omgrpo.cli.main`
    prints it, exit 2)."""
    from omgrpo.errors import InputError

    experiment, overrides, dry_run, want_help = parse(args)
    if want_help or experiment is None:
        print(USAGE.format(presets=", ".join(available_presets())))
        if experiment is None and not want_help:
            raise InputError("name a preset", key="experiment", expected="experiment=<preset>")
        return 0
    cfg = compose_verl(experiment, overrides)  # a rejected setting: InputError naming it
    missing = missing_keys(cfg)
    if dry_run:
        print(to_yaml(cfg), end="")
        if not missing:
            check_verl(cfg)
        print(f"# omgrpo: composed verl config of experiments/verl/{experiment}.yaml (dry run)")
        if missing:
            print("# to launch, also set: " + " ".join(f"{k}={REQUIRED_KEYS[k]}" for k in missing))
        return 0
    if missing:
        raise InputError(
            "set " + ", ".join(f"{k} (e.g. {k}={REQUIRED_KEYS[k]})" for k in missing),
            key="backend=verl",
        )
    launch(cfg)  # a fresh run into a used checkpoint folder: FileExistsError, exit 2
    return 0
