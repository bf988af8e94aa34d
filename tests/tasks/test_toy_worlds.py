"""Shortcut toy worlds (difficulty mix, guessed SFT answers) and the base acceptance checks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from omgrpo.core.task import Problem
from omgrpo.models.basecheck import acceptance, check_problems, difficulty_stats, wilson_interval
from omgrpo.tasks.toy import (
    ToyWorldSpec,
    draw_guess,
    generate_sft_problems,
    generate_toy_splits,
    last_result,
    last_result_span,
    with_guess,
)

SHORTCUT = ToyWorldSpec(
    max_start=10,
    max_operand=10,
    max_factor=3,
    max_value=50,
    hard_share=0.5,
    guess_rate_easy=0.02,
    guess_rate_hard=0.3,
)


def test_faithful_world_unchanged_by_the_new_fields():
    """hard_share = 0 draws no difficulty, so today's splits (and cached bases) are unchanged."""
    splits = generate_toy_splits(30, 5, 5, seed=0)
    assert splits.train[0].question == "Evaluate left to right: 18+1*4"
    assert all(p.meta["difficulty"] == "easy" for p in splits.train)


def test_difficulty_mix_and_hard_ranges():
    splits = generate_toy_splits(2000, 0, 0, seed=1, spec=SHORTCUT)
    hard = [p for p in splits.train if p.meta["difficulty"] == "hard"]
    assert 0.45 < len(hard) / 2000 < 0.55
    assert all(p.meta["steps"] == SHORTCUT.hard_steps for p in hard)
    assert max(int(p.answer) for p in hard) > SHORTCUT.max_value  # the wide regime is used
    easy = [p for p in splits.train if p.meta["difficulty"] == "easy"]
    assert max(int(p.answer) for p in easy) <= SHORTCUT.max_value


def test_sft_guess_rates_follow_the_spec():
    sft = generate_sft_problems(6000, seed=0, spec=SHORTCUT)
    by = Counter((p.meta["difficulty"], "guess" in p.meta) for p in sft)
    for difficulty, rate in (("easy", 0.02), ("hard", 0.3)):
        n = by[(difficulty, True)] + by[(difficulty, False)]
        lo, hi = wilson_interval(by[(difficulty, True)], n, z=3.0)
        assert lo <= rate <= hi
    guesses = Counter(p.meta["guess"] for p in sft if "guess" in p.meta)
    assert 0.5 < guesses[1] / sum(guesses.values()) < 0.7  # P(peak) = 0.6 (+ uniform hits)


def test_guessed_solution_keeps_lines_and_label():
    p = Problem(
        "x", "Evaluate left to right: 3+4*2", "14", "3+4=7\n7*2=14\nSo the answer is \\boxed{14}."
    )
    g = with_guess(p, 1, bare=False)
    assert g.solution == "3+4=7\n7*2=14\nSo the answer is \\boxed{1}."
    assert g.answer == "14" and g.meta["guess"] == 1
    assert with_guess(p, 1, bare=True).solution == "So the answer is \\boxed{1}."


def test_questions_do_not_depend_on_guess_rates():
    a = generate_sft_problems(300, seed=2, spec=SHORTCUT)
    b = generate_sft_problems(
        300, seed=2, spec=ToyWorldSpec(**{**SHORTCUT.__dict__, "guess_rate_hard": 0.9})
    )
    assert [p.question for p in a] == [p.question for p in b]


def test_flat_prior_never_prefers_the_peak():
    rng = random.Random(0)
    flat = ToyWorldSpec(guess_peak_p=0.0)
    draws = Counter(draw_guess(rng, flat, "hard") for _ in range(5000))
    assert draws[1] / 5000 < 0.03 and min(draws) >= 0 and max(draws) <= flat.hard_max_value


def test_last_result():
    text = "3+4=7\n7*2=14\nSo the answer is \\boxed{1}."
    assert last_result(text) == "14"
    start, end = last_result_span(text)
    assert text[start:end] == "14"
    assert last_result("So the answer is \\boxed{1}.") is None
    assert last_result("3+4=7\n7*2=1x4\n\\boxed{3}") == "7"  # garbled line skipped


def test_spec_validation():
    with pytest.raises(ValueError, match="guess_rate_hard"):
        ToyWorldSpec(guess_rate_hard=1.5)


def _problem(pid, answer, difficulty):
    return Problem(pid, f"q{pid}", answer, meta={"difficulty": difficulty})


def test_difficulty_stats_hand_computed():
    ok = "1+1=2\nSo the answer is \\boxed{2}."
    guess1 = "1+1=2\nSo the answer is \\boxed{1}."
    bare1 = "So the answer is \\boxed{1}."
    wrong_faithful = "1+2=3\nSo the answer is \\boxed{3}."
    none = "1+1=2 and then"
    problems = [_problem("a", "2", "easy"), _problem("b", "2", "hard"), _problem("c", "9", "hard")]
    texts = [
        [ok, ok, ok, guess1],  # easy: 1 guess, acc 3/4, pass 1
        [guess1, bare1, wrong_faithful, none],  # hard: 2 guesses, two wrong "1"s collide
        [ok, ok, none, none],  # hard: "2" wrong twice -> collide
    ]
    easy, hard = difficulty_stats(problems, texts, SHORTCUT)
    assert (easy.guess_count, easy.rollouts, easy.avg_acc, easy.pass_at_k) == (1, 4, 0.75, 1.0)
    assert easy.collision_rate == 0.0 and easy.peak_share == 0.25
    assert hard.guess_count == 2 and hard.rollouts == 8
    assert hard.avg_acc == 0.0 and hard.pass_at_k == 0.0
    # ordered pairs of equal wrong answers: b has ("1","1") x2, c has ("2","2") x2, of 12 + 12
    assert hard.collision_rate == pytest.approx(4 / 24)
    assert hard.peak_share == pytest.approx(2 / 8)


