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
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from omgrpo.tasks.base import Problem, TaskSplits

_OP_WORDS = {"+": "add", "-": "subtract", "*": "multiply by"}


@dataclass(frozen=True)
class ToyWorldSpec:
    """Parameters of the generator (mirrors `TaskConfig`'s toy fields)."""

    min_steps: int = 2
    max_steps: int = 3
    max_start: int = 20
    max_operand: int = 20
    max_factor: int = 5
    max_value: int = 99

    @classmethod
    def from_config(cls, task_cfg) -> ToyWorldSpec:
        """The generator fields of a `TaskConfig`."""
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


def make_problem(rng: random.Random, spec: ToyWorldSpec, pid: str) -> Problem:
    start, ops = _sample_chain(rng, spec)
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
        meta={"steps": len(ops)},
    )


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
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 50 * n + 1000:
                raise ValueError(
                    f"toy task: cannot draw {n} distinct {name} problems from {spec}; "
                    "widen the ranges or ask for fewer problems"
                )
            p = make_problem(rng, spec, f"{name}-{len(out)}")
            if p.question in seen:
                continue
            seen.add(p.question)
            out.append(p)
        splits[name] = out
    return TaskSplits(**splits)


def generate_sft_problems(
    n: int, seed: int, spec: ToyWorldSpec, exclude: set[str] | None = None
) -> list[Problem]:
    """Worked problems for the SFT warm start, disjoint from the RL splits (`exclude`), so the
    base model has never seen the questions it is later trained and evaluated on."""
    rng = random.Random(f"omgrpo-toy-sft-{seed}")
    exclude = exclude or set()
    out: list[Problem] = []
    attempts = 0
    while len(out) < n and attempts < 50 * n + 1000:
        attempts += 1
        p = make_problem(rng, spec, f"sft-{len(out)}")
        if p.question not in exclude:
            out.append(p)
    return out


_LINE = re.compile(r"^(\d+)([+\-*])(\d+)=(\d+)$")


def corrupt_solution(problem: Problem, rng: random.Random, spec: ToyWorldSpec) -> str | None:
    """A plausible wrong worked solution: one line's result is off by a small amount and the
    later lines carry the error forward correctly, as a model's own slip would. Returns None if
    no slip keeps every value within [0, max_value] (the caller skips the problem).

    Used for the CAR part of the warm start: comparisons of a correct and a wrong solution teach
    the base model the CAR answer format (a base LLM knows it from pre-training)."""
    *lines, last = problem.solution.split("\n")
    parsed = [_LINE.match(line) for line in lines]
    if not lines or not all(parsed) or "\\boxed{" not in last:
        return None
    steps = [(m.group(2), int(m.group(3))) for m in parsed]
    start = int(parsed[0].group(1))
    for _ in range(10):
        k = rng.randrange(len(steps))
        delta = rng.choice([-10, -2, -1, 1, 2, 10])
        value, out, ok = start, [], True
        for idx, (op, n) in enumerate(steps):
            new = value + n if op == "+" else value - n if op == "-" else value * n
            if idx == k:
                new += delta
            if not 0 <= new <= spec.max_value:
                ok = False
                break
            out.append(f"{value}{op}{n}={new}")
            value = new
        if ok:
            return "\n".join(out) + f"\nSo the answer is \\boxed{{{value}}}."
    return None
