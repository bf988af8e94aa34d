"""Contrast-Augmented Reward (CAR, paper §3.3): pairwise answers that enlarge the soft-vote pool.

For every ordered pair (i, j), i != j, of a group's G rollouts the *current* policy reads a
contrastive prompt (the paper's template, appendix "Prompt template for CAR"): the chat template
with the question, then an already started assistant turn

    Here are two possible solutions:

    [Solution 1]
    {rollout i}

    [Solution 2]
    {rollout j}

    Based on the reasoning in the solutions above, the correct final answer is \\boxed{

and generates only the short answer z_ij that closes the brace (`max_new_tokens`, default 8;
decoding stops once every row has closed its brace). The augmented pool is

    Z_aug = {z_i}_{i=1..G}  ∪  {z_ij}_{i != j}        (G + G(G-1) voters instead of G)

and the soft reward of rollout i is the share of Z_aug equivalent to z_i: pass the pair answers
as `pool` to `omgrpo.core.rewards.make_group` and use the `soft_vote` reward. Answers from fragile
reasoning or lucky guesses are rarely reproduced by the comparisons, so their share is diluted;
robust reasoning is repeatedly favoured and gains share.

Contracts:

- Pair answers are *validators only*: they vote in the pool and are never trained on. A
  `CarResult` holds strings only (no token ids, no log-probs); the training batch stays
  B = prompts x G rollouts.
- Rollouts without a boxed answer still take part in pairs (as in the paper): their reasoning is
  shown to the model; they simply cast no vote of their own.
- A pair answer that never closes its brace within `max_new_tokens` or is empty is None and
  casts no vote. `car/unclosed` counts only the first kind (the brace never closed: the budget
  ran out or the model stopped); an empty `\\boxed{}` is closed, counted in `CarResult.empty`.
  Both backends read a continuation with `read_pair_answer`, so the count means one thing.
- Each solution is cut to its first `max_solution_tokens` tokens in the prompt (`car/truncated`
  counts the solutions cut).

This module is the pure half, shared by both backends: pairs, the prompt (`car_text`), the
solution cut (`cut_solutions`), parsing (`read_pair_answer`), the pool and diagnostics. The
native engine's generation is `omgrpo.generation.car.generate_pair_answers`; verl sends the same
prompts to its rollout servers (`omgrpo.backends.verl.agent_loop`).

Diagnostics (`car_diagnostics`, paper appendix "Mechanistic Analysis of CAR") read the labels
only to diagnose: position bias, correct-answer selection, incorrect-pair preference and the
per-anchor entropy of pair answers split by the anchor's correctness.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from omgrpo.core.answers import Grader, cluster
from omgrpo.core.means import mean_or_nan, share_or_nan
from omgrpo.core.prompt import render_prompt
from omgrpo.core.rewards import majority_class

__all__ = [
    "CAR_INTRO",
    "CAR_MIDDLE",
    "CAR_OUTRO",
    "CarConfig",
    "CarResult",
    "PairAnswer",
    "car_diagnostics",
    "car_prompt",
    "car_text",
    "cut_solutions",
    "enumerate_pairs",
    "parse_pair_answer",
    "read_pair_answer",
    "scan_braces",
    "top_vote_acc",
    "top_vote_metrics",
]

# The assistant text of the paper's CAR template, around the two solutions.
CAR_INTRO = "Here are two possible solutions:\n\n[Solution 1]\n"
CAR_MIDDLE = "\n\n[Solution 2]\n"
CAR_OUTRO = (
    "\n\nBased on the reasoning in the solutions above, the correct final answer is \\boxed{"
)


@dataclass
class CarConfig:
    enable: bool = False
    """Add CAR's pairwise answers to the soft-vote pool (paper §3.3); off: plain soft vote."""
    max_new_tokens: int = 8
    """Most tokens generated per pair answer; generation stops at the brace closing `\\boxed{`
    (an answer still open after this budget is None, logged as `car/unclosed`)."""
    pairs_per_anchor: int | None = None
    """None: all G(G-1) ordered pairs; K: K partners per anchor i, drawn by a seeded RNG
    (K >= G-1 means all partners)."""
    max_solution_tokens: int = 256
    """Each solution is cut to its first this-many tokens in the pair prompt (`car/truncated`
    counts the cut solutions); <= 0 keeps solutions whole."""
    temperature: float = 1.0
    """Sampling temperature of the pair answers (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold of the pair answers."""
    chunk_pairs: int = 128
    """Most pair prompts prefilled and decoded together (whole anchors are kept together, so a
    chunk holds at least one anchor's pairs); lower it to save memory, raise it on a GPU."""
    prefer_sdpa: bool = True
    """Run CAR's forwards with PyTorch SDPA while the model uses eager attention (the toy
    model's choice for short rollouts): pair prompts are long, and SDPA prefills them ~1.7x
    faster on CPU. Other kernels (sdpa, flash) are left alone; the model is restored after."""


