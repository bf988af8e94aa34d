"""Contrast-Augmented Reward: pool and soft reward, pairs, prompt, parsing, prefix-shared
generation against the plain path, diagnostics, and the never-trained-on contract."""

import dataclasses
import functools
import math
import random

import pytest
import torch
from toy_models import random_toy_model

from omgrpo.core import car as car_module
from omgrpo.core import rewards as rewards_module
from omgrpo.core.answers import Grader
from omgrpo.core.car import (
    CarConfig,
    CarResult,
    PairAnswer,
    car_diagnostics,
    car_prompt,
    cut_solutions,
    enumerate_pairs,
    parse_pair_answer,
    read_pair_answer,
    top_vote_acc,
    top_vote_metrics,
)
from omgrpo.core.rewards import REWARDS, make_group
from omgrpo.generation.car import generate_pair_answers, generate_pair_answers_plain
from omgrpo.generation.engine import prefix_tree_forward
from omgrpo.models.tokenizer import build_char_tokenizer

SYSTEM = "Let's think step by step and output the final answer within \\boxed{}."
QUESTION = "Evaluate left to right: 7+5*3"
SOLUTIONS = [
    "7+5=12\n12*3=36\nSo the answer is \\boxed{36}.",
    "7+5=12\nSo \\boxed{12}.",
    "I am not sure.",  # no boxed answer: still takes part in pairs
    "5*3=15\n7+15=22\nSo the answer is \\boxed{22}.",
]


@pytest.fixture(autouse=True)
def _no_math_verify(monkeypatch):
    # Every equivalence here is decided by normalisation / numbers; skip the worker process
    # (the default graders of the functions under test, built without math-verify).
    no_mv = functools.partial(Grader, math_verify=False)
    monkeypatch.setattr(car_module, "Grader", no_mv)
    monkeypatch.setattr(rewards_module, "Grader", no_mv)


# -- pool and soft reward -----------------------------------------------------------------
def test_car_answers_enlarge_the_soft_vote_pool():
    rollouts = ["1/2", "\\frac{1}{2}", "3", None]
    pool = ["0.5", "3", None, "\\frac12", "7"]  # None: an unclosed pair answer, no vote
    group = make_group(rollouts, pool=pool)
    # classes: {1/2, \frac{1}{2}, 0.5, \frac12} = A, {3} = B, {7} = C; voters A A B | A B A C
    assert group.classes[0] == group.classes[1] != group.classes[2]
    assert REWARDS["soft_vote"](group) == pytest.approx([4 / 7, 4 / 7, 2 / 7, 0.0])
    # without CAR the same rollouts get 2/3, 2/3, 1/3, 0
    plain = REWARDS["soft_vote"](make_group(rollouts))
    assert plain == pytest.approx([2 / 3, 2 / 3, 1 / 3, 0.0])
    # a pool of only None answers changes nothing
    assert REWARDS["soft_vote"](make_group(rollouts, pool=[None, None])) == pytest.approx(plain)


@pytest.mark.slow
def test_pair_answers_are_validators_only_and_the_batch_stays_prompts_times_g():
    model, tok = random_toy_model(1, 0)
    groups = [(QUESTION, SOLUTIONS), ("What is 2+2?", SOLUTIONS[:3])]
    result = generate_pair_answers(model, tok, groups, CarConfig(max_new_tokens=3), rng=0)
    assert model.config._attn_implementation == "eager"  # SDPA only inside CAR, then restored

    def no_tensors(x):
        if isinstance(x, torch.Tensor):
            return False
        if isinstance(x, (list, tuple)):
            return all(no_tensors(v) for v in x)
        return x is None or isinstance(x, (str, int))

    assert all(no_tensors(getattr(result, f.name)) for f in dataclasses.fields(CarResult))
    assert all(a is None or isinstance(a, str) for g in result.answers for a in g)
    # the trainer builds one reward group per prompt with the pair answers as extra voters:
    # rewards (and the training batch) stay G per prompt, never G + pairs
    total = 0
    for (_, sols), pool in zip(groups, result.answers):
        rollout_answers = ["36", "12", None, "22"][: len(sols)]
        group = make_group(rollout_answers, pool=pool)
        rewards = REWARDS["soft_vote"](group)
        assert len(rewards) == len(sols) == group.size
        assert len(pool) == len(sols) * (len(sols) - 1)
        total += len(rewards)
    assert total == 4 + 3


