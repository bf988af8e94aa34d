"""Shared fixtures: a tiny toy config whose base model is trained once per test session."""

import os
import re
from collections import defaultdict
from pathlib import Path

# Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads (set
# before torch is imported; subprocesses inherit it): 2 workers with 2 OpenMP threads each on 2
# cores spin-waited for each other (304 vs 254 CPU-s on the training test files, measured).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(_share, 1)))

import pytest
from hypothesis import HealthCheck, settings

# Every property test draws the same examples on every run and machine (a random search could
# fail one run in many on an input no earlier run tried: a test must not depend on luck), writes
# no example database into the checkout, and has no per-example deadline (machines are shared).
# Tests set only `max_examples`.
settings.register_profile(
    "omgrpo",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("omgrpo")


def pytest_configure(config):
    """Where tests run (a pytest-xdist worker, or pytest without workers; not the controller,
    which imports no model), transformers skips scikit-learn as in the CLI
    (omgrpo.models.hf_import): ~2 CPU-s per worker."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        from omgrpo.models.hf_import import hide_sklearn_from_transformers

        hide_sklearn_from_transformers()


os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A developer's shared server or project must not receive test runs (training honours these).
for _var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_ENTITY",
             "WANDB_RUN_ID", "WANDB_SWEEP_ID", "WANDB_DIR", "WANDB_RESUME"):  # fmt: skip
    os.environ.pop(_var, None)

DURATIONS = Path(__file__).parent / "durations.txt"  # `make durations` writes it


def recorded_seconds_per_file(text: str) -> dict[str, float]:
    """Each test file's seconds in a durations snapshot (its listed setup/call/teardown lines)."""
    seconds: dict[str, float] = defaultdict(float)
    for m in re.finditer(r"^([0-9.]+)s (?:setup|call|teardown) +([^:\s]+)::", text, re.M):
        seconds[m[2]] += float(m[1])
    return seconds


def pytest_collection_modifyitems(config, items):
    """Longest test files first, by the committed durations snapshot (files it does not list
    keep their collection order, after the listed ones). `make test` hands whole files to its
    two workers in collection order, so a long file started last (the shared server, the
    browser) left one core idle for minutes at the end of the suite."""
    if not DURATIONS.exists():
        return
    seconds = recorded_seconds_per_file(DURATIONS.read_text())
    root = Path(str(config.rootpath))
    first = {}  # file -> its position in collection order (a stable tie-break)
    for item in items:
        first.setdefault(item.path, len(first))

    def file_key(item):
        name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return (-seconds.get(name, 0.0), first[item.path])

    items.sort(key=file_key)  # stable: a file's tests keep their order


# A toy run that takes well under a second per step on 2 CPU cores.
TINY = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.warm_start.steps=5",
    "model.warm_start.batch_size=8",
    "model.warm_start.check_problems=0",  # tests/test_toy_worlds.py checks a base on its own
    "task.n_train=32",
    "task.n_val=8",
    "task.n_test=8",
    "rollout.n=4",
    "rollout.max_new_tokens=24",
    "eval.num_prompts=4",
    "eval.k=2",
    "eval.every=2",
    "trainer.prompts_per_step=2",
    "trainer.progress=false",
    "optim.lr=1e-3",
    # trackers have their own tests; a fresh MLflow DB per run dir costs ~8 s
    "tracking.mlflow=false",
    "tracking.wandb=false",
]


@pytest.fixture(scope="session")
def base_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("base-cache"))


@pytest.fixture
def tiny_overrides(tmp_path, base_cache):
    return [*TINY, f"model.cache_dir={base_cache}", f"run.root={tmp_path / 'runs'}"]


class MetricTable:
    """docs/metrics.md's table: each row's name patterns (`<x>`: a name part, `*`: anything)
    and the backends that log them."""

    def __init__(self, path):
        import re

        self.rows = []
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("| `") or len(cells) < 4:
                continue
            for name in re.findall(r"`([^`]+)`", cells[0]):
                pattern = re.escape(name).replace(r"\*", ".+")
                pattern = re.sub(r"<[a-z]+>", "[A-Za-z0-9_]+", pattern)
                self.rows.append((name, re.compile(pattern + "$"), cells[-1]))

    def undocumented(self, names, backend: str) -> list[str]:
        """The names no row documents as logged by `backend` (`native` or `verl`)."""
        return sorted(
            n for n in names if not any(p.match(n) and backend in b for _, p, b in self.rows)
        )


@pytest.fixture(scope="session")
def metric_table():
    from pathlib import Path

    return MetricTable(Path(__file__).resolve().parent.parent / "docs" / "metrics.md")
