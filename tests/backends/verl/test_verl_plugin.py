"""`import verl` registers the omgrpo plugin (checked in fresh processes: verl logs a plugin
that fails to load only at DEBUG level, so registration itself is asserted)."""

from __future__ import annotations

try:
    import verl  # noqa: F401
except ModuleNotFoundError as exc:  # CI runs these with real verl: say how to get it
    raise ModuleNotFoundError(
        "tests/test_verl_*.py need verl: install with pip install -e '.[dev,verl]' (or make setup)"
    ) from exc

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from omgrpo.backends.verl import VERL_VERSION
from omgrpo.backends.verl.plugin import check_version

PROBE = """
import json, sys
import verl
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
cls = TRAINER_REGISTRY.get("omgrpo")
print(json.dumps({
    "trainer": None if cls is None else f"{cls.__module__}.{cls.__qualname__}",
    "plugin_imported": "omgrpo.backends.verl.plugin" in sys.modules,
    "verl": verl.__version__,
    "sklearn_imported": "sklearn" in sys.modules,
}))
"""


def probe(**env: str) -> dict:
    """Import verl in a fresh interpreter and report what got registered."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_entry_point_is_declared():
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "omgrpo"]
    assert [ep.value for ep in eps] == ["omgrpo.backends.verl.plugin"]


@pytest.mark.slow
@pytest.mark.e2e
def test_import_verl_registers_the_trainer():
    report = probe(VERL_USE_EXTERNAL_PLUGINS="auto")
    assert report == {
        "trainer": "omgrpo.backends.verl.trainer.OmgrpoTrainer",
        "plugin_imported": True,
        "verl": VERL_VERSION,
        # the plugin (loaded in every verl process, Ray workers included) tells transformers
        # scikit-learn is absent before its trainer imports a model class (~2 CPU-s a process)
        "sklearn_imported": False,
    }


@pytest.mark.slow
@pytest.mark.e2e
def test_registration_comes_from_the_entry_point():
    """With verl's plugin discovery off nothing registers omgrpo: the entry point does it."""
    report = probe(VERL_USE_EXTERNAL_PLUGINS="none")
    assert report["trainer"] is None and not report["plugin_imported"]


def test_other_verl_versions_are_refused():
    check_version(VERL_VERSION)
    with pytest.raises(ImportError, match=r"verl==0\.9\.1.*found verl 0\.9\.0"):
        check_version("0.9.0")