# -- pairs, prompt, parsing ---------------------------------------------------------------
def test_enumerate_pairs_counts_and_seeding():
    pairs = enumerate_pairs(4)
    assert len(pairs) == 12 and len(set(pairs)) == 12
    assert all(i != j for i, j in pairs)
    assert [i for i, _ in pairs] == sorted(i for i, _ in pairs)  # grouped by anchor
    sub = enumerate_pairs(4, pairs_per_anchor=2, rng=random.Random(3))
    assert len(sub) == 8 and all(i != j for i, j in sub) and len(set(sub)) == 8
    assert all(sum(i == a for i, _ in sub) == 2 for a in range(4))
    assert sub == enumerate_pairs(4, 2, rng=random.Random(3)) == enumerate_pairs(4, 2, rng=3)
    draws = {tuple(enumerate_pairs(8, 2, rng=s)) for s in range(5)}
    assert len(draws) > 1  # the seed matters
    assert enumerate_pairs(4, pairs_per_anchor=3) == pairs  # K >= G-1: all partners
    assert enumerate_pairs(1) == [] and enumerate_pairs(4, 0) == []


def test_parse_pair_answer():
    assert parse_pair_answer("36}.") == "36"
    assert parse_pair_answer(" \\frac{1}{2} } and more}") == "\\frac{1}{2}"
    assert parse_pair_answer("\\{1,2\\}}") == "\\{1,2\\}"  # escaped braces do not count
    assert parse_pair_answer("{a}{b}}") == "{a}{b}"
    assert parse_pair_answer("\\frac{1}{2") is None  # never closes within the budget
    assert parse_pair_answer("12") is None
    assert parse_pair_answer("}") is None  # empty
    assert parse_pair_answer("  }") is None
    # `car/unclosed` counts only a brace that never closed; an empty answer is closed
    assert read_pair_answer("12") == PairAnswer(None, False)
    assert read_pair_answer(" } x") == PairAnswer(None, True)
    assert read_pair_answer("36}.") == PairAnswer("36", True)


def test_prompt_is_the_papers_template():
    tok = build_char_tokenizer()
    text = car_prompt(tok, "What is 2+2?", "2+2=4 \\boxed{4}", "I think 5.")
    assert text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "Here are two possible solutions:\n\n"
        "[Solution 1]\n2+2=4 \\boxed{4}\n\n"
        "[Solution 2]\nI think 5.\n\n"
        "Based on the reasoning in the solutions above, the correct final answer is \\boxed{"
    )
    # solutions are cut to their first max_solution_tokens tokens (one char = one token here)
    assert cut_solutions(tok, ["abcdef", "ab"], 3) == (["abc", "ab"], [True, False])
    assert cut_solutions(tok, ["abcdef"], 0) == (["abcdef"], [False])
    tok.chat_template = None  # base model without a template: the same content as plain text
    assert car_prompt(tok, "Q", "a", "b") == (
        f"{SYSTEM}\n\nQ\nHere are two possible solutions:\n\n[Solution 1]\na\n\n"
        "[Solution 2]\nb\n\nBased on the reasoning in the solutions above, the correct final "
        "answer is \\boxed{"
    )


