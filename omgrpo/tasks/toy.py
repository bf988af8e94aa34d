"""The toy reasoning world: multi-step arithmetic with chain-of-thought solutions.

A problem is a short chain of operations evaluated left to right, e.g.

    question:   "Evaluate left to right: 7+5*3-4"
    paraphrase: "Start with 7, add 5, multiply by 3, subtract 4. What is the result?"
    solution:   "7+5=12\n12*3=36\n36-4=32\nThe answer is \\boxed{32}."
    answer:     "32"

Every intermediate value stays in [0, max_value], so answers are short integers and a tiny
character-level model can learn the world from a few hundred SFT steps. Difficulty grows with
the number of steps; ground truth is known exactly, which is what lets us measure collapse.
Splits are generated from disjoint seeds and deduplicated, so train/val/test never share a
question.

Shortcut worlds (`docs/toy-worlds.md`), where the paper's collapse route exists. The paper's
collapse runs through the answer tokens: the policy learns to box a shared default answer ("1"
in its case study) whatever the reasoning says, and majority voting rewards the agreement. In
the faithful world above, the boxed answer is a copy of the last line, so there is no such
route. A spec with `guess_rate_*` > 0 gives the base one: a share of its SFT solutions (larger
on hard problems, as a base guesses more where it cannot reason) end in ``\\boxed{g}`` with g
drawn from a skewed guess prior (P(g = `guess_peak`) = `guess_peak_p`, else uniform), not the
value the lines computed. With `bare_guess` such a solution is only the closing sentence, so the
decision to guess sits in unmasked tokens. Labels always stay the true values; only the SFT text
changes.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from typing import Any

from omgrpo.core.answers import normalize
from omgrpo.core.task import Problem, ProcessGrade, TaskSplits
from omgrpo.tasks.toy_process import grade_process, parse_question

_OP_WORDS = {"+": "add", "-": "subtract", "*": "multiply by"}


@dataclass
class ToyWorldSpec:
    """Parameters of the generator: the one declaration of the toy world's fields and defaults.

    `omgrpo.config.TaskConfig` inherits them (the `task.*` keys: `task.hard_share=0.5`), and a
    toy base's cache key is built from them (`omgrpo.models.base_key._world_key`), so a default can
    only change in one place, where the key's dependence on it is visible. Not frozen because
    Hydra cannot override a frozen dataclass's node; treat a spec as a value (`replace`)."""

    min_steps: int = 2
    """Fewest operations per problem."""
    max_steps: int = 3
    """Most operations per problem (harder problems, lower base accuracy)."""
    max_start: int = 20
    """Largest starting value."""
    max_operand: int = 20
    """Largest operand of + and -."""
    max_factor: int = 5
    """Largest multiplier."""
    max_value: int = 99
    """Every intermediate value stays in [0, max_value]."""
    hard_share: float = 0.0
    """Share of problems from the hard regime (`hard_steps` operations and the `hard_*` ranges:
    the schema's wide ranges, where a 600-step base is right ~25% of the time); the rest follow
    the ranges above ("easy")."""
    hard_steps: int = 3
    """Operations per hard problem."""
    hard_max_start: int = 20
    """Largest starting value of hard problems."""
    hard_max_operand: int = 20
    """Largest operand of + and - in hard problems."""
    hard_max_factor: int = 5
    """Largest multiplier in hard problems."""
    hard_max_value: int = 99
    """Value range of hard problems."""
    guess_rate_easy: float = 0.0
    """Shortcut worlds, SFT only: share of easy solutions whose boxed answer is a guess from the
    prior (docs/toy-worlds.md)."""
    guess_rate_hard: float = 0.0
    """Shortcut worlds, SFT only: the same for hard problems."""
    guess_peak: int = 1
    """The guess prior's peak value (the paper's collapse answer is "1")."""
    guess_peak_p: float = 0.6
    """P(guess = guess_peak); otherwise uniform over [0, the regime's max value]. 0 = flat prior."""
    bare_guess: bool = False
    """A guessed SFT solution is only "So the answer is \\boxed{g}." (no reasoning lines)."""

    def __post_init__(self) -> None:
        for name in ("hard_share", "guess_rate_easy", "guess_rate_hard", "guess_peak_p"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"toy task: {name} must be in [0, 1], got {value}")
        if self.hard_share > 0 and self.hard_steps < 1:
            raise ValueError(f"toy task: hard_steps must be >= 1, got {self.hard_steps}")

    @property
    def hard(self) -> ToyWorldSpec:
        """The generator ranges of the hard regime."""
        return replace(
            self,
            min_steps=self.hard_steps,
            max_steps=self.hard_steps,
            max_start=self.hard_max_start,
            max_operand=self.hard_max_operand,
            max_factor=self.hard_max_factor,
            max_value=self.hard_max_value,
            hard_share=0.0,
        )

    def guess_rate(self, difficulty: str) -> float:
        return self.guess_rate_hard if difficulty == "hard" else self.guess_rate_easy

    @classmethod
    def from_config(cls, task_cfg: Any) -> ToyWorldSpec:
        """The generator fields of a `TaskConfig` (a composed `task` node), validated."""
        return cls(**{f: getattr(task_cfg, f) for f in cls.__dataclass_fields__})


