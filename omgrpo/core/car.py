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
- A pair answer that never closes its brace within `max_new_tokens` (`car/unclosed`) or is empty
  is None and casts no vote.
- Each solution is cut to its first `max_solution_tokens` tokens in the prompt (`car/truncated`
  counts the solutions cut).

Cost: the pairs (i, ·) of an anchor share the prompt up to "[Solution 2]\\n", and all pairs of a
group share the template + question. `generate_pair_answers` runs a prefix tree of KV caches
(chunk-common prefix -> question -> anchor -> pair tail), so each prefix is computed once, then
decodes a few tokens for all pairs of a chunk of anchors at once. `generate_pair_answers_plain`
is the unshared reference (same prompts, same decoding).

Diagnostics (`car_diagnostics`, paper appendix "Mechanistic Analysis of CAR") read the labels
only to diagnose: position bias, correct-answer selection, incorrect-pair preference and the
per-anchor entropy of pair answers split by the anchor's correctness.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from omgrpo.core.answers import Grader, cluster
from omgrpo.generation.engine import decode, prefix_tree_forward, stop_token_ids
from omgrpo.tasks import render_prompt

__all__ = [
    "CAR_INTRO",
    "CAR_MIDDLE",
    "CAR_OUTRO",
    "CarConfig",
    "CarResult",
    "car_diagnostics",
    "car_prompt",
    "car_text",
    "enumerate_pairs",
    "generate_pair_answers",
    "generate_pair_answers_plain",
    "parse_pair_answer",
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


def _scan_braces(text: str, depth: int = 0, escaped: bool = False) -> tuple[int, int, bool]:
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


def _scan_close(text: str) -> int:
    """Index of the `}` closing an already opened `{`, or -1 if it never closes."""
    return _scan_braces(text)[0]


def parse_pair_answer(text: str) -> str | None:
    """The answer in a continuation of an opened `\\boxed{`: the text up to the brace that
    closes it, stripped; None if it never closes or is empty.

    >>> parse_pair_answer("\\\\frac{1}{2}} because")
    '\\\\frac{1}{2}'
    >>> parse_pair_answer("12") is None
    True
    """
    close = _scan_close(text)
    if close < 0:
        return None
    return text[:close].strip() or None


def _truncate(tokenizer: Any, texts: list[str], max_tokens: int) -> tuple[list[str], int]:
    """Cut each text to its first `max_tokens` tokens; returns (texts, number cut)."""
    if max_tokens <= 0 or not texts:
        return list(texts), 0
    out, cut = [], 0
    try:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizers: no offsets
        enc, offsets = tokenizer(texts, add_special_tokens=False), None
    for k, text in enumerate(texts):
        ids = enc["input_ids"][k]
        if len(ids) <= max_tokens:
            out.append(text)
            continue
        cut += 1
        if offsets is not None:
            out.append(text[: offsets[k][max_tokens - 1][1]])
        else:
            out.append(tokenizer.decode(ids[:max_tokens], skip_special_tokens=True))
    return out, cut


# ----------------------------------------------------------------------------------------
# Brace-aware stop rule
# ----------------------------------------------------------------------------------------
class _BraceTracker:
    """Per-row brace depth over decoded token pieces: a row is closed once the `{` opened by
    the prompt is closed (the same scan as `parse_pair_answer`)."""

    def __init__(self, tokenizer: Any, n_rows: int):
        self.tokenizer, self.pieces = tokenizer, {}
        self.depth, self.escaped = [0] * n_rows, [False] * n_rows

    def piece(self, tok: int) -> str:
        if tok not in self.pieces:
            self.pieces[tok] = self.tokenizer.decode([tok], skip_special_tokens=True)
        return self.pieces[tok]

    def closes(self, row: int, tok: int) -> bool:
        close, self.depth[row], self.escaped[row] = _scan_braces(
            self.piece(tok), self.depth[row], self.escaped[row]
        )
        return close >= 0


def _decode_answers(model, tokenizer, prefill, cfg) -> list[list[int]]:
    """Sample up to `max_new_tokens` per row (`omgrpo.generation.engine.decode`), a row stopping at the
    brace that closes the prompt's `\\boxed{` or at an eos. Returns each row's tokens (closing
    piece and eos included)."""
    logits, cache, mask, next_pos = prefill
    stops = set(stop_token_ids(tokenizer, model))
    braces = _BraceTracker(tokenizer, logits.shape[0])

    def stop(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ended = [
            tok in stops or braces.closes(r, tok) for r, tok in zip(rows.tolist(), tokens.tolist())
        ]
        return torch.tensor(ended, dtype=torch.bool, device=tokens.device)

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens, lengths = decode(
        model,
        logits[:, -1, :],
        cache,
        mask,
        next_pos,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        stop=stop,
        pad_id=pad,
    )
    return [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist())]


# ----------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------
def generate_pair_answers(
    model: torch.nn.Module,
    tokenizer: Any,
    groups: Sequence[tuple[str, Sequence[str]]],
    cfg: Any,
    rng: random.Random | int | None = None,
) -> CarResult:
    """Pair answers of one step with the current policy, sharing the KV cache of common
    prefixes (chunk -> question -> anchor -> pair).

    `groups`: (question, the G decoded rollout texts) per prompt; `cfg`: a `CarConfig` (or the
    `car` section of the config); `rng`: pair sampling when `pairs_per_anchor` is set (a
    `random.Random` or a seed). Sampling uses the global torch RNG, like the rollout sampler.
    """
    return _generate(model, tokenizer, groups, cfg, rng, share_prefix=True)


def generate_pair_answers_plain(
    model: torch.nn.Module,
    tokenizer: Any,
    groups: Sequence[tuple[str, Sequence[str]]],
    cfg: Any,
    rng: random.Random | int | None = None,
) -> CarResult:
    """Reference path: the same prompts and decoding as `generate_pair_answers`, each pair
    prompt prefilled whole in a left-padded batch (no prefix sharing)."""
    return _generate(model, tokenizer, groups, cfg, rng, share_prefix=False)


@contextmanager
def _attention_kernel(model: torch.nn.Module, prefer_sdpa: bool):
    """Switch an eager-attention model to SDPA for the block (restored afterwards)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    switch = prefer_sdpa and current == "eager" and hasattr(model, "set_attn_implementation")
    if switch:
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError):  # a model without SDPA support keeps eager
            switch = False
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(current)


@torch.no_grad()
def _generate(model, tokenizer, groups, cfg, rng, share_prefix: bool) -> CarResult:
    with _attention_kernel(model, getattr(cfg, "prefer_sdpa", True)):
        return _generate_pairs(model, tokenizer, groups, cfg, rng, share_prefix)


def _generate_pairs(model, tokenizer, groups, cfg, rng, share_prefix: bool) -> CarResult:
    if not isinstance(rng, random.Random):
        rng = random.Random(0 if rng is None else rng)
    pairs, heads, solutions, truncated = [], [], [], 0
    for question, sols in groups:
        cut, n_cut = _truncate(tokenizer, list(sols), cfg.max_solution_tokens)
        truncated += n_cut
        solutions.append(cut)
        heads.append(render_prompt(tokenizer, question))
        pairs.append(enumerate_pairs(len(sols), cfg.pairs_per_anchor, rng))

    # Rows in (group, anchor, partner) order; anchors are never split across chunks.
    flat = [(g, i, j) for g, ps in enumerate(pairs) for i, j in ps]
    texts = [car_text(heads[g], solutions[g][i], solutions[g][j]) for g, i, j in flat]
    # Each distinct prompt is tokenized once: pairs repeat whenever a group's solutions agree.
    distinct = list(dict.fromkeys(texts))
    encoded = tokenizer(distinct, add_special_tokens=False)["input_ids"] if distinct else []
    ids_of = dict(zip(distinct, encoded))
    ids = [ids_of[text] for text in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    generated: list[list[int]] = []
    for lo, hi in _anchor_chunks(flat, max(1, int(cfg.chunk_pairs))):
        rows = [list(r) for r in ids[lo:hi]]
        levels = []
        if share_prefix:
            keys = flat[lo:hi]
            # system prompt, question, anchor solution (by text: identical solutions share)
            levels = [
                [0] * len(rows),
                [g for g, _, _ in keys],
                [(g, solutions[g][i]) for g, i, _ in keys],
            ]
        prefill = prefix_tree_forward(model, rows, levels, pad)
        generated.extend(_decode_answers(model, tokenizer, prefill, cfg))
        del prefill

    result = CarResult(
        pairs=pairs,
        answers=[[] for _ in pairs],
        texts=[[] for _ in pairs],
        truncated=truncated,
        num_pairs=len(flat),
    )
    for (g, _, _), toks in zip(flat, generated):
        text = tokenizer.decode(toks, skip_special_tokens=True)
        close = _scan_close(text)
        answer = text[:close].strip() if close >= 0 else None
        result.unclosed += close < 0
        result.empty += close >= 0 and not answer
        result.answers[g].append(answer or None)
        result.texts[g].append(text)
    return result


def _anchor_chunks(flat: list[tuple[int, int, int]], max_rows: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of at most `max_rows` rows made of whole anchors (an anchor with
    more pairs than `max_rows` gets a chunk of its own)."""
    bounds, lo, k = [], 0, 0
    while k < len(flat):
        end = k
        while end < len(flat) and flat[end][:2] == flat[k][:2]:
            end += 1
        if end - lo > max_rows and k > lo:
            bounds.append((lo, k))
            lo = k
        k = end
    if lo < len(flat):
        bounds.append((lo, len(flat)))
    return bounds


# ----------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------
def _entropy(values: Sequence[int]) -> float:
    counts = Counter(values)
    n = len(values)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def _share(hits: int, n: int) -> float:
    return hits / n if n else float("nan")


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


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
        "car/position_bias": _share(*first),
        "car/select_correct": _share(*select),
        "car/incorrect_pair_first": _share(*wrong_first),
        "car/anchor_entropy_correct": _mean(entropy[True]),
        "car/anchor_entropy_incorrect": _mean(entropy[False]),
        "car/pool_size": _mean(pool_sizes),
        "car/unclosed": float("nan") if unclosed is None else _share(unclosed, num_pairs),
        "car/truncated": float("nan") if truncated is None else float(truncated),
        "car/num_pairs": float(num_pairs),
    }