# -- generation ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.slow
def test_prefix_sharing_matches_the_plain_path_under_greedy_decoding(num_layers):
    groups = [(QUESTION, SOLUTIONS), ("What is 2+2?", SOLUTIONS[1:])]
    # chunk_pairs=5: chunks hold whole anchors from different groups and of different sizes
    cfg = CarConfig(temperature=0.0, max_new_tokens=6, chunk_pairs=5, max_solution_tokens=30)
    # The pair prompts end alike, and for most random weights (10 of 16 seeds) all 18 greedy
    # answers are the same text: the model is the first from seed `num_layers` whose answers
    # differ (which seeds do depends on the transformers version's initialisation).
    for seed in range(num_layers, num_layers + 50):
        model, tok = random_toy_model(num_layers, seed=seed)
        shared = generate_pair_answers(model, tok, groups, cfg, rng=1)
        if len({t for g in shared.texts for t in g}) > 1:
            break
    plain = generate_pair_answers_plain(model, tok, groups, cfg, rng=1)
    assert shared.pairs == plain.pairs == [enumerate_pairs(4), enumerate_pairs(3)]
    assert shared.texts == plain.texts
    assert shared.answers == plain.answers
    assert len({t for g in shared.texts for t in g}) > 1  # rows really differ
    assert shared.num_pairs == 18
    assert shared.truncated == plain.truncated == 3  # > 30 chars: solutions 0, 3 and 3 again
    assert shared.unclosed == plain.unclosed


@pytest.mark.slow
def test_prefix_tree_forward_equals_the_plain_forward():
    model, tok = random_toy_model(2, seed=0)
    rows = [
        tok(car_prompt(tok, q, SOLUTIONS[i], SOLUTIONS[j]), add_special_tokens=False)["input_ids"]
        for q in (QUESTION, "Hi")
        for i, j in enumerate_pairs(3)
    ]
    keys = [(q, i) for q in (0, 1) for i, _ in enumerate_pairs(3)]
    levels = [[0] * len(rows), [k[0] for k in keys], keys]
    calls = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: calls.append(kw["input_ids"].numel()), with_kwargs=True
    )
    with torch.no_grad():
        shared, _, _, shared_pos = prefix_tree_forward(model, rows, levels, tok.pad_token_id)
        shared_tokens = sum(calls)
        calls.clear()
        plain, _, _, plain_pos = prefix_tree_forward(model, rows, [], tok.pad_token_id)
        plain_tokens = sum(calls)
    hook.remove()
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert shared_pos.squeeze(-1).tolist() == plain_pos.squeeze(-1).tolist() == list(map(len, rows))
    assert shared_tokens < 0.7 * plain_tokens  # the prefixes are computed once


@pytest.mark.slow
def test_identical_rows_are_computed_once_and_decode_like_the_plain_path():
    model, tok = random_toy_model(2, seed=3)
    # a group that agrees: three copies of one solution A and one other B
    sols = [SOLUTIONS[0], SOLUTIONS[0], SOLUTIONS[3], SOLUTIONS[0]]
    cfg = CarConfig(temperature=0.0, max_new_tokens=6, max_solution_tokens=60)
    shared = generate_pair_answers(model, tok, [(QUESTION, sols)], cfg, rng=0)
    plain = generate_pair_answers_plain(model, tok, [(QUESTION, sols)], cfg, rng=0)
    assert shared.texts == plain.texts and shared.answers == plain.answers
    texts = dict(zip(shared.pairs[0], shared.texts[0]))
    assert texts[(0, 2)] == texts[(1, 2)] == texts[(3, 2)]

    # 12 pair prompts, 3 distinct ((A,A), (A,B), (B,A)): the forward sees only the 3
    rows = [
        tok(car_prompt(tok, QUESTION, sols[i], sols[j]), add_special_tokens=False)["input_ids"]
        for i, j in enumerate_pairs(4)
    ]
    distinct = list(dict.fromkeys(map(tuple, rows)))
    assert len(distinct) == 3
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    with torch.no_grad():
        out, cache, mask, pos = prefix_tree_forward(model, rows, [], tok.pad_token_id)
        ref, _, _, ref_pos = prefix_tree_forward(model, [list(r) for r in distinct], [], 0)
    hook.remove()
    assert seen == [3, 3]
    index = [distinct.index(tuple(r)) for r in rows]
    torch.testing.assert_close(out, ref[index])
    assert pos.squeeze(-1).tolist() == ref_pos[index].squeeze(-1).tolist()
    assert mask.shape[0] == cache.layers[0].keys.shape[0] == len(rows)


