"""transformers without scikit-learn, in omgrpo's own processes.

When scikit-learn is installed (mlflow requires it), transformers' generation utilities import
it, and scipy with it, for one option of assisted decoding that omgrpo never uses (the dynamic
confidence threshold of an assistant model). Every model class imports those utilities, so each
process that loads a model paid for it: 2.3-3.5 CPU-s of importing them, 1.9 of a tiny 2-step
`omgrpo train` run's 14.7 CPU-s (measured with and without this, same tree).
transformers asks once per process whether scikit-learn exists (`is_sklearn_available`, cached),
so asking it while scikit-learn is hidden leaves that option off and scikit-learn importable as
usual afterwards. Called where the process is omgrpo's: the CLI's model verbs, the verl plugin
(every verl process), the benchmarks' measuring processes and scripts/, the test suite; never
on `import omgrpo`, which must not change a user's own transformers.
"""

from __future__ import annotations

import sys


def hide_sklearn_from_transformers() -> None:
    """Have transformers record, for this process, that scikit-learn is absent (without
    importing its generation code); a no-op once scikit-learn is imported."""
    if "sklearn" in sys.modules:
        return
    from transformers.utils import import_utils

    sys.modules["sklearn"] = None  # importlib.util.find_spec("sklearn") is then None
    try:
        import_utils.is_sklearn_available()  # cached: the answer holds for the process
    finally:
        del sys.modules["sklearn"]
