"""transformers told that scikit-learn is absent (omgrpo.models.hf_import), so its generation
code loads without it, and the verbs that load a model doing so first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omgrpo import cli

PROBE = """
import sys
from omgrpo.models.hf_import import hide_sklearn_from_transformers
hide_sklearn_from_transformers()
from transformers import Qwen3ForCausalLM  # a model class: generation code imported
from transformers.utils import is_sklearn_available
hidden = "sklearn" not in sys.modules and not is_sklearn_available()
import sklearn.metrics  # still importable afterwards
print(hidden, "sklearn" in sys.modules)
"""


@pytest.mark.slow
def test_the_generation_code_loads_without_sklearn_which_stays_importable():
    """In a fresh interpreter (this one has imported transformers already)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("argv", [["eval", "--help"], ["export", "--help"], ["report", "--help"]])
def test_verbs_that_load_a_model_hide_sklearn_first(argv, monkeypatch, capsys):
    import omgrpo.models.hf_import as hf_import

    calls = []
    monkeypatch.setattr(hf_import, "hide_sklearn_from_transformers", lambda: calls.append(1))
    assert cli.main(argv) == 0
    assert calls == ([1] if argv[0] in cli.MODEL_VERBS else [])
    assert {"train", "base", "prm", "eval", "export", "bench"} <= cli.MODEL_VERBS
