"""`omgrpo` command line: train | (more subcommands land with their issues).

`omgrpo train [key=value ...] [--multirun]` is a Hydra app over `experiments/config.yaml`;
everything after `train` is passed to Hydra unchanged, so `--cfg job`, `--help` and
`--multirun` behave as in any Hydra application.
"""

from __future__ import annotations

import sys

USAGE = """usage: omgrpo <command> [args]

commands:
  train [overrides...]   train (default: OM-GRPO on the toy world, CPU). Examples:
                           omgrpo train trainer.steps=20 run.root=runs
                           omgrpo train method=mv seed=1
                           omgrpo train experiment=paper model.path=/models/Qwen3-1.7B-Base \\
                             task.train_path=math_train.jsonl task.val_path=math500.jsonl
                           omgrpo train --cfg job      (print the composed config)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        return _train(rest)
    print(f"omgrpo: unknown command '{command}'\n\n{USAGE}", file=sys.stderr)
    return 2


def _train(overrides: list[str]) -> int:
    import hydra
    from omegaconf import DictConfig

    from omgrpo.config import EXPERIMENTS_DIR, register_configs
    from omgrpo.trainer import train

    register_configs()

    @hydra.main(config_path=str(EXPERIMENTS_DIR), config_name="config", version_base="1.3")
    def app(cfg: DictConfig) -> None:
        run_dir = train(cfg)
        print(f"run finished: {run_dir}  (metrics.jsonl, rollouts/, checkpoints/)")

    sys.argv = ["omgrpo-train", *overrides]
    app()
    return 0


if __name__ == "__main__":
    sys.exit(main())
