"""The toy PRM's training labels (hand-checked) and its command's printed checks."""

import random

import pytest

from omgrpo import cli
from omgrpo.models.toy_prm import step_labels, toy_steps, training_examples
from omgrpo.tasks.toy import ToyWorldSpec, generate_sft_problems, make_problem, with_guess


def test_labels_mark_only_wrong_arithmetic():
    assert step_labels("3+4=7\n7*2=15\n15-1=14\nSo the answer is \\boxed{14}.") == [1, 0, 1, 1]
    assert step_labels("2*3=6\n6-6=0\nSo the answer is \\boxed{99}.") == [1, 1, 1]  # a guess
    assert step_labels("So the answer is \\boxed{1}.") == [1]
    assert toy_steps("a=1\n\n  b \n") == ["a=1", "b"]


def test_each_slipped_copy_has_one_bad_line():
    """Every SFT solution comes once as is (all good) and, where a slip fits the ranges, once
    slipped: exactly one line with wrong arithmetic, labelled 0; guessed solutions stay all good."""
    spec = ToyWorldSpec(guess_rate_easy=0.5)
    problems = generate_sft_problems(40, seed=0, spec=spec)
    examples = training_examples(problems, spec, seed=0)
    assert len(problems) < len(examples) <= 2 * len(problems)
    by_question = {}
    for question, steps, labels in examples:
        assert len(steps) == len(labels)
        by_question.setdefault(question, []).append(labels)
    for p in problems:
        original, *slipped = by_question[p.question]
        assert original == [1] * len(original)
        for labels in slipped:
            assert labels.count(0) == 1 and labels[-1] == 1
    guessed = with_guess(make_problem(random.Random(1), spec, "x"), 1, bare=False)
    assert set(step_labels(guessed.solution)) == {1}


@pytest.mark.slow
def test_prm_train_prints_its_checks(tiny_overrides, capsys):
    overrides = [*tiny_overrides, "reward.prm.toy.steps=3", "reward.prm.toy.check_problems=8"]
    assert cli.main(["prm", "train", *overrides]) == 0
    out = capsys.readouterr().out
    assert "toy PRM checks:" in out and "held-out steps: right lines scored good" in out
    for kind in ("faithful", "slipped", "guessed", "bare_guess"):
        assert kind in out
    assert cli.main(["prm", "train", *overrides, "model.path=/x"]) == 2


def test_a_run_that_must_train_a_toy_prm_says_so_and_how_long(tmp_path):
    """Before training a toy PRM (minutes), a run says why (none ships for this recipe: the
    shortcut world's ships; or shipped=false), how long, from the shipped PRM's logged training
    time (1255 s for its 4000 steps), and where it is cached."""
    from types import SimpleNamespace

    from omgrpo.models.toy_prm import training_notice

    notice = training_notice(SimpleNamespace(steps=4000, shipped=True), tmp_path / "prm")
    assert "`omgrpo prm train experiment=toy_shortcut`'s" in notice
    assert "about 21 min (4000 steps" in notice and str(tmp_path / "prm") in notice  # 1255 s
    off = training_notice(SimpleNamespace(steps=400, shipped=False), tmp_path / "prm")
    assert off.startswith("toy PRM: reward.prm.toy.shipped=false: ") and "about 2 min" in off
    bare = training_notice(SimpleNamespace(steps=10, shipped=True), tmp_path, tmp_path / "none")
    assert "ships none" in bare and "min" not in bare