@dataclass
class CarResult:
    """Pair answers of one step; strings and counters only (nothing here is trained on)."""

    pairs: list[list[tuple[int, int]]]
    """Per group: the ordered pairs (i, j) compared, grouped by anchor i."""
    answers: list[list[str | None]]
    """Per group, aligned with `pairs`: z_ij, the content of the closed `\\boxed{}` (None:
    unclosed or empty). Pass as `pool` to `make_group`."""
    texts: list[list[str]] = field(default_factory=list)
    """Per group, aligned with `pairs`: the raw generated continuation (for inspection)."""
    truncated: int = 0
    """Solutions cut to `max_solution_tokens` (each solution counted once per step)."""
    unclosed: int = 0
    """Pair answers whose brace was not closed within `max_new_tokens` (or that hit eos)."""
    empty: int = 0
    """Pair answers that closed the brace with nothing inside."""
    num_pairs: int = 0
    """Pairs compared over all groups."""

    def add(self, g: int, read: PairAnswer, text: str) -> None:
        """Append one pair's answer (in `pairs[g]` order) and count it as unclosed / empty."""
        self.answers[g].append(read.answer)
        self.texts[g].append(text)
        self.unclosed += not read.closed
        self.empty += read.closed and read.answer is None

    def diagnostics(
        self,
        rollout_answers: Sequence[Sequence[str | None]],
        correct: Sequence[Sequence[bool | None]],
        grader: Grader | None = None,
    ) -> dict[str, float]:
        """`car_diagnostics` of this result, with its unclosed / truncated counters."""
        return car_diagnostics(
            self.pairs,
            self.answers,
            rollout_answers,
            correct,
            unclosed=self.unclosed,
            truncated=self.truncated,
            grader=grader,
        )


# ----------------------------------------------------------------------------------------
# Pairs, prompts, parsing
# ----------------------------------------------------------------------------------------
def enumerate_pairs(
    G: int, pairs_per_anchor: int | None = None, rng: random.Random | int | None = None
) -> list[tuple[int, int]]:
    """Ordered pairs (i, j), i != j, grouped by anchor i (partners ascending).

    None: all G(G-1) pairs. K: K partners per anchor drawn without replacement from `rng`
    (a `random.Random`, or an int seed; None means seed 0), so the pairs are deterministic
    under a seed.

    >>> enumerate_pairs(3)
    [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    """
    if pairs_per_anchor is not None and pairs_per_anchor < 0:
        raise ValueError(f"car.pairs_per_anchor must be >= 0 or null, got {pairs_per_anchor}")
    if not isinstance(rng, random.Random):
        rng = random.Random(0 if rng is None else rng)
    pairs = []
    for i in range(G):
        others = [j for j in range(G) if j != i]
        if pairs_per_anchor is not None and pairs_per_anchor < len(others):
            others = sorted(rng.sample(others, pairs_per_anchor))
        pairs.extend((i, j) for j in others)
    return pairs


def car_prompt(tokenizer: Any, question: str, solution_1: str, solution_2: str) -> str:
    """The paper's CAR prompt: the model's chat template (system prompt of the paper, the
    question, an open assistant turn) followed by the two solutions and an opened `\\boxed{`."""
    return car_text(render_prompt(tokenizer, question), solution_1, solution_2)


def car_text(head: str, solution_1: str, solution_2: str) -> str:
    """The CAR prompt after a given head (the chat-template part; "" for the tail alone)."""
    return head + CAR_INTRO + solution_1 + CAR_MIDDLE + solution_2 + CAR_OUTRO