class _ScriptedLM(torch.nn.Module):
    """Next token = script[last input token]: '{' -> '4' -> '2' -> '}' -> 'x' -> ... A stand-in
    to test stopping; it ignores the cache."""

    def __init__(self, tok, script):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.table = torch.full((len(tok),), tok.convert_tokens_to_ids("x"))
        for a, b in script.items():
            self.table[tok.convert_tokens_to_ids(a)] = tok.convert_tokens_to_ids(b)
        self.vocab, self.calls = len(tok), 0

    def forward(self, input_ids, logits_to_keep=1, **_):
        self.calls += 1
        nxt = self.table[input_ids[:, -1]]
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float()[:, None, :]
        return type("Out", (), {"logits": logits})()


def test_decoding_stops_once_every_brace_is_closed():
    tok = build_char_tokenizer()
    lm = _ScriptedLM(tok, {"{": "4", "4": "2", "2": "}"})
    cfg = CarConfig(temperature=0.0, max_new_tokens=8)
    result = generate_pair_answers(lm, tok, [(QUESTION, SOLUTIONS[:3])], cfg)
    assert result.answers == [["42"] * 6] and result.texts == [["42}"] * 6]
    assert result.unclosed == 0 and result.num_pairs == 6
    # prefill: common prefix, anchors, pair tails (the question level adds nothing with one
    # group); then 2 decode forwards for '2' and '}' instead of the budget of 7
    assert lm.calls == 3 + 2
    lm.calls = 0
    assert generate_pair_answers_plain(lm, tok, [(QUESTION, SOLUTIONS[:3])], cfg) == result
    assert lm.calls == 1 + 2
    # nested braces are balanced, and an answer still open after the budget is None
    nested = _ScriptedLM(tok, {"{": "a", "a": "{"})  # a{a{a... never closes
    result = generate_pair_answers(nested, tok, [(QUESTION, SOLUTIONS[:2])], cfg)
    assert result.answers == [[None, None]] and result.unclosed == 2
    assert result.texts == [["a{a{a{a{"] * 2]


class _CloseAtPositions(torch.nn.Module):
    """A toy model whose `}` wins at every position divisible by 4, so rows of different prompt
    lengths stop after 1 to 4 tokens (it checks positions, cache reuse and dropping rows)."""

    def __init__(self, inner, close_id):
        super().__init__()
        self.inner, self.close_id = inner, close_id

    def forward(self, input_ids, position_ids=None, **kw):
        out = self.inner(input_ids=input_ids, position_ids=position_ids, **kw)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None].expand(len(input_ids), -1)
        out.logits[:, -1, self.close_id] += (position_ids[:, -1] % 4 == 0).float() * 1e3
        return out


@pytest.mark.slow
def test_decoding_matches_a_cache_free_reference_when_rows_stop_at_different_steps():
    model, tok = random_toy_model(2, seed=0)
    lm = _CloseAtPositions(model, tok.convert_tokens_to_ids("}"))
    groups = [(QUESTION, SOLUTIONS[:3]), ("What is 2+2?", SOLUTIONS[2:])]
    cfg = CarConfig(temperature=0.0, max_new_tokens=6, chunk_pairs=3)
    result = generate_pair_answers(lm, tok, groups, cfg, rng=0)
    expected = []
    for (question, sols), pairs in zip(groups, result.pairs):
        for i, j in pairs:
            ids = tok(car_prompt(tok, question, sols[i], sols[j]), add_special_tokens=False)
            ids, new = ids["input_ids"], []
            while len(new) < cfg.max_new_tokens and "}" not in tok.decode(new):
                with torch.no_grad():  # the whole sequence, no cache, no padding
                    logits = lm(input_ids=torch.tensor([ids + new]), logits_to_keep=1).logits
                new.append(int(logits[0, -1].argmax()))
            expected.append(tok.decode(new))
    texts = [t for g in result.texts for t in g]
    assert texts == expected
    assert len({len(t) for t in texts}) >= 3  # rows really stopped at different steps
    assert result.unclosed == 0 and result.empty == texts.count("}") > 0
    assert [a for g in result.answers for a in g] == [parse_pair_answer(t) for t in texts]


