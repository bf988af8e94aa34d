"""Toy world generator and file datasets."""

import json
import random
import re

import pytest

from omgrpo.config import compose
from omgrpo.tasks import load_task
from omgrpo.tasks.files import load_problems
from omgrpo.tasks.toy import (
    ToyWorldSpec,
    corrupt_solution,
    generate_sft_problems,
    generate_toy_splits,
)


def _evaluate(question: str) -> int:
    """Plain left-to-right evaluation of 'Evaluate left to right: 7+5*3-4'."""
    expr = question.split(": ", 1)[1]
    value, i = None, 0
    num = ""
    op = None
    for ch in expr + "$":
        if ch.isdigit():
            num += ch
            continue
        n = int(num)
        num = ""
        if value is None:
            value = n
        elif op == "+":
            value += n
        elif op == "-":
            value -= n
        else:
            value *= n
        op = ch
        i += 1
    return value


def test_toy_splits_are_deterministic_disjoint_and_correct():
    a = generate_toy_splits(200, 50, 50, seed=3)
    b = generate_toy_splits(200, 50, 50, seed=3)
    assert a == b
    train, val, test = ({p.question for p in s} for s in (a.train, a.val, a.test))
    assert not (train & val) and not (train & test) and not (val & test)
    for p in a.train + a.val:
        assert int(p.answer) == _evaluate(p.question)
        assert 0 <= int(p.answer) <= 99
        assert p.solution.endswith(f"\\boxed{{{p.answer}}}.")
        assert p.paraphrase.startswith("Start with ")
        assert 2 <= p.meta["steps"] <= 3
    assert generate_toy_splits(20, 5, 5, seed=4) != generate_toy_splits(20, 5, 5, seed=3)


def test_toy_solution_shows_each_step():
    spec = ToyWorldSpec(min_steps=3, max_steps=3)
    p = generate_toy_splits(1, 0, 0, seed=0, spec=spec).train[0]
    lines = p.solution.splitlines()
    assert len(lines) == 4
    assert lines[-2].split("=")[1] == p.answer


def test_sft_problems_avoid_the_rl_splits():
    splits = generate_toy_splits(100, 20, 20, seed=0)
    seen = {p.question for p in splits.train + splits.val + splits.test}
    sft = generate_sft_problems(500, seed=0, spec=ToyWorldSpec(), exclude=seen)
    assert len(sft) == 500 and not ({p.question for p in sft} & seen)


def _check_lines(solution: str) -> tuple[int, int]:
    """(lines whose arithmetic is wrong, final boxed value) of a toy solution."""
    *lines, last = solution.split("\n")
    bad, value = 0, None
    for line in lines:
        m = re.match(r"^(\d+)([+\-*])(\d+)=(\d+)$", line)
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert value is None or a == value  # each line continues from the previous result
        bad += c != (a + b if op == "+" else a - b if op == "-" else a * b)
        assert 0 <= c <= 99
        value = c
    assert last == f"So the answer is \\boxed{{{value}}}."
    return bad, value


def test_corrupt_solution_slips_once_and_carries_the_error():
    spec = ToyWorldSpec()
    rng = random.Random(0)
    n_done = 0
    for p in generate_sft_problems(200, 0, spec):
        wrong = corrupt_solution(p, rng, spec)
        if wrong is None:
            continue
        n_done += 1
        bad, value = _check_lines(wrong)
        assert bad == 1 and str(value) != p.answer
    assert n_done > 180  # a slip in range exists for nearly every problem


def test_car_sft_examples_answer_the_correct_solution():
    from omgrpo.core.car import car_prompt
    from omgrpo.models.tokenizer import build_char_tokenizer
    from omgrpo.models.toy import car_examples

    tok = build_char_tokenizer()
    spec = ToyWorldSpec()
    problems = generate_sft_problems(80, 0, spec)
    examples = car_examples(tok, problems, spec, seed=0)
    assert len(examples) > 70
    by_question = {p.question: p for p in problems}
    same = 0
    for prompt_ids, target_ids in examples:
        text = tok.decode(prompt_ids)
        question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        p = by_question[question]
        assert tok.decode(target_ids) == p.answer + "}"
        first = text.split("[Solution 1]\n")[1].split("\n\n[Solution 2]")[0]
        second = text.split("[Solution 2]\n")[1].split("\n\nBased on")[0]
        assert text == car_prompt(tok, question, first, second)
        assert p.solution in (first, second)
        same += first == second
    assert 0.1 < same / len(examples) < 0.4  # a quarter compare a solution with itself


@pytest.mark.slow
def test_impossible_toy_request_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot draw"):
        generate_toy_splits(
            10_000,
            0,
            0,
            spec=ToyWorldSpec(max_start=2, max_steps=1, min_steps=1, max_operand=1, max_factor=2),
        )


def test_file_dataset_rows_are_validated(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": 2}) + "\n")
    (p,) = load_problems(good)
    assert p.question == "1+1?" and p.answer == "2"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": "q", "answer": "1"}) + "\n" + json.dumps({"q": 1}) + "\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: missing 'question'"):
        load_problems(bad)

    noanswer = tmp_path / "noanswer.jsonl"
    noanswer.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"noanswer\.jsonl, line 1: missing 'answer'"):
        load_problems(noanswer)
    assert load_problems(noanswer, require_answer=False)[0].answer is None

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": 1}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2: invalid JSON"):
        load_problems(broken)


def test_parquet_dataset_and_custom_keys(tmp_path):
    import pandas as pd

    path = tmp_path / "math.parquet"
    pd.DataFrame({"problem": ["a", "b"], "solution": ["1", "2"]}).to_parquet(path)
    probs = load_problems(path, question_key="problem", answer_key="solution")
    assert [p.answer for p in probs] == ["1", "2"]


def test_load_task_files_and_unknown_task(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": i}) + "\n" for i in range(3))
    )
    cfg = compose(["task.name=files", f"task.train_path={path}", f"task.val_path={path}"])
    splits = load_task(cfg.task)
    assert len(splits.train) == 3 and len(splits.val) == 3
    with pytest.raises(ValueError, match="unknown task 'nope'; valid tasks: files, toy"):
        load_task(compose(["task.name=nope"]).task)