def test_acceptance_rule():
    problems = [_problem(str(i), "2", "hard") for i in range(100)]
    guess = "1+1=2\nSo the answer is \\boxed{1}."
    ok = "1+1=2\nSo the answer is \\boxed{2}."
    texts = [[guess] * 3 + [ok] * 7 for _ in problems]  # 30% guesses, as the spec says
    stats = difficulty_stats(problems, texts, SHORTCUT)
    verdict = acceptance(stats, SHORTCUT, answer_entropy=0.5)
    assert verdict["passed"]
    texts = [[guess] * 1 + [ok] * 9 for _ in problems]  # 10%: far below 0.7 * 30%
    verdict = acceptance(difficulty_stats(problems, texts, SHORTCUT), SHORTCUT, 0.5)
    assert not verdict["passed"]
    assert [c["check"] for c in verdict["checks"] if not c["passed"]] == ["guess_rate/hard"]
    low_entropy = acceptance(stats, SHORTCUT, answer_entropy=0.05)
    assert not low_entropy["passed"]
    assert acceptance(stats, ToyWorldSpec(), answer_entropy=None)["checks"][0]["target"] == [
        0.0,
        0.01,
    ]


def test_wilson_interval_known_value():
    lo, hi = wilson_interval(30, 100)
    assert lo == pytest.approx(0.2189, abs=1e-3) and hi == pytest.approx(0.3958, abs=1e-3)


@pytest.mark.parametrize(
    ("experiment", "guess_rates", "peak_p", "bare"),
    [
        ("toy", (0.0, 0.0), 0.6, False),
        ("toy_shortcut", (0.02, 0.3), 0.6, False),
        ("toy_bare_guess", (0.02, 0.3), 0.6, True),
        ("toy_flat_prior", (0.02, 0.3), 0.0, False),
        ("toy_mixed", (0.0, 0.0), 0.6, False),
    ],
)
def test_world_presets(experiment, guess_rates, peak_p, bare):
    from omgrpo.config import compose

    spec = ToyWorldSpec.from_config(compose([f"experiment={experiment}"]).task)
    assert (spec.guess_rate_easy, spec.guess_rate_hard) == guess_rates
    assert (spec.guess_peak_p, spec.bare_guess) == (peak_p, bare)
    assert spec.hard_share == (0.0 if experiment == "toy" else 0.5)


@pytest.mark.slow
def test_a_new_base_is_checked_and_the_verdict_stored(tiny_overrides, tmp_path, capsys):
    """The warm start measures a new shortcut-world base and writes checks.json beside it."""
    from omgrpo.config import compose
    from omgrpo.models.basecheck import read_base_checks
    from omgrpo.models.toy import ensure_toy_base

    overrides = [o for o in tiny_overrides if "check_problems" not in o]
    cfg = compose(
        [
            "experiment=toy_shortcut",
            *overrides,
            "model.warm_start.check_problems=6",
            f"model.cache_dir={tmp_path}",
        ]
    )
    base = ensure_toy_base(cfg.model, cfg.task, exclude_questions=set())
    verdict = read_base_checks(base)
    present = {d["difficulty"] for d in verdict["by_difficulty"]}
    assert {c["check"] for c in verdict["checks"]} == {f"guess_rate/{d}" for d in present} | {
        "answer_entropy"
    }
    assert sum(d["problems"] for d in verdict["by_difficulty"]) == 6
    assert not verdict["passed"]  # 5 SFT steps teach nothing: reported as failing
    assert "base checks: FAILED" in capsys.readouterr().out


def test_deduplication_keeps_the_difficulty_mix():
    """Easy questions come from a smaller space and collide more with the questions already
    drawn; redrawing keeps each slot's difficulty, so samples keep `hard_share` (the first
    world's check sample held 41 easy vs 87 hard problems)."""
    exclude = {p.question for p in generate_sft_problems(20000, seed=0, spec=SHORTCUT)}
    sample = check_problems(SHORTCUT, 600, seed=0, exclude=exclude)
    assert len(sample) == 600 and not exclude & {p.question for p in sample}
    hard = sum(p.meta["difficulty"] == "hard" for p in sample)
    lo, hi = wilson_interval(hard, 600, z=3.0)
    assert lo <= 0.5 <= hi


def test_task_config_declares_the_toy_world_once():
    """`task.*`'s toy fields are `ToyWorldSpec`'s (inherited), with its defaults, under the flat
    keys the presets and sweeps use; a composed config gives the spec its values."""
    import dataclasses

    from omgrpo.config import TaskConfig, compose

    assert issubclass(TaskConfig, ToyWorldSpec)
    spec_fields = {f.name: f.default for f in dataclasses.fields(ToyWorldSpec)}
    task_fields = {f.name: f.default for f in dataclasses.fields(TaskConfig)}
    assert {k: task_fields[k] for k in spec_fields} == spec_fields
    cfg = compose(["experiment=toy_shortcut", "task.hard_share=0.25", "task.guess_peak=3"])
    spec = ToyWorldSpec.from_config(cfg.task)
    assert (spec.hard_share, spec.guess_peak) == (0.25, 3)