def _top_vote_hit(
    answers: Sequence[str | None], pool: Sequence[str | None], label: str, grader: Grader
) -> bool:
    """Whether the most frequent answer class of answers + pool is equivalent to the label
    (ties: the class seen first, as `omgrpo.core.rewards.majority_class`)."""
    voters = list(answers) + list(pool)
    ids = cluster([*voters, label], grader)  # the label comes last, so it never changes voter ids
    counts = Counter(c for c in ids[:-1] if c is not None)
    return bool(counts) and counts.most_common(1)[0][0] == ids[-1]


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
    return _share(hits, labelled)


def top_vote_metrics(
    rollout_answers: Sequence[Sequence[str | None]],
    pair_answers: Sequence[Sequence[str | None]],
    labels: Sequence[str | None],
    grader: Grader | None = None,
) -> dict[str, float]:
    """`answers/top_vote_acc` over the CAR-augmented pool and `car/top_vote_acc_without_car`
    over the rollouts alone (labels diagnose only), with the step's `grader`."""
    groups = list(zip(rollout_answers, pair_answers))
    grader = grader if grader is not None else Grader()
    return {
        "answers/top_vote_acc": top_vote_acc(groups, labels, True, grader),
        "car/top_vote_acc_without_car": top_vote_acc(groups, labels, False, grader),
    }
