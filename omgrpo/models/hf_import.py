"""Importing transformers' generation code without scikit-learn.

When scikit-learn is installed (mlflow requires it), transformers' generation utilities import
it, and scipy with it, for one option of assisted decoding that omgrpo never uses (the dynamic
confidence threshold of an assistant model). Every model class imports those utilities, so each
process that loads a model paid for it: 2.3-3.5 CPU-s of importing them, 1.9 of a tiny 2-step
`omgrpo train` run's 14.7 CPU-s (measured with and without this, same tree).
transformers asks once per process whether scikit-learn exists (`is_sklearn_available`, cached),
so importing its generation utilities while scikit-learn is hidden leaves that option off and
scikit-learn importable as usual afterwards.
"""

from __future__ import annotations

import sys

_PROBE = "transformers.generation.candidate_generator"  # asks for scikit-learn when imported


def import_transformers_generation() -> None:
    """Import transformers' generation utilities with scikit-learn hidden from its check; a
    no-op once they (or scikit-learn) are imported."""
    if _PROBE in sys.modules or "sklearn" in sys.modules:
        return
    sys.modules["sklearn"] = None  # importlib.util.find_spec("sklearn") is then None
    try:
        import transformers.generation.utils  # noqa: F401  (imports _PROBE)
    finally:
        del sys.modules["sklearn"]
