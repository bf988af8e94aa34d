"""Process quality graded exactly in the toy world (omgrpo.tasks.toy_process) and its batch
metrics (omgrpo.core.diagnostics.process_diagnostics): hand-graded small responses."""

import math
import random

import pytest

from omgrpo.core.diagnostics import guess_diagnostics, process_diagnostics
from omgrpo.core.step import extract_answer
from omgrpo.core.task import GUESS_KINDS
from omgrpo.tasks.toy import ToyProbe, ToyWorldSpec, is_guess, make_problem
from omgrpo.tasks.toy_process import grade_process, guess_kind, parse_question

Q = "Evaluate left to right: 7+5*3-4"  # 7+5=12, 12*3=36, 36-4=32
CHAIN = (7, [("+", 5), ("*", 3), ("-", 4)])
GOLD = "7+5=12\n12*3=36\n36-4=32\nSo the answer is \\boxed{32}."


def _grade(text, answer="from text"):
    answer = extract_answer(text) if answer == "from text" else answer
    return grade_process(CHAIN, text, answer)


def test_parse_question_reads_the_chain_and_nothing_else():
    assert parse_question(Q) == CHAIN
    assert parse_question("Start with 7, add 5. What is the result?") is None
    assert parse_question("What is 1+1?") is None


def test_the_gold_solution_is_correct_informative_and_supported():
    g = _grade(GOLD)
    assert (g.lines, g.valid, g.informative, g.malformed) == (3, 3, 3, 0)
    assert g.supported and g.chain_correct and g.guess_kind is None


def test_a_slip_is_invalid_but_later_lines_on_it_still_progress():
    # 12*3=35 is wrong; 35-4=31 is right arithmetic on the slipped value, and moves on
    g = _grade("7+5=12\n12*3=35\n35-4=31\nSo the answer is \\boxed{31}.")
    assert (g.lines, g.valid, g.informative) == (3, 2, 3)
    assert not g.supported  # the answer follows from lines, one of which is wrong
    assert not g.chain_correct and g.guess_kind is None  # it copied what it computed


def test_skipped_and_foreign_operations_are_not_informative():
    # skips "*3": 12-4=8 applies the third operation to the wrong value
    g = _grade("7+5=12\n12-4=8\nSo the answer is \\boxed{8}.")
    assert (g.lines, g.valid, g.informative) == (2, 2, 1)
    assert g.supported  # chained and valid: the answer follows from what was written
    assert not g.chain_correct


def test_guess_kinds_by_hand():
    lines = "7+5=12\n12*3=36\n36-4=152\n"  # last computed value 152 (a slip)
    assert _grade(lines + "So the answer is \\boxed{1}.").guess_kind == "truncated"
    assert _grade(lines + "So the answer is \\boxed{15}.").guess_kind == "truncated"
    assert _grade(lines + "So the answer is \\boxed{153}.").guess_kind == "copy_error"
    assert _grade(lines + "So the answer is \\boxed{125}.").guess_kind == "copy_error"  # swap
    assert _grade(lines + "So the answer is \\boxed{1520}.").guess_kind == "copy_error"
    assert _grade(lines + "So the answer is \\boxed{7}.").guess_kind == "prior"
    assert _grade("So the answer is \\boxed{1}.").guess_kind == "prior"  # a bare guess
    assert _grade("7+5=12\n12*3=\nSo the answer is \\boxed{9}.").guess_kind == "malformed"
    assert _grade("7+5\nSo the answer is \\boxed{1}.").guess_kind == "malformed"
    assert _grade(lines + "no box", answer=None).guess_kind is None


def test_guess_kind_order():
    assert guess_kind("1", "152", malformed=2) == "truncated"  # the copy explains it first
    assert guess_kind("7", "152", malformed=1) == "malformed"
    assert guess_kind("7", None, malformed=0) == "prior"
    assert guess_kind("152", "152", malformed=3) is None


