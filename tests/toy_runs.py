"""A 3-step tiny toy run, trained once per test module that asks (tests/ is on sys.path
through the rootdir conftest)."""

from pathlib import Path

import torch
from conftest import TINY


def train_tiny_run(root: Path, base_cache: str, extra: tuple[str, ...] = ()) -> Path:
    """3 steps with checkpoints at steps 2 and 3, on one torch thread (far faster for the tiny
    model on a shared 2-core machine; torch's thread count is restored afterwards).

    The reward is Self-Certainty, a continuous function of each rollout's own log-probs, so a
    group's rollouts (distinct samples) get distinct rewards and non-zero advantages: every step
    updates the weights whatever the barely trained base answers. A correctness or vote reward
    gives such a base 0 for every rollout on some machines, and then nothing is trained."""
    from omgrpo.backends.native.trainer import train
    from omgrpo.config import compose

    threads = torch.get_num_threads()
    overrides = [
        *TINY,
        "method=self_certainty",
        f"model.cache_dir={base_cache}",
        f"run.root={root}",
        "trainer.steps=3",
        "trainer.save_every=2",
        "trainer.keep_checkpoints=2",
        "trainer.threads=1",
        *extra,  # e.g. model.lora.rank=4
    ]
    try:
        return train(compose(overrides))
    finally:
        torch.set_num_threads(threads)
