"""Build hook (all metadata is in pyproject.toml): the wheel ships the Hydra presets.

Users edit the presets in the top-level `experiments/`; a wheel carries a copy as
`omgrpo/_presets/`, which `omgrpo.config.presets_dir` reads through `importlib.resources`. An
editable install copies nothing: it reads the checkout's experiments/ in place.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PRESETS = Path(__file__).resolve().parent / "experiments"


class BuildPyWithPresets(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        shutil.copytree(
            PRESETS,
            Path(self.build_lib) / "omgrpo" / "_presets",
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )


setup(cmdclass={"build_py": BuildPyWithPresets})