def scan_braces(text: str, depth: int = 0, escaped: bool = False) -> tuple[int, int, bool]:
    """Scan `text` for the `}` closing an already opened `{` (nested braces balanced, `\\{` /
    `\\}` escaped as in `omgrpo.core.answers`), continuing from a brace depth and a pending
    backslash. Returns (its index or -1, the depth and the pending backslash after the scan)."""
    for k, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                return k, depth, escaped
    return -1, depth, escaped


class PairAnswer(NamedTuple):
    """A pair's continuation of the opened `\\boxed{`, read (`read_pair_answer`)."""

    answer: str | None
    """The boxed content, stripped; None when unclosed or empty (no vote)."""
    closed: bool
    """Whether the brace was closed: False is what `car/unclosed` counts."""


def read_pair_answer(text: str) -> PairAnswer:
    """Read a continuation of an opened `\\boxed{` (both backends): the text up to the brace
    that closes it, stripped, and whether it closed at all."""
    close = scan_braces(text)[0]
    if close < 0:
        return PairAnswer(None, False)
    return PairAnswer(text[:close].strip() or None, True)


def parse_pair_answer(text: str) -> str | None:
    """The answer in a continuation of an opened `\\boxed{`; None if it never closes or is
    empty (`read_pair_answer` tells the two apart).

    >>> parse_pair_answer("\\\\frac{1}{2}} because")
    '\\\\frac{1}{2}'
    >>> parse_pair_answer("12") is None
    True
    """
    return read_pair_answer(text).answer


def cut_solutions(
    tokenizer: Any, texts: Sequence[str], max_tokens: int
) -> tuple[list[str], list[bool]]:
    """Cut each solution text to its first `max_tokens` tokens as the tokenizer encodes the text
    (<= 0: whole); returns the texts and which were cut. Both backends cut with this, so a
    solution is cut at the same place whichever backend built the pair prompt."""
    if max_tokens <= 0 or not texts:
        return list(texts), [False] * len(texts)
    out, cut = [], []
    try:
        enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizers: no offsets
        enc, offsets = tokenizer(list(texts), add_special_tokens=False), None
    for k, text in enumerate(texts):
        ids = enc["input_ids"][k]
        cut.append(len(ids) > max_tokens)
        if not cut[-1]:
            out.append(text)
            continue
        if offsets is not None:
            out.append(text[: offsets[k][max_tokens - 1][1]])
        else:
            out.append(tokenizer.decode(ids[:max_tokens], skip_special_tokens=True))
    return out, cut


