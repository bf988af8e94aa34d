"""Validation of the native trainer: avg@k, pass@k and the diagnostics of k samples per
validation problem at the evaluation temperature, on a random stream of its own; each
validation also appends its per-problem rows to the run store's `problems.parquet`
(`omgrpo.core.problems`)."""

from __future__ import annotations

import numpy as np
import torch

from omgrpo.backends.native.run import Run
from omgrpo.core.accuracy import avg_at_k, mean_pass_at_k
from omgrpo.core.answers import Grader
from omgrpo.core.diagnostics import recovery_metrics, task_diagnostics
from omgrpo.core.problems import problem_table
from omgrpo.core.rewards import make_group
from omgrpo.core.step import decode_responses, is_correct
from omgrpo.generation.engine import stream_seed
from omgrpo.tasks import task_probe


@torch.no_grad()
def validate(run: Run, step: int, recovery: dict) -> dict:
    """avg@k, pass@k and unique answers per problem at the evaluation temperature, and the
    problems' rows of `problems.parquet` at `step`. Runs on its own random stream so validating
    (or not) never changes the training trajectory."""
    cfg, problems = run.cfg, run.val_problems
    k = cfg.eval.k
    run.policy.eval()
    seqs = run.sample(
        problems,
        k,
        cfg.eval.temperature,
        cfg.eval.top_p,
        batch_size=cfg.eval.batch_size,
        seed=stream_seed(cfg.seed, "validation", step),
    )
    responses = decode_responses(run.tokenizer, seqs.response_ids, seqs.response_mask)
    answers = responses.answers
    grader = Grader.from_config(cfg.reward)  # its own budget: never what a step left over
    groups = [
        make_group(a, label=p.answer, grader=grader) for a, p in zip(_chunks(answers, k), problems)
    ]
    correct = [
        [bool(is_correct(a, p.answer, grader)) for a in g.answers] for g, p in zip(groups, problems)
    ]
    ids = [p.id for p in problems]
    run.store.log_problems(step, problem_table(step, ids, [g.answers for g in groups], correct))
    by_difficulty = {}
    difficulties = [p.meta.get("difficulty") for p in problems]
    if all(difficulties):  # toy problems: accuracy and guessing by difficulty
        for d in sorted(set(difficulties)):
            by_difficulty[f"val/acc_{d}"] = avg_at_k(
                [c for c, pd_ in zip(correct, difficulties) if pd_ == d]
            )
        per_rollout = [p for p in problems for _ in range(k)]
        flat = [c for ok in correct for c in ok]
        probe = task_probe(cfg.task)
        by_difficulty.update(
            task_diagnostics(responses.texts, answers, per_rollout, flat, probe, "val")
        )
    return {
        **by_difficulty,
        "val/acc": avg_at_k(correct),
        f"val/pass@{k}": mean_pass_at_k(correct),
        "val/unique_answers": float(
            np.mean([len({c for c in g.classes if c is not None}) for g in groups])
        ),
        "val/extract_rate": float(np.mean([a is not None for a in answers])),
        **recovery_metrics(correct, recovery),
    }


def _chunks(xs: list, size: int) -> list[list]:
    return [xs[i : i + size] for i in range(0, len(xs), size)]