def _sample_chain(rng: random.Random, spec: ToyWorldSpec) -> tuple[int, list[tuple[str, int]]]:
    start = rng.randint(1, spec.max_start)
    value, ops = start, []
    for _ in range(rng.randint(spec.min_steps, spec.max_steps)):
        choices = []
        if value < spec.max_value:
            choices.append("+")
        if value > 0:
            choices.append("-")
        if 2 * value <= spec.max_value and value > 0:
            choices.append("*")
        op = rng.choice(choices)
        if op == "+":
            operand = rng.randint(1, min(spec.max_operand, spec.max_value - value))
            value += operand
        elif op == "-":
            operand = rng.randint(1, min(spec.max_operand, value))
            value -= operand
        else:
            operand = rng.randint(2, min(spec.max_factor, spec.max_value // value))
            value *= operand
        ops.append((op, operand))
    return start, ops


def make_problem(
    rng: random.Random, spec: ToyWorldSpec, pid: str, difficulty: str = "easy"
) -> Problem:
    """One problem of `spec`'s ranges (the hard regime's if `difficulty == "hard"`)."""
    start, ops = _sample_chain(rng, spec.hard if difficulty == "hard" else spec)
    question = "Evaluate left to right: " + str(start) + "".join(f"{o}{n}" for o, n in ops)
    words = ", ".join(f"{_OP_WORDS[o]} {n}" for o, n in ops)
    paraphrase = f"Start with {start}, {words}. What is the result?"
    lines, value = [], start
    for op, n in ops:
        new = value + n if op == "+" else value - n if op == "-" else value * n
        lines.append(f"{value}{op}{n}={new}")
        value = new
    solution = "\n".join(lines) + f"\nSo the answer is \\boxed{{{value}}}."
    return Problem(
        id=pid,
        question=question,
        answer=str(value),
        solution=solution,
        paraphrase=paraphrase,
        meta={"steps": len(ops), "difficulty": difficulty},
    )


def draw_difficulty(rng: random.Random, spec: ToyWorldSpec) -> str:
    # No draw at all without a hard regime, so the faithful world's splits are unchanged.
    if spec.hard_share <= 0:
        return "easy"
    return "hard" if rng.random() < spec.hard_share else "easy"


def draw_distinct(
    rng: random.Random, spec: ToyWorldSpec, pid: str, seen: set[str], budget: list[int]
) -> Problem | None:
    """A problem whose question is not in `seen` (added to it), or None once `budget[0]` draws
    are spent. The difficulty is drawn once and kept across redraws: easy questions come from a
    smaller space and collide more often, so redrawing the difficulty with the question would
    tilt every de-duplicated sample toward hard problems (41 easy vs 87 hard at `hard_share`
    0.5 in the first shortcut world)."""
    difficulty = draw_difficulty(rng, spec)
    while budget[0] > 0:
        budget[0] -= 1
        p = make_problem(rng, spec, pid, difficulty)
        if p.question not in seen:
            seen.add(p.question)
            return p
    return None


def draw_guess(rng: random.Random, spec: ToyWorldSpec, difficulty: str) -> int:
    """A value from the guess prior: `guess_peak` with probability `guess_peak_p`, else uniform
    over the regime's value range."""
    if rng.random() < spec.guess_peak_p:
        return spec.guess_peak
    top = spec.hard_max_value if difficulty == "hard" else spec.max_value
    return rng.randint(0, top)


def with_guess(problem: Problem, guess: int, bare: bool) -> Problem:
    """`problem` whose worked solution boxes `guess` instead of the computed value (the lines
    stay correct), or, if `bare`, is only the closing sentence. The label is unchanged."""
    closing = f"So the answer is \\boxed{{{guess}}}."
    lines = (problem.solution or "").split("\n")[:-1]
    solution = closing if bare else "\n".join([*lines, closing])
    return replace(problem, solution=solution, meta={**problem.meta, "guess": guess})


def generate_toy_splits(
    n_train: int, n_val: int, n_test: int, seed: int = 0, spec: ToyWorldSpec | None = None
) -> TaskSplits:
    """Deterministic train/val/test splits; no question appears in two splits."""
    spec = spec or ToyWorldSpec()
    if spec.min_steps < 1 or spec.max_steps < spec.min_steps:
        raise ValueError(f"toy task: need 1 <= min_steps <= max_steps, got {spec}")
    seen: set[str] = set()
    splits = {}
    for offset, (name, n) in enumerate((("train", n_train), ("val", n_val), ("test", n_test))):
        rng = random.Random(f"omgrpo-toy-{seed}-{offset}")
        out: list[Problem] = []
        budget = [50 * n + 1000]  # draws left, shared by the whole split
        while len(out) < n:
            p = draw_distinct(rng, spec, f"{name}-{len(out)}", seen, budget)
            if p is None:
                raise ValueError(
                    f"toy task: cannot draw {n} distinct {name} problems from {spec}; "
                    "widen the ranges or ask for fewer problems"
                )
            out.append(p)
        splits[name] = out
    return TaskSplits(**splits)


def generate_sft_problems(
    n: int, seed: int, spec: ToyWorldSpec, exclude: set[str] | None = None
) -> list[Problem]:
    """Worked problems for the SFT warm start, disjoint from the RL splits (`exclude`), so the
    base model has never seen the questions it is later trained and evaluated on. In a shortcut
    world (`guess_rate_*` > 0) a share of the solutions box a guess (`with_guess`); the guesses
    come from their own random stream, so the questions do not depend on the guess rates."""
    rng = random.Random(f"omgrpo-toy-sft-{seed}")
    guess_rng = random.Random(f"omgrpo-toy-sft-guess-{seed}")
    exclude = exclude or set()
    out: list[Problem] = []
    attempts = 0
    difficulty = None  # drawn once per slot and kept while excluded questions are redrawn
    while len(out) < n and attempts < 50 * n + 1000:
        attempts += 1
        difficulty = difficulty or draw_difficulty(rng, spec)
        p = make_problem(rng, spec, f"sft-{len(out)}", difficulty)
        if p.question in exclude:
            continue
        difficulty = None
        if guess_rng.random() < spec.guess_rate(p.meta["difficulty"]):
            guess = draw_guess(guess_rng, spec, p.meta["difficulty"])
            p = with_guess(p, guess, spec.bare_guess)
        out.append(p)
    return out


_LINE = re.compile(r"^(\d+)([+\-*])(\d+)=(\d+)$")
# The right-hand side of a computed line anywhere in a response (`12*3=36`).
_RESULT = re.compile(r"(?m)^\s*\d+\s*[+\-*]\s*\d+\s*=\s*(\d+)\s*$")


def last_result_span(text: str) -> tuple[int, int] | None:
    """Character span of the value the reasoning computed last: the right-hand side of the last
    ``a op b = c`` line before the final ``\\boxed``, or None if the response computes nothing
    there (a bare guess, or garbage)."""
    box = text.rfind("\\boxed")
    head = text if box < 0 else text[:box]
    last = None
    for m in _RESULT.finditer(head):
        last = m
    return None if last is None else last.span(1)


def last_result(text: str) -> str | None:
    """The value the reasoning computed last (see `last_result_span`), as text."""
    span = last_result_span(text)
    return None if span is None else text[span[0] : span[1]]


def is_guess(text: str, answer: str | None) -> bool:
    """Whether a response boxes an answer that its reasoning did not compute last: a different
    value, or a box with no computed line before it (a bare guess). No answer: not a guess."""
    if answer is None:
        return False
    computed = last_result(text)
    return computed is None or normalize(answer) != computed


@dataclass(frozen=True)
class ToyProbe:
    """The toy world's `omgrpo.core.task.TaskProbe`: the computed lines `a op b = c` give the
    `result` role, the guess diagnostics and the process grade (`omgrpo.tasks.toy_process`);
    `peak` is the guess prior's peak."""

    peak: str | None = None

    def result_span(self, text: str) -> tuple[int, int] | None:
        return last_result_span(text)

    def is_guess(self, text: str, answer: str | None) -> bool:
        return is_guess(text, answer)

    def grade(self, question: str, text: str, answer: str | None) -> ProcessGrade | None:
        chain = parse_question(question)
        return None if chain is None else grade_process(chain, text, answer)


def corrupt_solution(problem: Problem, rng: random.Random, spec: ToyWorldSpec) -> str | None:
    """A plausible wrong worked solution: one line's result is off by a small amount and the
    later lines carry the error forward correctly, as a model's own slip would. Returns None if
    no slip keeps every value within the problem's regime's [0, max_value] (the caller skips the
    problem).

    Used for the CAR part of the warm start: comparisons of a correct and a wrong solution teach
    the base model the CAR answer format (a base LLM knows it from pre-training)."""
    *lines, last = problem.solution.split("\n")
    parsed = [_LINE.match(line) for line in lines]
    if not lines or not all(parsed) or "\\boxed{" not in last:
        return None
    steps = [(m.group(2), int(m.group(3))) for m in parsed]
    start = int(parsed[0].group(1))
    max_value = spec.hard_max_value if problem.meta.get("difficulty") == "hard" else spec.max_value
    for _ in range(10):
        k = rng.randrange(len(steps))
        delta = rng.choice([-10, -2, -1, 1, 2, 10])
        value, out, ok = start, [], True
        for idx, (op, n) in enumerate(steps):
            new = value + n if op == "+" else value - n if op == "-" else value * n
            if idx == k:
                new += delta
            if not 0 <= new <= max_value:
                ok = False
                break
            out.append(f"{value}{op}{n}={new}")
            value = new
        if ok:
            return "\n".join(out) + f"\nSo the answer is \\boxed{{{value}}}."
    return None
