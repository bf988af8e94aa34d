"""verl plugin entry point (`[project.entry-points."verl.plugins"] omgrpo = ...`).

`import verl` loads every `verl.plugins` entry point in every process (driver, TaskRunner,
workers), so importing this module is what registers OM-GRPO with verl: the `omgrpo` trainer
(`trainer.v1.trainer_mode=omgrpo`). verl logs a failing plugin only at DEBUG level and carries
on, so a wrong verl version fails here with a message, and `omgrpo train backend=verl` imports
this module itself before launching so that any error surfaces.
"""

from __future__ import annotations

from importlib.metadata import version

from omgrpo.backends.verl import VERL_VERSION
from omgrpo.models.hf_import import hide_sklearn_from_transformers


def check_version(installed: str) -> None:
    """Refuse any verl but the pinned one: the plugin subclasses verl internals."""
    if installed != VERL_VERSION:
        raise ImportError(
            f"omgrpo's verl plugin is written for verl=={VERL_VERSION}, found verl {installed}: "
            "install the pinned version with `pip install 'omgrpo[verl]'` (docs/verl.md, pin policy)"
        )


check_version(version("verl"))
# every verl process loads this plugin before it imports a model class: the process's
# transformers then skips scikit-learn (omgrpo.models.hf_import; ~2 CPU-s per Ray worker)
hide_sklearn_from_transformers()

from omgrpo.backends.verl.trainer import TRAINER_NAME, OmgrpoTrainer  # noqa: E402  (registers)

__all__ = ["TRAINER_NAME", "OmgrpoTrainer", "check_version"]
