"""The typed step: `score_step` on a hand-built batch (shapes and hand-computed values) and
`step_metrics` on it."""

from __future__ import annotations

import math

import pytest
import torch

from omgrpo.config import compose
from omgrpo.core.answers import Grader, extract_boxed
from omgrpo.core.car import CarResult
from omgrpo.core.masks import random_token_mask, top_entropy_mask
from omgrpo.core.spans import answer_mask_for_ids, response_offsets, span_token_mask
from omgrpo.core.step import (
    LoopState,
    decode_responses,
    is_correct,
    masked_step,
    score_step,
    step_loss,
    step_metrics,
)
from omgrpo.models.tokenizer import build_char_tokenizer
from omgrpo.tasks import Problem
from omgrpo.tasks.toy import ToyProbe, last_result_span

# Two prompts x G = 3; the char tokenizer gives one token per character.
TEXTS = [
    "2+2=4 so \\boxed{4}",
    "\\boxed{5}",
    "no answer",
    "\\boxed{9}",
    "\\boxed{9}",
    "\\boxed{8}",
]
PROMPTS = [
    Problem(id="p0", question="2+2?", answer="4"),
    Problem(id="p1", question="?", answer="8"),
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def batch_of(tok, texts):
    rows = [torch.tensor(tok.encode(t, add_special_tokens=False)) for t in texts]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    return ids, mask


@pytest.mark.slow
def test_score_step_shapes_and_hand_computed_values(tok):
    ids, mask = batch_of(tok, TEXTS)
    cfg = compose(["method=om_grpo_format_only"])  # soft vote + format, format-only advantages
    batch = score_step(tok, ids, mask, PROMPTS, cfg)
    B, T = len(TEXTS), ids.shape[1]
    assert ids.shape == (6, len(TEXTS[0]))
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    r = batch.responses
    assert r.ids.shape == r.mask.shape == r.answer_mask.shape == (B, T)
    assert r.answer_mask.dtype == torch.bool and r.texts == TEXTS
    for row, text in enumerate(TEXTS):  # the answer's characters, nothing else
        expected = list(range(text.rindex("{") + 1, text.rindex("}"))) if "{" in text else []
        assert r.answer_mask[row].nonzero().flatten().tolist() == expected
    assert batch.answers == ["4", "5", None, "9", "9", "8"]
    assert batch.correct == [True, False, False, False, False, True]
    # soft vote: group 0 votes 4, 5 (None abstains); group 1 votes 9, 9, 8
    soft = [0.5, 0.5, 0.0, 2 / 3, 2 / 3, 1 / 3]
    fmt = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert batch.reward_parts["soft_vote"].tolist() == pytest.approx(soft)
    assert batch.reward_parts["format"].tolist() == fmt
    assert batch.rewards.shape == (B,)
    assert batch.rewards.tolist() == pytest.approx([s + f for s, f in zip(soft, fmt)])
    # GRPO: group 0 rewards 1.5, 1.5, 0 -> mean 1, unbiased std sqrt(0.75)
    std0 = math.sqrt(0.75)
    expected = [0.5 / std0, 0.5 / std0, -1 / std0]
    assert batch.advantages.shape == (B,)
    assert batch.advantages[:3].tolist() == pytest.approx(expected, rel=1e-5)
    # format-only: group 1 all formatted -> 0; group 0 formats 1, 1, 0 as above
    assert batch.format_advantages.shape == (B,)
    assert batch.format_advantages.tolist() == pytest.approx([*expected, 0, 0, 0], rel=1e-5)


def test_car_answers_join_the_pool_and_the_metrics(tok):
    ids, mask = batch_of(tok, TEXTS)
    pairs = [[(0, 1), (1, 0)], [(0, 2), (2, 0)]]
    car = CarResult(pairs=pairs, answers=[["4", "4"], ["8", None]], num_pairs=4)
    batch = score_step(tok, ids, mask, PROMPTS, compose(["method=om_grpo"]), car=car)
    # group 0 pool: 4, 5 + 4, 4 -> "4": 3/4; group 1: 9, 9, 8 + 8 -> 2/4 each
    assert batch.reward_parts["soft_vote"].tolist() == pytest.approx([0.75, 0.25, 0, 0.5, 0.5, 0.5])
    state = LoopState(last_majority={"p1": "8"})
    m = step_metrics(batch, state, confident_share=0.6)
    assert m["reward/total"] == pytest.approx(batch.rewards.mean())
    assert m["reward/format"] == pytest.approx(5 / 6)
    assert m["acc/train"] == pytest.approx(2 / 6)
    # pool size: G + pair answers that are not None: (3 + 2 + 3 + 1) / 2
    assert m["car/num_pairs"] == 4 and m["car/pool_size"] == 4.5
    # the pool's majority: group 0 "4" (right), group 1 a tie 9/8 won by 9 (first seen);
    # the rollouts' own: group 0 a tie 4/5 won by 4 (right), group 1 "9" (wrong)
    assert m["car/top_vote_acc"] == 0.5 and m["answers/top_vote_acc"] == 0.5
    assert m["answers/label_flip_rate"] == 1.0 and state.last_majority == {"p1": "9", "p0": "4"}
    assert m["response/length_mean"] == pytest.approx(sum(map(len, TEXTS)) / 6)
    assert m["answers/batch_mode"] == "9"


def test_is_correct_is_a_diagnostic_of_labelled_answers():
    grader = Grader()
    assert is_correct("0.5", "\\frac{1}{2}", grader) is True
    assert is_correct(None, "4", grader) is False
    assert is_correct("4", None, grader) is None


def test_token_roles_of_a_worked_response(tok):
    """Char tokenizer: each role is exactly its characters (hand-checked)."""
    text = "3+4=7\n7*2=14\nSo the answer is \\boxed{1}."
    ids, mask = batch_of(tok, [text])
    eos = torch.tensor([[tok.eos_token_id]])
    ids, mask = torch.cat([ids, eos], 1), torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
    r = decode_responses(tok, ids, mask, ToyProbe())
    roles = r.role_masks()
    chars = lambda m: "".join(text[i] for i in m[0].nonzero().flatten().tolist() if i < len(text))  # noqa: E731
    assert chars(r.answer_mask) == "1"
    assert chars(roles["result"]) == "14"  # the last computed line's result
    assert chars(roles["format"]) == "So the answer is \\boxed{}."
    assert bool(roles["format"][0, -1])  # eos closes the format
    assert chars(roles["other"]) == "3+4=7\n7*2=\n"
    # the four roles partition the response tokens
    total = sum(m.long() for m in [r.answer_mask, *roles.values()])
    assert torch.equal(total.bool(), mask.bool()) and int(total.max()) == 1


def test_batched_role_masks_equal_the_per_row_reference(tok):
    """decode_responses builds all rows' masks at once; each row equals the one-row path
    (`answer_mask_for_ids`, `span_token_mask`) whatever its length, box or lack of one."""
    texts = [
        "3+4=7\nSo the answer is \\boxed{7}.",
        "",  # empty response
        "no box here 1+1=2",
        "\\boxed{1} then \\boxed{22}",  # the last box counts
        "\\boxed{unclosed",
        "12*3=36\n36-4=32\nSo the answer is \\boxed{32}.",
    ]
    ids, mask = batch_of(tok, texts)
    r = decode_responses(tok, ids, mask, ToyProbe())
    for i, text in enumerate(texts):
        n = len(text)
        expected, decoded = answer_mask_for_ids(tok, ids[i, :n])
        assert decoded == text and r.texts[i] == text
        assert torch.equal(r.answer_mask[i, :n], expected)
        result = span_token_mask(response_offsets(tok, ids[i, :n], text), last_result_span(text))
        assert torch.equal(r.result_mask[i, :n], result)
        boxed = extract_boxed(text)
        closing = None if boxed is None else text.rfind("\n", 0, boxed.span[0]) + 1
        fmt = [closing is not None and j >= closing for j in range(n)]
        assert r.format_mask[i, :n].tolist() == fmt
        for m in (r.answer_mask, r.result_mask, r.format_mask):  # padding is no role
            assert not m[i, n:].any()


def test_guess_and_majority_diagnostics_hand_computed(tok):
    texts = [
        "1+1=2\nSo the answer is \\boxed{2}.",  # consistent
        "1+1=2\nSo the answer is \\boxed{1}.",  # guess (peak)
        "So the answer is \\boxed{1}.",  # bare guess (peak)
        "no answer",
        "5-1=4\nSo the answer is \\boxed{4}.",  # consistent
        "5-1=4\nSo the answer is \\boxed{9}.",  # guess
    ]
    prompts = [
        Problem(id="e", question="1+1", answer="2", meta={"difficulty": "easy"}),
        Problem(id="h", question="5-1", answer="4", meta={"difficulty": "hard"}),
    ]
    ids, mask = batch_of(tok, texts)
    batch = score_step(tok, ids, mask, prompts, compose(["method=mv"]))
    m = step_metrics(batch, LoopState(), 0.75, ToyProbe(peak="1"))
    assert m["answers/consistency"] == pytest.approx(2 / 5)
    assert m["answers/guess_rate_easy"] == pytest.approx(2 / 3)
    assert m["answers/guess_rate_hard"] == pytest.approx(1 / 2)
    assert m["answers/bare_guess_rate"] == pytest.approx(1 / 5)
    assert m["answers/peak_share"] == pytest.approx(2 / 6)
    # group e votes 2, 1, 1 -> majority "1", wrong; group h ties 4/9 -> the first class, "4"
    assert m["answers/wrong_majority"] == pytest.approx(1 / 2)
    assert m["answers/top_vote_acc"] == pytest.approx(1 / 2)
    # no difficulty (not a toy problem) or no task probe: no guess metrics
    assert "answers/consistency" not in step_metrics(
        score_step(tok, ids, mask, PROMPTS[:1] * 2, compose(["method=mv"])),
        LoopState(),
        0.75,
        ToyProbe(peak="1"),
    )
    assert "answers/consistency" not in step_metrics(batch, LoopState(), 0.75)
    # without a probe there is no `result` role (the task hook defines it)
    assert not decode_responses(tok, ids, mask).result_mask.any()


def with_eos(tok, texts):
    """Right-padded ids of `texts`, each ended by eos (as generated), and their mask."""
    rows = [
        torch.tensor([*tok.encode(t, add_special_tokens=False), tok.eos_token_id]) for t in texts
    ]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    return ids, mask


SPAN_TEXTS = [
    "3+4=7\nSo the answer is \\boxed{7}.",
    "",
    "no box here 1+1=2",
    "\\boxed{1} then \\boxed{22}",  # ends at the box: its eos is the answer's under closing
    "\\boxed{unclosed",
    "12*3=36\n36-4=32\nSo the answer is \\boxed{32}. Done",
]


@pytest.mark.parametrize("span", ["boxed", "closing", "closing_line", "closing_only"])
def test_answer_span_choice_batched_equals_per_row_and_roles_partition(tok, span):
    ids, mask = with_eos(tok, SPAN_TEXTS)
    r = decode_responses(tok, ids, mask, ToyProbe(), span=span)
    for i, text in enumerate(SPAN_TEXTS):
        n = len(text) + 1  # with its eos
        expected, _ = answer_mask_for_ids(tok, ids[i, :n], span=span)
        assert torch.equal(r.answer_mask[i, :n], expected)
        assert not r.answer_mask[i, n:].any()
    roles = r.role_masks()
    total = sum(m.long() for m in [r.answer_mask, *roles.values()])
    assert torch.equal(total.bool(), mask.bool()) and int(total.max()) == 1


def test_closing_span_hand_computed_and_the_default_unchanged(tok):
    """Char tokenizer: `closing` adds the closing brace and the eos right after it; the
    default is the paper's span, the box content, as before the choice."""
    ids, mask = with_eos(tok, SPAN_TEXTS)

    def text(i, m):  # the marked characters of row i, `$` standing for its eos
        return "".join((SPAN_TEXTS[i] + "$")[j] for j in m[i].nonzero().flatten().tolist())

    default = decode_responses(tok, ids, mask, ToyProbe())
    closing = decode_responses(tok, ids, mask, ToyProbe(), span="closing")
    line = decode_responses(tok, ids, mask, ToyProbe(), span="closing_line")
    only = decode_responses(tok, ids, mask, ToyProbe(), span="closing_only")
    assert [text(i, default.answer_mask) for i in range(6)] == ["7", "", "", "22", "", "32"]
    assert [text(i, closing.answer_mask) for i in range(6)] == ["7}", "", "", "22}$", "", "32}"]
    assert [text(i, only.answer_mask) for i in range(6)] == ["}", "", "", "}$", "", "}"]
    # closing_only: the digits are the closing line's (`format`), the brace and eos the answer
    assert text(0, only.role_masks()["format"]) == "So the answer is \\boxed{7.$"
    assert text(0, line.answer_mask) == "So the answer is \\boxed{7}.$"
    assert text(5, line.answer_mask) == "So the answer is \\boxed{32}. Done$"
    # the role split follows: the brace (and an eos right after it) leave `format`
    assert text(0, closing.role_masks()["format"]) == "So the answer is \\boxed{.$"
    assert text(3, closing.role_masks()["format"]) == "\\boxed{1} then \\boxed{"
    for i, t in enumerate(SPAN_TEXTS):  # the default equals the paper's mask as it was built
        boxed = extract_boxed(t)
        span = None if boxed is None else boxed.span
        old = span_token_mask(response_offsets(tok, ids[i, : len(t) + 1], t), span)
        assert torch.equal(default.answer_mask[i, : len(t) + 1], old)


def test_decode_responses_marks_further_spans_as_the_answer_span(tok):
    """`spans`: each further span's mask equals the answer mask that span would give (the
    generic masks read `boxed` and `random_mask`'s span); none asked, none made."""
    ids, mask = with_eos(tok, SPAN_TEXTS)
    assert decode_responses(tok, ids, mask, ToyProbe()).span_masks == {}
    r = decode_responses(tok, ids, mask, ToyProbe(), "closing_only", ("boxed", "closing"))
    assert set(r.span_masks) == {"boxed", "closing"}
    for span, got in r.span_masks.items():
        expected = decode_responses(tok, ids, mask, ToyProbe(), span=span).answer_mask
        assert torch.equal(got, expected), span
    # the answer span (and so the roles) is the configured one, whatever else is marked
    plain = decode_responses(tok, ids, mask, ToyProbe(), "closing_only")
    assert torch.equal(r.answer_mask, plain.answer_mask)


@pytest.mark.slow
def test_score_step_reads_the_span_from_the_algorithm_section(tok):
    ids, mask = with_eos(tok, TEXTS)
    for method, extra in [("om_grpo_no_car", 0), ("om_grpo_no_car_closing", 2)]:
        batch = score_step(tok, ids, mask, PROMPTS, compose([f"method={method}"]))
        for row, t in enumerate(TEXTS):  # the box content (+ `}` and eos: every text ends there)
            expected = list(range(t.rindex("{") + 1, t.rindex("}") + extra)) if "{" in t else []
            assert batch.responses.answer_mask[row].nonzero().flatten().tolist() == expected
    with pytest.raises(ValueError, match="unknown answer span"):
        cfg = compose(["method=om_grpo_no_car"])
        cfg.algorithm.answer_span = "last"
        score_step(tok, ids, mask, PROMPTS, cfg)


# ----------------------------------------------------------------------------------------------
# Study v4's generic masks on a scored step (`masked_step`), hand-computed on the char tokenizer
# ----------------------------------------------------------------------------------------------


def _masked(tok, method, **kw):
    ids, mask = with_eos(tok, TEXTS)
    batch = score_step(tok, ids, mask, PROMPTS, compose([f"method={method}"]))
    return batch, masked_step(batch, compose([f"method={method}"]).algorithm, **kw)


@pytest.mark.slow
def test_masked_step_leaves_a_step_without_generic_masks_alone(tok):
    for method in ("om_grpo_no_car", "om_grpo_no_car_closing"):
        batch, (out, metrics) = _masked(tok, method, seed=0, step=1)
        assert out is batch and out.token_mask is None and metrics == {}
        assert batch.responses.span_masks == {}


@pytest.mark.slow
def test_masked_step_closing_only_counts_its_span_as_masked(tok):
    """w = 0 on `}` + eos: 5 boxed rows x 2 tokens of the step's response tokens; none of
    them a digit of the box (one token per character)."""
    _, (out, metrics) = _masked(tok, "om_grpo_no_car_closing_only", seed=0, step=1)
    assert out.token_mask is None  # the answer weight masks it, as any span
    answer = out.responses.answer_mask
    n = int(out.responses.mask.sum())
    assert n == sum(len(t) + 1 for t in TEXTS) and int(answer.sum()) == 10
    assert metrics == {"mask/frac": pytest.approx(10 / n), "mask/answer_overlap": 0.0}


@pytest.mark.slow
def test_masked_step_random_mask_draws_the_boxed_span_size_per_rollout(tok):
    batch, (out, metrics) = _masked(tok, "om_grpo_no_car_random_mask", seed=13, step=4)
    r = out.responses
    boxed = r.span_masks["boxed"]
    assert torch.equal(boxed, r.answer_mask)  # the answer role stays the paper's span
    assert out.token_mask.sum(-1).tolist() == boxed.sum(-1).tolist() == [1, 1, 0, 1, 1, 1]
    assert torch.equal(out.token_mask, random_token_mask(r.mask, boxed.sum(-1), 13, 4))
    resp = r.mask.bool()
    assert metrics["mask/frac"] == pytest.approx(5 / int(resp.sum()))
    overlap = float((out.token_mask & boxed).sum()) / 5
    assert metrics["mask/answer_overlap"] == pytest.approx(overlap)
    # the advantages, answer mask and roles are the scored step's
    assert torch.equal(out.advantages, batch.advantages)


@pytest.mark.slow
def test_masked_step_top_entropy_and_the_loss_it_feeds(tok):
    ids, _ = with_eos(tok, TEXTS)
    entropy = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0))
    batch, (out, metrics) = _masked(
        tok, "om_grpo_no_car_top_entropy", seed=0, step=1, entropy=entropy
    )
    r = out.responses
    assert torch.equal(out.token_mask, top_entropy_mask(entropy, r.mask, 0.2))
    resp = r.mask.bool()
    kept = int((resp & ~out.token_mask).sum())
    assert abs(kept - 0.2 * int(resp.sum())) <= 1
    assert metrics["mask/frac"] == pytest.approx(1 - kept / int(resp.sum()))
    # step_loss hands the mask to grpo_loss: no gradient through masked tokens
    algo = compose(["method=om_grpo_no_car_top_entropy"]).algorithm
    logp = (-torch.rand(ids.shape) - 0.1).requires_grad_(True)
    idx = torch.arange(len(TEXTS))
    loss, _ = step_loss(out, idx, logp, r.mask, algo, r.mask.sum())
    (grad,) = torch.autograd.grad(loss, logp)
    trained = resp & ~out.token_mask & (out.advantages[:, None] != 0)
    assert (grad[out.token_mask] == 0).all() and (grad[trained] != 0).all()
    with pytest.raises(ValueError, match="needs the step's per-token entropy"):
        masked_step(batch, algo, seed=0, step=1)
