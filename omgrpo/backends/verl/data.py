"""Problems as verl's RL dataset (one parquet row per problem), with the paper's prompt.

Row format (docs/verl.md, "Launch on one node"): `data_source`, `prompt` (the chat messages of
`omgrpo.core.prompt.build_messages`: the paper's system instruction, then the question),
`reward_model.ground_truth` (the label: diagnostics and `method=gt` only), `extra_info.index`
(the prompt id of the label-flip diagnostic). Used by the verl smoke test and the CPU test.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from omgrpo.core.prompt import build_messages
from omgrpo.core.task import Problem
from omgrpo.tasks.toy import ToyWorldSpec, generate_toy_splits

__all__ = ["verl_rows", "write_toy_parquet"]


def verl_rows(problems: Sequence[Problem], data_source: str) -> list[dict]:
    """One verl RL row per problem (index = position in `problems`)."""
    return [
        {
            "data_source": data_source,
            "prompt": build_messages(p.question),
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"index": i, "id": p.id},
        }
        for i, p in enumerate(problems)
    ]


def write_toy_parquet(
    out_dir: Path, n_train: int, n_val: int, seed: int = 0, spec: ToyWorldSpec | None = None
) -> tuple[Path, Path]:
    """`train.parquet` and `val.parquet` of toy-world problems (`task.seed` = `seed`, the
    default world unless `spec`) in `out_dir`; returns their paths."""
    splits = generate_toy_splits(n_train, n_val, 0, seed=seed, spec=spec or ToyWorldSpec())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, problems in (("train", splits.train), ("val", splits.val)):
        path = out_dir / f"{name}.parquet"
        pd.DataFrame(verl_rows(problems, "toy")).to_parquet(path, index=False)
        paths.append(path)
    return paths[0], paths[1]