# ----------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------
def _entropy(values: Sequence[int]) -> float:
    counts = Counter(values)
    n = len(values)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def car_diagnostics(
    pairs: Sequence[Sequence[tuple[int, int]]],
    pair_answers: Sequence[Sequence[str | None]],
    rollout_answers: Sequence[Sequence[str | None]],
    correct: Sequence[Sequence[bool | None]],
    *,
    unclosed: int | None = None,
    truncated: int | None = None,
    grader: Grader | None = None,
) -> dict[str, float]:
    """CAR's mechanistic diagnostics over one step's groups (paper appendix, "Mechanistic
    Analysis of CAR"); labels enter only through `correct[g][i]` (None: unlabelled).

    Answers are compared by equivalence class (`omgrpo.core.answers.cluster` over each group's
    rollout and pair answers, with the step's `grader`; default: a fresh `Grader`). A pair "picks" solution 1 (2) when its answer is equivalent to
    z_i (z_j); pairs whose answer is None are left out of every share.

    - `car/position_bias`: pairs whose solutions have different answers (both present) and
      whose answer picks one of them: share picking solution 1 (0.5 = no order preference)
    - `car/select_correct`: pairs with exactly one correct solution: share of pair answers
      equivalent to the correct solution's answer
    - `car/incorrect_pair_first`: both solutions wrong with different answers, the pair answer
      picks one of them: share picking solution 1
    - `car/anchor_entropy_correct` / `_incorrect`: entropy (nats) of the pair answers of all
      comparisons involving rollout i (as solution 1 or 2), averaged over the correct /
      incorrect rollouts that have at least one pair answer
    - `car/pool_size`: mean pool size per group, G + valid pair answers
    - `car/unclosed`: share of pairs whose brace never closed (needs `unclosed`)
    - `car/truncated`: solutions cut to `max_solution_tokens` (needs `truncated`)
    - `car/num_pairs`: pairs compared

    NaN where a quantity is undefined (no qualifying pair, count not given).
    """
    first = [0, 0]  # [picks solution 1, picks either] when answers differ
    select = [0, 0]  # [correct picked, pairs with exactly one correct solution]
    wrong_first = [0, 0]
    entropy: dict[bool, list[float]] = {True: [], False: []}
    pool_sizes, num_pairs = [], 0
    grader = grader if grader is not None else Grader()
    for ps, answers, z, ok in zip(pairs, pair_answers, rollout_answers, correct):
        G = len(z)
        ids = cluster(list(z) + list(answers), grader)
        rc, pc = ids[:G], ids[G:]
        num_pairs += len(ps)
        pool_sizes.append(G + sum(c is not None for c in pc))
        involved: list[list[int]] = [[] for _ in range(G)]
        for (i, j), a in zip(ps, pc):
            if a is None:
                continue
            involved[i].append(a)
            involved[j].append(a)
            ci, cj = rc[i], rc[j]
            differ = ci is not None and cj is not None and ci != cj
            if differ and a in (ci, cj):
                first[0] += a == ci
                first[1] += 1
            if ok[i] is not None and ok[j] is not None and bool(ok[i]) != bool(ok[j]):
                good = rc[i] if ok[i] else rc[j]
                select[0] += good is not None and a == good
                select[1] += 1
            both_wrong = ok[i] is not None and ok[j] is not None and not ok[i] and not ok[j]
            if both_wrong and differ and a in (ci, cj):
                wrong_first[0] += a == ci
                wrong_first[1] += 1
        for i in range(G):
            if ok[i] is not None and involved[i]:
                entropy[bool(ok[i])].append(_entropy(involved[i]))
    return {
        "car/position_bias": share_or_nan(*first),
        "car/select_correct": share_or_nan(*select),
        "car/incorrect_pair_first": share_or_nan(*wrong_first),
        "car/anchor_entropy_correct": mean_or_nan(entropy[True]),
        "car/anchor_entropy_incorrect": mean_or_nan(entropy[False]),
        "car/pool_size": mean_or_nan(pool_sizes),
        "car/unclosed": float("nan") if unclosed is None else share_or_nan(unclosed, num_pairs),
        "car/truncated": float("nan") if truncated is None else float(truncated),
        "car/num_pairs": float(num_pairs),
    }


def _top_vote_hit(
    answers: Sequence[str | None], pool: Sequence[str | None], label: str, grader: Grader
) -> bool:
    """Whether the most frequent answer class of answers + pool is equivalent to the label
    (`omgrpo.core.rewards.majority_class`: ties go to the class seen first)."""
    voters = list(answers) + list(pool)
    ids = cluster([*voters, label], grader)  # the label comes last, so it never changes voter ids
    top = majority_class(ids[:-1])
    return top is not None and top == ids[-1]


def top_vote_acc(
    groups_with_pool: Sequence[tuple[Sequence[str | None], Sequence[str | None] | None]],
    labels: Sequence[str | None],
    use_pool: bool = True,
    grader: Grader | None = None,
) -> float:
    """Share of labelled groups whose majority answer is correct.

    `groups_with_pool`: (rollout answers, CAR pair answers or None) per group; with `use_pool`
    the vote runs over the augmented pool, without it over the rollouts only. NaN when no
    group has a label. `grader`: the step's (default: a fresh `Grader`).
    """
    grader = grader if grader is not None else Grader()
    hits, labelled = 0, 0
    for (answers, pool), label in zip(groups_with_pool, labels):
        if label is None:
            continue
        labelled += 1
        hits += _top_vote_hit(answers, (pool or []) if use_pool else [], label, grader)
    return share_or_nan(hits, labelled)


def top_vote_metrics(
    rollout_answers: Sequence[Sequence[str | None]],
    pair_answers: Sequence[Sequence[str | None]],
    labels: Sequence[str | None],
    grader: Grader | None = None,
) -> dict[str, float]:
    """`car/top_vote_acc`: the top vote over the CAR-augmented pool (rollouts + pair answers;
    labels diagnose only), with the step's `grader`. The rollouts' own vote is
    `answers/top_vote_acc` in every run, CAR or not (`omgrpo.core.diagnostics`)."""
    groups = list(zip(rollout_answers, pair_answers))
    grader = grader if grader is not None else Grader()
    return {"car/top_vote_acc": top_vote_acc(groups, labels, True, grader)}
