"""`omgrpo train` on the native trainer: compose the Hydra config from experiments/ and train."""

from __future__ import annotations

import sys


def main(overrides: list[str]) -> int:
    """Train with Hydra's `omgrpo train [overrides...]` command line (`--cfg job`, multirun)."""
    import hydra
    from omegaconf import DictConfig

    from omgrpo.backends.native.trainer import train
    from omgrpo.config import EXPERIMENTS_DIR, register_configs

    register_configs()
    # `backend` selects the trainer; it is not a key of the native config.
    overrides = [o for o in overrides if not o.startswith("backend=")]

    @hydra.main(config_path=str(EXPERIMENTS_DIR), config_name="config", version_base="1.3")
    def app(cfg: DictConfig) -> None:
        run_dir = train(cfg)
        print(f"run finished: {run_dir}  (metrics.jsonl, rollouts/, checkpoints/)")

    _check_before_hydra(overrides)  # a refusal writes nothing (Hydra writes <run dir>/.hydra/)
    if (skip := _finished(overrides)) is not None:  # before Hydra writes <run dir>/.hydra/
        print(skip)
        return 0
    sys.argv = ["omgrpo-train", *overrides]
    app()
    return 0


def _check_before_hydra(overrides: list[str]) -> None:
    """Refuse, before Hydra writes `<run dir>/.hydra/`, a command line whose config values are
    out of range or whose run directory holds a finished run of another config (InputError,
    exit 2, nothing written), and one that does not compose (a bad key or value type). Hydra
    flags (`--cfg job`, `-m`) and `hydra.*` overrides skip it: Hydra composes and reports
    those, and a multirun's values are checked by each run."""
    if any(o.startswith("-") for o in overrides):
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from omgrpo.backends.native.run import check_config
    from omgrpo.backends.native.trainer import skip_message
    from omgrpo.config import compose
    from omgrpo.errors import InputError, short_message

    try:
        cfg = compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        if any(o.lstrip("+~").startswith("hydra") for o in overrides):
            return  # Hydra's own settings: left to Hydra to compose and report
        raise InputError(f"the config does not compose: {short_message(e)}") from e
    try:
        check_config(cfg)
        skip_message(cfg)
        if "process" in cfg.reward.parts:  # a PRM that is not one: its head's weights
            from omgrpo.models.prm import check_prm_checkpoint

            check_prm_checkpoint(cfg.reward.prm)
    except InputError:
        raise
    except ValueError as e:  # check_config's and skip_message's refusals
        raise InputError(str(e)) from e


def _finished(overrides: list[str]) -> str | None:
    """The message for a run that `run.resume=auto` skips (`trainer.skip_message`), checked
    before Hydra starts so that a skipped run's files stay untouched; None otherwise, and for a
    command line with Hydra flags (`--cfg job`, `-m`) or one that does not compose (Hydra then
    runs and reports it)."""
    if any(o.startswith("-") for o in overrides):
        return None
    from omgrpo.backends.native.trainer import skip_message
    from omgrpo.config import compose

    try:
        return skip_message(compose(overrides))
    except Exception:
        return None