def test_the_closing_sentence_is_no_line_but_a_computed_box_line_is():
    g = _grade("7+5=12\n12*3=36\n36-4=32 \\boxed{32}")
    assert (g.lines, g.malformed, g.guess_kind) == (3, 0, None)


def test_probe_grade_reads_the_question():
    probe = ToyProbe(peak="1")
    assert probe.grade(Q, GOLD, "32") == grade_process(CHAIN, GOLD, "32")
    assert probe.grade("Start with 7, add 5. What is the result?", GOLD, "32") is None


def test_process_diagnostics_by_hand():
    texts = [
        GOLD,  # easy: correct, supported
        "7+5=12\n12*3=36\n36-4=32\nSo the answer is \\boxed{3}.",  # easy: truncated copy
        "7+5=12\n12*3=35\n35-4=31\nSo the answer is \\boxed{31}.",  # hard: slip, copied
        "So the answer is \\boxed{1}.",  # hard: bare prior guess
        "7+5=12\n12*3=36",  # hard: no answer
    ]
    answers = ["32", "3", "31", "1", None]
    correct = [True, False, False, False, False]
    diff = ["easy", "easy", "hard", "hard", "hard"]
    probe = ToyProbe(peak="1")
    d = process_diagnostics(texts, answers, [Q] * 5, correct, diff, probe, prefix="val")
    assert d["val/line_acc_easy"] == 1.0 and d["val/line_acc_hard"] == pytest.approx(
        (2 / 3 + 2 / 2) / 2  # the slip's 2 of 3 and the unanswered rollout's 2 of 2
    )
    assert d["val/informativeness_hard"] == 1.0  # the bare guess has no line
    assert d["val/support_easy"] == 0.5 and d["val/support_hard"] == 0.0
    # the truncated copy reasoned right: reasoning accuracy is not the boxed accuracy
    assert d["val/chain_acc_easy"] == 1.0 and d["val/chain_acc_hard"] == 0.0
    assert d["val/consistent_acc_easy"] == 1.0 and d["val/consistent_acc_hard"] == 0.0
    assert d["val/guess_truncated_easy"] == 0.5 and d["val/guess_prior_hard"] == 0.5
    assert d["val/guess_copy_error_hard"] == 0.0 and d["val/guess_malformed_easy"] == 0.0
    # no problem the task can read: nothing graded, nothing logged
    assert process_diagnostics(["x"], ["1"], ["What is 1+1?"], [True], ["easy"], probe) == {}


def test_guess_kinds_add_up_to_the_guess_rate_on_sampled_text():
    """The kinds split exactly what `is_guess` counts, on random mutations of real solutions."""
    rng, spec = random.Random(0), ToyWorldSpec(hard_share=0.5)
    texts, answers, questions, diff = [], [], [], []
    for i in range(300):
        p = make_problem(rng, spec, f"p{i}", rng.choice(["easy", "hard"]))
        text = p.solution
        for _ in range(rng.randint(0, 3)):  # delete, duplicate or swap characters
            j = rng.randrange(len(text))
            text = rng.choice([text[:j] + text[j + 1 :], text[:j] + text[j] + text[j:]])
        texts.append(text)
        answers.append(extract_answer(text))
        questions.append(p.question)
        diff.append(p.meta["difficulty"])
    probe = ToyProbe(peak="1")
    rates = guess_diagnostics(texts, answers, diff, probe)
    kinds = process_diagnostics(texts, answers, questions, [None] * 300, diff, probe)
    for d in ("easy", "hard"):
        total = sum(kinds[f"answers/guess_{k}_{d}"] for k in GUESS_KINDS)
        assert total == pytest.approx(rates[f"answers/guess_rate_{d}"])
        assert 0 < rates[f"answers/guess_rate_{d}"] < 1  # the mutations made some guesses
    for t, a, q in zip(texts, answers, questions):
        g = probe.grade(q, t, a)
        assert (g.guess_kind is not None) == (a is not None and is_guess(t, a))
    assert math.isnan(kinds["answers/consistent_acc_easy"])  # no labels given
