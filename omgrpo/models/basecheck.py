"""Acceptance checks of a toy base model against the world it was trained in.

A study in a shortcut world (`omgrpo.tasks.toy`, docs/toy-worlds.md) means something only if the
base actually behaves as its world says: it guesses at about the SFT rates, more on hard
problems, its answer tokens carry real uncertainty, and its accuracy leaves room to move. These
checks are measured once per base (sampled at the training temperature on problems it has never
seen), stored beside it as `checks.json`, and printed by `omgrpo report`; a base that fails them
is reported as failing, never used silently.

Definitions (per difficulty, over k samples of each problem):
- guess rate: share of rollouts with a boxed answer that differs from the value their own
  reasoning computed last (`last_result`), or that compute nothing before boxing (bare guess);
- collision rate: share of ordered rollout pairs of one problem that box the same WRONG answer
  (what lets a wrong majority form);
- peak share: share of rollouts boxing the guess prior's peak value;
- avg@k (mean accuracy) and pass@k (any of the k correct).
Pass rule for a guess rate with SFT rate r: the Wilson 95% interval of the measured rate meets
[0.7 r, 1.3 r] (r = 0: meets [0, 0.01]). The answer-token entropy must reach `min_entropy` nats
in the shortcut worlds (guess rates > 0).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omgrpo.core.accuracy import avg_at_k, mean_pass_at_k
from omgrpo.core.answers import extract_boxed, normalize
from omgrpo.core.diagnostics import GuessCounts, count_guesses
from omgrpo.core.task import Problem
from omgrpo.tasks.toy import ToyProbe, ToyWorldSpec, draw_distinct

if TYPE_CHECKING:  # torch is imported where a base is measured: reports only read checks
    import torch

__all__ = [
    "DifficultyStats",
    "acceptance",
    "check_problems",
    "difficulty_stats",
    "format_checks",
    "measure_base",
    "read_base_checks",
    "wilson_interval",
    "write_base_checks",
]

CHECKS_FILE = "checks.json"
RATE_TOLERANCE = 0.3  # relative band around an SFT rate
ZERO_RATE_BAND = 0.01  # absolute band when the SFT rate is 0
MIN_ANSWER_ENTROPY = 0.3  # nats, shortcut worlds only


@dataclass(frozen=True)
class DifficultyStats:
    difficulty: str
    problems: int
    rollouts: int
    guess_rate: float
    guess_count: int
    collision_rate: float
    peak_share: float
    avg_acc: float
    pass_at_k: float


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def difficulty_stats(
    problems: Sequence[Problem], texts: Sequence[Sequence[str]], spec: ToyWorldSpec
) -> list[DifficultyStats]:
    """Per-difficulty statistics of `texts[i]` (the k sampled responses to `problems[i]`)."""
    if len(problems) != len(texts):
        raise ValueError(f"{len(problems)} problems but {len(texts)} groups of responses")
    probe = ToyProbe(peak=str(spec.guess_peak))
    out = []
    for difficulty in ("easy", "hard"):
        rows = [
            (p, group)
            for p, group in zip(problems, texts)
            if p.meta.get("difficulty", "easy") == difficulty
        ]
        if not rows:
            continue
        guesses = GuessCounts(0, 0, 0, 0, 0)
        correct, pair_hits, pair_total = [], 0, 0
        for problem, group in rows:
            boxes = [extract_boxed(t) for t in group]
            answers = [normalize(b.content) if b else None for b in boxes]
            hits = [a is not None and a == problem.answer for a in answers]
            guesses += count_guesses(group, answers, probe)
            correct.append(hits)
            wrong = [a for a, ok in zip(answers, hits) if a is not None and not ok]
            pair_hits += sum(wrong.count(a) - 1 for a in wrong)
            pair_total += len(group) * (len(group) - 1)
        out.append(
            DifficultyStats(
                difficulty=difficulty,
                problems=len(rows),
                rollouts=guesses.rollouts,
                # over every rollout (validation's guess rates count only those with a box)
                guess_rate=guesses.guesses / guesses.rollouts,
                guess_count=guesses.guesses,
                collision_rate=pair_hits / pair_total if pair_total else 0.0,
                peak_share=guesses.peak / guesses.rollouts,
                avg_acc=avg_at_k(correct, per="sample"),
                pass_at_k=mean_pass_at_k(correct),
            )
        )
    return out


def acceptance(
    stats: Sequence[DifficultyStats], spec: ToyWorldSpec, answer_entropy: float | None
) -> dict:
    """The checks' verdicts as a JSON-ready dict: each check with measured value, target and
    pass/fail, plus `passed` for all of them."""
    checks = []
    for s in stats:
        rate = spec.guess_rate(s.difficulty)
        lo, hi = wilson_interval(s.guess_count, s.rollouts)
        band = (
            ((1 - RATE_TOLERANCE) * rate, (1 + RATE_TOLERANCE) * rate)
            if rate > 0
            else (0.0, ZERO_RATE_BAND)
        )
        checks.append(
            {
                "check": f"guess_rate/{s.difficulty}",
                "measured": round(s.guess_rate, 4),
                "ci95": [round(lo, 4), round(hi, 4)],
                "target": [round(band[0], 4), round(band[1], 4)],
                "passed": lo <= band[1] and hi >= band[0],
            }
        )
    if spec.guess_rate_easy > 0 or spec.guess_rate_hard > 0:
        checks.append(
            {
                "check": "answer_entropy",
                "measured": None if answer_entropy is None else round(answer_entropy, 4),
                "target": [MIN_ANSWER_ENTROPY, None],
                "passed": answer_entropy is not None and answer_entropy >= MIN_ANSWER_ENTROPY,
            }
        )
    return {
        "passed": all(c["passed"] for c in checks),
        "checks": checks,
        "by_difficulty": [asdict(s) for s in stats],
        "answer_entropy": answer_entropy,
    }


def check_problems(spec: ToyWorldSpec, n: int, seed: int, exclude: set[str]) -> list[Problem]:
    """`n` problems of the world that the base has never seen (disjoint from `exclude`, its SFT
    questions and the RL splits), drawn from their own seed."""
    rng = random.Random(f"omgrpo-toy-check-{seed}")
    seen = set(exclude)  # one copy, grown in place (the caller's set stays untouched)
    budget = [50 * n + 1000]
    out: list[Problem] = []
    while len(out) < n:
        p = draw_distinct(rng, spec, f"check-{len(out)}", seen, budget)
        if p is None:
            break
        out.append(p)
    return out


def measure_base(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    spec: ToyWorldSpec,
    *,
    k: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
) -> dict:
    """Sample `k` responses per problem at the training temperature and return `acceptance`'s
    verdicts, including the mean entropy (nats) of the policy over answer-span tokens."""
    import torch

    from omgrpo.core.step import decode_responses
    from omgrpo.generation.rollout import response_logits, sample, stop_token_ids
    from omgrpo.tasks.prompts import PromptEncoder

    torch.manual_seed(0)
    encode = PromptEncoder(tokenizer, max_len=10_000)
    seqs = sample(
        model,
        [encode(p) for p in problems],
        n=k,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        eos_id=stop_token_ids(tokenizer, model),
        pad_id=tokenizer.pad_token_id,
    )
    responses = decode_responses(tokenizer, seqs.response_ids, seqs.response_mask)
    texts, answer_mask = responses.texts, responses.answer_mask
    entropies = []
    with torch.no_grad():  # `sample` is already
        for rows in torch.arange(len(seqs)).split(256):
            part = seqs.select(rows)
            logits = response_logits(model, part, pad_id=tokenizer.pad_token_id)
            logp = torch.log_softmax(logits, -1)
            entropy = -(logp.exp() * logp).sum(-1)
            entropies.append(entropy[answer_mask[rows]])
    answer_entropy = torch.cat(entropies)
    groups = [texts[i * k : (i + 1) * k] for i in range(len(problems))]
    return acceptance(
        difficulty_stats(problems, groups, spec),
        spec,
        float(answer_entropy.mean()) if answer_entropy.numel() else None,
    )


def write_base_checks(
    base_dir: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    spec: ToyWorldSpec,
    n_problems: int,
    seed: int,
    exclude: set[str],
) -> dict:
    """Measure a freshly trained base (`measure_base` on `n_problems` unseen problems), write
    `checks.json` into `base_dir` and print the verdict."""
    start = time.perf_counter()
    verdict = measure_base(model, tokenizer, check_problems(spec, n_problems, seed, exclude), spec)
    verdict["seconds"] = round(time.perf_counter() - start, 1)
    (Path(base_dir) / CHECKS_FILE).write_text(json.dumps(verdict, indent=2))
    print(format_checks(verdict), flush=True)
    return verdict


def read_base_checks(base_dir: Path) -> dict | None:
    """The stored verdict of a base, or None if it was never checked."""
    path = Path(base_dir) / CHECKS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def format_checks(verdict: dict) -> str:
    """One line per check and per difficulty, for logs and reports."""
    head = "base checks: " + ("PASSED" if verdict["passed"] else "FAILED")
    lines = [head]
    for c in verdict["checks"]:
        mark = "ok  " if c["passed"] else "FAIL"
        ci = f" (95% CI {c['ci95'][0]:.3f}-{c['ci95'][1]:.3f})" if "ci95" in c else ""
        lines.append(f"  {mark} {c['check']}: {c['measured']}{ci}, target {c['target']}")
    for d in verdict["by_difficulty"]:
        lines.append(
            f"  {d['difficulty']}: {d['problems']} problems, avg@k {d['avg_acc']:.3f}, "
            f"pass@k {d['pass_at_k']:.3f}, guess rate {d['guess_rate']:.3f}, "
            f"wrong-answer collisions {d['collision_rate']:.3f}, peak share {d['peak_share']:.3f}"
        )
    return "\n".join(lines)
