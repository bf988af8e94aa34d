"""Collapse diagnostics computed from one step's rollouts (labels, where known, only diagnose).

Pure functions over the step's answers; the metric names are the contract with trackers and
analysis (see the README's metric table). A mean or share over nothing is nan
(`omgrpo.core.means`). Task-specific readings (the toy world's guesses) come through the task's
`omgrpo.tasks.TaskProbe`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import astuple, dataclass

from omgrpo.core.answers import normalize
from omgrpo.core.means import mean_or_nan, share_or_nan
from omgrpo.core.rewards import RewardGroup, majority_class
from omgrpo.core.task import GUESS_KINDS, Problem, TaskProbe


def answer_diagnostics(
    groups: Sequence[RewardGroup], correct: Sequence[Sequence[bool | None]]
) -> dict[str, float]:
    """Answer diversity and vote statistics of a batch of groups.

    `correct[g][i]` is whether rollout i of group g matches the label (None: no label).
    - `answers/unique_per_prompt`: mean number of distinct answer classes per group
    - `answers/unique_per_batch`: distinct (normalised) answers over the whole batch
    - `answers/batch_mode_share`: share of all rollouts giving the batch's most common answer
      (the paper's "predicted-1 share"); `answers/batch_mode` is that answer
    - `answers/vote_entropy`: mean entropy (nats) of each group's answer distribution
    - `answers/extract_rate`: share of rollouts with an extractable boxed answer
    - `answers/top_vote_acc`: share of labelled groups whose majority answer is correct (the
      pseudo-label accuracy)
    - `answers/wrong_majority`: share of labelled groups whose majority answer is wrong (the
      rest had no answer at all)
    - `acc/train`: share of labelled rollouts that are correct
    """
    n_rollouts = sum(g.size for g in groups)
    extracted = [a for g in groups for a in g.answers if a is not None]
    batch_counts = Counter(normalize(a) for a in extracted)
    mode, mode_count = batch_counts.most_common(1)[0] if batch_counts else (None, 0)

    unique, entropies, top_hits, wrong_top, labelled = [], [], 0, 0, 0
    for g, ok in zip(groups, correct):
        counts = Counter(c for c in g.classes if c is not None)
        unique.append(len(counts))
        total = sum(counts.values())
        # a group without votes counts as entropy 0 (one state: nothing), not as missing
        entropies.append(
            -sum(n / total * math.log(n / total) for n in counts.values()) if total else 0.0
        )
        top = majority_class(g.classes)
        if g.label is not None:
            labelled += 1
            top_hits += top is not None and bool(ok[g.classes.index(top)])
            wrong_top += top is not None and not ok[g.classes.index(top)]
    flat = [c for ok in correct for c in ok if c is not None]
    return {
        "answers/unique_per_prompt": mean_or_nan(unique),
        "answers/unique_per_batch": float(len(batch_counts)),
        "answers/batch_mode": mode if mode is not None else "",
        "answers/batch_mode_share": share_or_nan(mode_count, n_rollouts),
        "answers/vote_entropy": mean_or_nan(entropies),
        "answers/extract_rate": share_or_nan(len(extracted), n_rollouts),
        "answers/top_vote_acc": share_or_nan(top_hits, labelled),
        "answers/wrong_majority": share_or_nan(wrong_top, labelled),
        "acc/train": mean_or_nan(float(c) for c in flat),
    }


@dataclass(frozen=True)
class GuessCounts:
    """How many of some rollouts box a guess, as the task's `TaskProbe` reads them."""

    rollouts: int
    answered: int
    """Rollouts with a boxed answer."""
    guesses: int
    """Answered rollouts whose box is not the value their reasoning computed last
    (`probe.is_guess`)."""
    bare: int
    """Answered rollouts with no computed value before the box (`probe.result_span` is None)."""
    peak: int
    """Rollouts boxing `probe.peak` (0 where the task has no peak)."""

    def __add__(self, other: GuessCounts) -> GuessCounts:
        return GuessCounts(*(a + b for a, b in zip(astuple(self), astuple(other))))


def count_guesses(
    texts: Sequence[str], answers: Sequence[str | None], probe: TaskProbe
) -> GuessCounts:
    """`GuessCounts` of rollouts `texts` with their boxed `answers` (None: no box); the one
    reading of guesses behind `guess_diagnostics` and the toy base checks."""
    answered = [(t, a) for t, a in zip(texts, answers) if a is not None]
    peak = 0
    if probe.peak is not None:
        peak = sum(a is not None and normalize(a) == probe.peak for a in answers)
    return GuessCounts(
        rollouts=len(answers),
        answered=len(answered),
        guesses=sum(bool(probe.is_guess(t, a)) for t, a in answered),
        bare=sum(probe.result_span(t) is None for t, _ in answered),
        peak=peak,
    )


def guess_diagnostics(
    texts: Sequence[str],
    answers: Sequence[str | None],
    difficulties: Sequence[str],
    probe: TaskProbe,
    prefix: str = "answers",
) -> dict[str, float]:
    """How the boxed answers relate to the reasoning before them (the shortcut worlds,
    docs/toy-worlds.md), read by the task's `probe` (`count_guesses`), over rollouts with an
    answer (nan when no rollout has one):
    - `<prefix>/consistency`: share whose answer is the value their reasoning computed last;
    - `<prefix>/guess_rate_<difficulty>`: share that box something else (`probe.is_guess`), by
      the problems' difficulty;
    - `<prefix>/bare_guess_rate`: share that box an answer with no computed line before it;
    - `<prefix>/peak_share`: share of all rollouts boxing `probe.peak` (the toy world's guess
      prior's peak value), if the task has one.
    """
    by_difficulty = {
        d: count_guesses(
            [t for t, dd in zip(texts, difficulties) if dd == d],
            [a for a, dd in zip(answers, difficulties) if dd == d],
            probe,
        )
        for d in sorted(set(difficulties))
    }
    total = sum(by_difficulty.values(), GuessCounts(0, 0, 0, 0, 0))
    out = {
        f"{prefix}/consistency": share_or_nan(total.answered - total.guesses, total.answered),
        f"{prefix}/bare_guess_rate": share_or_nan(total.bare, total.answered),
    }
    for d, counts in by_difficulty.items():
        out[f"{prefix}/guess_rate_{d}"] = share_or_nan(counts.guesses, counts.answered)
    if probe.peak is not None:
        out[f"{prefix}/peak_share"] = share_or_nan(total.peak, total.rollouts)
    return out


def task_diagnostics(
    texts: Sequence[str],
    answers: Sequence[str | None],
    prompts: Sequence[Problem],
    correct: Sequence[bool | None],
    probe: TaskProbe | None,
    prefix: str = "answers",
) -> dict[str, float]:
    """`guess_diagnostics` and `process_diagnostics` of rollouts (`prompts[i]` is rollout i's
    problem), by the problems' difficulty; {} without a probe or where a problem carries no
    difficulty (only the toy world's do)."""
    difficulties = [p.meta.get("difficulty") for p in prompts]
    if probe is None or not all(difficulties):
        return {}
    questions = [p.question for p in prompts]
    return {
        **guess_diagnostics(texts, answers, difficulties, probe, prefix),
        **process_diagnostics(texts, answers, questions, correct, difficulties, probe, prefix),
    }


def process_diagnostics(
    texts: Sequence[str],
    answers: Sequence[str | None],
    questions: Sequence[str],
    correct: Sequence[bool | None],
    difficulties: Sequence[str],
    probe: TaskProbe,
    prefix: str = "answers",
) -> dict[str, float]:
    """Process quality graded exactly by the task's `probe` (`probe.grade`; the toy world's
    ReCEval-style rubric, docs/metrics.md "Process quality") and the guess rate split into its
    kinds, by the problems' difficulty `<d>`; {} where the task grades nothing. Shares are over
    the rollouts with an answer (as `guess_diagnostics`'), line means over those with a line:
    - `<prefix>/line_acc_<d>`, `<prefix>/informativeness_<d>`: mean share of a rollout's
      reasoning lines that are arithmetically right / apply the problem's next operation;
    - `<prefix>/support_<d>`: share whose boxed answer follows from their reasoning as written;
    - `<prefix>/chain_acc_<d>`: share whose reasoning is the problem's own chain (reasoning
      accuracy, whatever they boxed);
    - `<prefix>/consistent_acc_<d>`: accuracy of those boxing the value they computed last;
    - `<prefix>/guess_<kind>_<d>` for each of `GUESS_KINDS`: share boxing that kind of guess
      (they add up to `<prefix>/guess_rate_<d>`).
    """
    rows = [
        (probe.grade(q, t, a), a, c, d)
        for t, a, q, c, d in zip(texts, answers, questions, correct, difficulties)
    ]
    rows = [r for r in rows if r[0] is not None]
    out: dict[str, float] = {}
    for d in sorted({r[3] for r in rows}):
        part = [(g, a, c) for g, a, c, dd in rows if dd == d]
        answered = [(g, c) for g, a, c in part if a is not None]
        lined = [g for g, _, _ in part if g.lines]
        out[f"{prefix}/line_acc_{d}"] = mean_or_nan(g.valid / g.lines for g in lined)
        out[f"{prefix}/informativeness_{d}"] = mean_or_nan(g.informative / g.lines for g in lined)
        out[f"{prefix}/support_{d}"] = mean_or_nan(float(g.supported) for g, _ in answered)
        out[f"{prefix}/chain_acc_{d}"] = mean_or_nan(float(g.chain_correct) for g, _ in answered)
        out[f"{prefix}/consistent_acc_{d}"] = mean_or_nan(
            float(c) for g, c in answered if g.guess_kind is None and c is not None
        )
        for kind in GUESS_KINDS:
            out[f"{prefix}/guess_{kind}_{d}"] = mean_or_nan(
                float(g.guess_kind == kind) for g, _ in answered
            )
    return out


def confidently_wrong(groups: Sequence[RewardGroup], correct, min_share: float) -> float:
    """Share of labelled groups whose majority answer is wrong while holding at least
    `min_share` of the group's votes (the model is sure, and sure of the wrong thing)."""
    hits, labelled = 0, 0
    for g, ok in zip(groups, correct):
        if g.label is None:
            continue
        labelled += 1
        top = majority_class(g.classes)
        if top is None:
            continue
        share = sum(c == top for c in g.classes) / g.size
        hits += share >= min_share and not ok[g.classes.index(top)]
    return share_or_nan(hits, labelled)


def majority_answers(groups: Sequence[RewardGroup]) -> list[str | None]:
    """Each group's pseudo-label: its majority answer, normalised (None: no votes)."""
    out = []
    for g in groups:
        top = majority_class(g.classes)
        out.append(None if top is None else normalize(g.answers[g.classes.index(top)]))
    return out


def label_flip_rate(
    prompt_ids: Sequence[str], pseudo_labels: Sequence[str | None], last_seen: dict[str, str]
) -> float:
    """Share of revisited prompts whose majority answer differs from their previous visit.
    Updates `last_seen` in place (it is part of the trainer's checkpointed state)."""
    flips, revisits = 0, 0
    for pid, label in zip(prompt_ids, pseudo_labels):
        if label is None:
            continue
        if pid in last_seen:
            revisits += 1
            flips += last_seen[pid] != label
        last_seen[pid] = label
    return share_or_nan(flips, revisits)


def recovery_metrics(correct: Sequence[Sequence[bool]], state: dict) -> dict[str, float]:
    """Failure recovery on the validation prompts (paper: prompts with initial pass@8 = 0).

    The first call fixes the prompts no sample solved; later calls report how many of them have
    been solved at least once so far (`recovery/cum_pass`) and their avg@k now
    (`recovery/cum_avg`). `state` is checkpointed by the trainer.
    """
    if "zero" not in state:
        state["zero"] = [i for i, ok in enumerate(correct) if not any(ok)]
        state["solved"] = []
    zero = state["zero"]
    solved = set(state["solved"]) | {i for i in zero if any(correct[i])}
    state["solved"] = sorted(solved)
    return {
        "recovery/zero_pass_prompts": float(len(zero)),
        "recovery/cum_pass": share_or_nan(len(solved), len(zero)),
        "recovery/cum_avg": mean_or_nan(sum(correct[i]) / len(correct[i]) for i in zero),
    }


COLLAPSE_DEFAULTS = {"max_unique_per_prompt": 1.5, "min_mode_share": 0.5, "patience": 3}
"""`CollapseDetector`'s thresholds unless configured: the trainers' `collapse.*` defaults
(`omgrpo.config.CollapseConfig`) and the analysis's for runs that did not record them."""


class CollapseDetector:
    """Flags collapse when, for `patience` consecutive steps, answers per prompt fall to at
    most `max_unique_per_prompt` AND the batch's most common answer holds at least
    `min_mode_share` of all rollouts: the model repeats one answer whatever the question."""

    def __init__(self, max_unique_per_prompt: float, min_mode_share: float, patience: int):
        self.max_unique, self.min_share, self.patience = (
            max_unique_per_prompt,
            min_mode_share,
            patience,
        )
        self.state = {"streak": 0, "detected_step": None}

    def update(self, step: int, metrics: dict[str, float]) -> bool:
        """Feed one step's metrics; True exactly once, at the step collapse is detected."""
        collapsed = (
            metrics["answers/unique_per_prompt"] <= self.max_unique
            and metrics["answers/batch_mode_share"] >= self.min_share
        )
        self.state["streak"] = self.state["streak"] + 1 if collapsed else 0
        if self.state["detected_step"] is None and self.state["streak"] >= self.patience:
            self.state["detected_step"] = step
            return True
        return False