# -- diagnostics --------------------------------------------------------------------------
def _h(*counts):
    n = sum(counts)
    return -sum(c / n * math.log(c / n) for c in counts)


def test_car_diagnostics_on_a_hand_built_step():
    pairs = [enumerate_pairs(4), enumerate_pairs(3)]
    rollout_answers = [["3", "5", "3", None], ["4", "6", "8"]]
    correct = [[True, False, True, False], [False, False, True]]
    pair_answers = [
        # (0,1) (0,2) (0,3) (1,0) (1,2) (1,3) (2,0)  (2,1) (2,3) (3,0) (3,1) (3,2)
        ["3", "3", "3", "3", "5", None, "3.0", "7", "3", "5", "5", None],
        # (0,1) (0,2) (1,0) (1,2) (2,0) (2,1)
        ["4", "8", "4", "6", "8", "9"],
    ]
    d = car_diagnostics(pairs, pair_answers, rollout_answers, correct, unclosed=2, truncated=3)
    # answers differ and one is picked: g1 (0,1) 1st, (1,0) 2nd, (1,2) 1st; (2,1) picks "7";
    # g2 (0,1) 1st, (0,2) 2nd, (1,0) 2nd, (1,2) 1st, (2,0) 1st, (2,1) neither
    assert d["car/position_bias"] == pytest.approx(5 / 8)
    # exactly one correct: g1 (0,1)+ (0,3)+ (1,0)+ (1,2)- (2,1)- (2,3)+ (3,0)-; g2 (0,2)+ (1,2)-
    # (2,0)+ (2,1)-
    assert d["car/select_correct"] == pytest.approx(6 / 11)
    assert d["car/incorrect_pair_first"] == pytest.approx(1 / 2)  # g2 (0,1) 1st, (1,0) 2nd
    # anchors' pair answers (as solution 1 or 2): g1 r0 AAAAAB, r2 ABACA; g2 r2 CBCD
    assert d["car/anchor_entropy_correct"] == pytest.approx(
        (_h(5, 1) + _h(3, 1, 1) + _h(2, 1, 1)) / 3
    )
    # g1 r1 AABCB, r3 AABB; g2 r0 ACAC, r1 AABD
    assert d["car/anchor_entropy_incorrect"] == pytest.approx(
        (_h(2, 2, 1) + _h(2, 2) + _h(2, 2) + _h(2, 1, 1)) / 4
    )
    assert d["car/pool_size"] == pytest.approx(((4 + 10) + (3 + 6)) / 2)
    assert d["car/unclosed"] == pytest.approx(2 / 18)
    assert d["car/truncated"] == 3.0
    assert d["car/num_pairs"] == 18.0


def test_car_diagnostics_are_nan_where_undefined():
    d = car_diagnostics([enumerate_pairs(2)], [["1", None]], [["1", "1"]], [[None, None]])
    for key in (
        "car/position_bias",
        "car/select_correct",
        "car/incorrect_pair_first",
        "car/anchor_entropy_correct",
        "car/anchor_entropy_incorrect",
        "car/unclosed",
        "car/truncated",
    ):
        assert math.isnan(d[key]), key
    assert d["car/pool_size"] == 3.0


def test_top_vote_accuracy_with_and_without_car():
    rollout_answers = [["3", "5", "5"], ["1", "1", "2"], ["7", "7", "8"]]
    pair_answers = [["3", "3", "3.0", None], ["2"], ["8"]]
    labels = ["3", "1", None]  # the unlabelled group is left out
    # with CAR: g1 3 (4 votes) beats 5 (2): right; g2 1 and 2 tie at 2, 1 first: right
    assert top_vote_metrics(rollout_answers, pair_answers, labels) == {"car/top_vote_acc": 1.0}
    # without: g1 5 wins: wrong; g2 1 wins: right
    groups = list(zip(rollout_answers, pair_answers))
    assert top_vote_acc(groups, labels, use_pool=False) == 0.5
    assert top_vote_acc([(["3"], None)], ["\\frac{6}{2}"]) == 1.0
    assert math.isnan(top_vote_acc([(["3"], ["3"])], [None]))
