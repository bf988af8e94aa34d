"""The mechanism probe (study v2): each measurement against a plain computation on a random
toy model, the split update against the trainer's real update, and a tiny run."""

import copy
import math

import numpy as np
import pandas as pd
import pytest
import torch
from toy_models import random_toy_model

from omgrpo.backends.native import mechanism as mech
from omgrpo.backends.native.trainer import train
from omgrpo.backends.native.update import ppo_update
from omgrpo.config import compose
from omgrpo.core.losses import group_advantages
from omgrpo.core.rewards import make_group
from omgrpo.core.step import StepBatch, decode_responses
from omgrpo.core.task import Problem
from omgrpo.generation.rollout import Sequences, left_pad, right_pad
from omgrpo.tasks.prompts import PromptEncoder
from omgrpo.tasks.toy import ToyProbe
from omgrpo.tracking.store import RunStore

GOLD = [  # (question, gold solution, difficulty)
    ("Evaluate left to right: 7+5", "7+5=12\nSo the answer is \\boxed{12}.", "hard"),
    ("Evaluate left to right: 2*3", "2*3=6\nSo the answer is \\boxed{6}.", "easy"),
    ("Evaluate left to right: 9+9", "9+9=18\nSo the answer is \\boxed{18}.", "easy"),
    ("Evaluate left to right: 4-3", "4-3=1\nSo the answer is \\boxed{1}.", "hard"),
    ("Evaluate left to right: 5*4", "5*4=20\nSo the answer is \\boxed{20}.", "hard"),
]


def _problems():
    return [
        Problem(f"p{i}", q, s.split("{")[-1].rstrip("}."), solution=s, meta={"difficulty": d})
        for i, (q, s, d) in enumerate(GOLD)
    ]


def _next_token_probs(model, ids: list[int]) -> torch.Tensor:
    """Plain reference: one unpadded sequence, the distribution of the token after it."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    return torch.softmax(logits.double(), -1)


def test_head_ids_cut_only_at_a_token_boundary():
    ids, offsets = [5, 6, 7, 8], [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert mech.head_ids(ids, offsets, 3) == [5, 6]
    assert mech.head_ids(ids, offsets, 4) is None  # token 7 straddles character 4
    assert mech.head_ids(ids, offsets, 0) is None  # nothing before the answer
    assert mech.head_ids(ids, offsets, 6) == ids


@torch.no_grad()
@pytest.mark.slow
def test_gates_equal_a_plain_forward_of_prompt_and_gold_text():
    model, tok = random_toy_model(num_layers=1, seed=3)
    encode = PromptEncoder(tok, 512)
    problems = _problems()
    probe = mech.MechanismProbe(
        2, tok, "1", mech.gold_prefixes(tok, encode, problems), mech.Prefixes(), model
    )
    gates = probe.gates(model)
    one = tok.convert_tokens_to_ids("1")
    digits = tok.convert_tokens_to_ids(list("0123456789"))
    first, stop = {}, {}
    for p in problems:
        cut = p.solution.index("{") + 1  # the char tokenizer: one token per character
        head = encode(p) + tok(p.solution[:cut], add_special_tokens=False)["input_ids"]
        if not p.answer.startswith("1"):  # 6 and 20: boxing "1" there is a guess
            p_one = float(_next_token_probs(model, head)[one])
            first.setdefault(p.meta["difficulty"], []).append(p_one)
        if p.answer.startswith("1") and len(p.answer) > 1:  # 12 and 18: stopping truncates
            after = _next_token_probs(model, [*head, one])
            stop.setdefault(p.meta["difficulty"], []).append(1 - float(after[digits].sum()))
    assert probe.stop_rows == [True, False, True, False, False]
    assert probe.first_rows == [False, True, False, False, True]
    every = first["easy"] + first["hard"]
    assert gates["mech/gate_first"] == pytest.approx(np.mean(every), abs=1e-6)
    assert gates["mech/gate_first_hard"] == pytest.approx(np.mean(first["hard"]), abs=1e-6)
    assert gates["mech/gate_stop_easy"] == pytest.approx(stop["easy"][0], abs=1e-6)
    assert gates["mech/gate_stop_hard"] == pytest.approx(stop["hard"][0], abs=1e-6)


@torch.no_grad()
@pytest.mark.slow
def test_answer_probs_of_padded_rows_equal_each_row_alone():
    model, tok = random_toy_model(num_layers=2, seed=5)
    rows = mech.Prefixes()
    for prompt, head in [("Q: 1+1", "1+1=2 \\boxed{"), ("Question: 40+7 then", "\\boxed{")]:
        rows.add(tok(prompt)["input_ids"], tok(head)["input_ids"], None, "")
    target = tok("12", add_special_tokens=False)["input_ids"]  # two tokens: "1", "2"
    lead = mech.tokens_starting_with(tok, "1")
    digits = mech.tokens_starting_with(tok, "0123456789")
    assert lead.tolist() == [tok.convert_tokens_to_ids("1")] and len(digits) == 10
    out = mech.answer_probs(model, rows, target, lead, digits, tok.pad_token_id)
    for i in range(2):
        ids = rows.prompts[i] + rows.heads[i]
        p0 = _next_token_probs(model, ids)
        p1 = _next_token_probs(model, ids + target[:1])
        p2 = _next_token_probs(model, ids + target)
        entropy = -(p0 * p0.log()).sum()
        box = p0[target[0]] * p1[target[1]] * (1 - p2[digits].sum())
        assert float(out["first"][i]) == pytest.approx(float(p0[lead].sum()), abs=1e-6)
        assert float(out["entropy"][i]) == pytest.approx(float(entropy), abs=1e-5)
        assert float(out["stop"][i]) == pytest.approx(float(1 - p2[digits].sum()), abs=1e-6)
        assert float(out["box"][i]) == pytest.approx(float(box), rel=1e-5)


def test_flat_cosine():
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    assert mech.flat_cosine(a, a) == pytest.approx(1.0)
    assert mech.flat_cosine(a, [-x for x in a]) == pytest.approx(-1.0)
    # [1, 2, 3] . [2, -1, 0] = 0; a missing part is a zero
    assert mech.flat_cosine(a, [torch.tensor([2.0, -1.0]), None]) == pytest.approx(0.0)
    assert math.isnan(mech.flat_cosine(a, [None, torch.zeros(1, 1)]))


def test_computed_lead_share_counts_the_last_computed_value():
    texts = [
        "3+9=12\n12-2=10\nSo the answer is \\boxed{1}.",  # last computed 10: starts with 1
        "3+4=7\nSo the answer is \\boxed{1}.",  # 7
        "So the answer is \\boxed{1}.",  # nothing computed: left out
        "50*3=150\nSo the answer is \\boxed{150}.",  # 150
    ]
    out = mech.computed_lead_shares(texts, ["hard", "easy", "hard", "hard"], ToyProbe("1"), "1")
    assert out == {
        "mech/computed_lead": pytest.approx(2 / 3),
        "mech/computed_lead_easy": 0.0,
        "mech/computed_lead_hard": 1.0,
    }


def test_shifted_restores_the_same_tensors():
    model, _ = random_toy_model(num_layers=1, seed=0)
    params = list(model.parameters())
    before = [(p.data_ptr(), p.detach().clone()) for p in params]
    delta = [torch.full_like(p, 0.1) for p in params]
    with mech.shifted(params, delta):
        assert torch.equal(params[0].detach(), before[0][1] + 0.1)
    # the same storage and the same bits: restored, not shifted back
    assert all(p.data_ptr() == ptr and torch.equal(p, b) for p, (ptr, b) in zip(params, before))


RESPONSES = [  # two groups of three; group 0's majority boxes 12
    ["7+5=12\nSo the answer is \\boxed{12}.", "7+5=13\nSo \\boxed{12}.", "7+5=12\n\\boxed{1}."],
    ["2*3=6\nSo the answer is \\boxed{6}.", "2*3=5\n\\boxed{5}.", "2*3=6\n\\boxed{6}."],
]


def _step(tok, span="boxed"):
    """Sequences and a scored StepBatch of RESPONSES (majority-vote rewards)."""
    problems = _problems()[:2]
    encode = PromptEncoder(tok, 512)
    prompts = [encode(p) for p, group in zip(problems, RESPONSES) for _ in group]
    eos = tok.eos_token_id
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for g in RESPONSES for t in g]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_token_id)
    response_ids, response_mask = right_pad(ids, tok.pad_token_id)
    seqs = Sequences(prompt_ids, prompt_mask, response_ids, response_mask)
    responses = decode_responses(tok, response_ids, response_mask, ToyProbe("1"), span)
    groups = [make_group(responses.answers[3 * g : 3 * g + 3]) for g in range(2)]
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    batch = StepBatch(
        prompts=problems,
        group_ids=group_ids,
        responses=responses,
        answers=responses.answers,
        correct=[None] * 6,
        groups=groups,
        reward_parts={"majority_vote": rewards},
        rewards=rewards,
        advantages=group_advantages(torch.tensor(rewards, dtype=torch.float32), group_ids),
    )
    return seqs, batch


def _algo(**kw):
    base = dict(
        answer_weight=0.0,
        answer_kl_weight=None,
        clip=0.2,
        kl_coef=0.0,
        agg="token-mean",
        ppo_epochs=1,
        mini_batch_size=None,
        micro_batch_size=None,
    )
    return type("Algo", (), {**base, **kw})


def test_mode_rows_are_the_rollouts_boxing_their_groups_majority():
    _, tok = random_toy_model(num_layers=1, seed=0)
    _, batch = _step(tok)
    assert mech.mode_rows(batch).tolist() == [True, True, False, True, False, True]


@pytest.mark.slow
def test_the_token_parts_sum_to_the_full_gradient():
    model, tok = random_toy_model(num_layers=1, seed=1)
    seqs, batch = _step(tok)
    algo = _algo(answer_weight=0.5, micro_batch_size=4, agg="seq-mean-token-mean")
    params = list(model.parameters())
    parts = mech.gradient_parts(model, params, seqs, batch, None, algo)
    model.zero_grad()
    ppo_update(model, _NoStep(), seqs, None, None, batch, algo, grad_clip=0.0)
    for p, a, o in zip(params, parts.answer, parts.other):
        assert a is not None and o is not None
        torch.testing.assert_close(a + o, p.grad, atol=1e-5, rtol=1e-4)
    assert any(a.abs().sum() > 0 for a in parts.answer)  # w = 0.5: the answer part is real


class _NoStep:
    """An optimizer that keeps the gradients (to read the real update's)."""

    def zero_grad(self, set_to_none=True):
        pass

    def step(self):
        pass


@pytest.mark.parametrize(
    ("algo", "grad_clip", "kl"),
    [
        (_algo(kl_coef=0.05), 1e-3, True),  # OM-GRPO with a KL term; the clip binds
        (_algo(answer_weight=1.0, micro_batch_size=2, agg="seq-mean-token-sum"), 0.0, False),
    ],
)
@pytest.mark.slow
def test_the_split_step_is_the_trainers_real_update(algo, grad_clip, kl):
    model, tok = random_toy_model(num_layers=2, seed=2)
    seqs, batch = _step(tok)
    ref = copy.deepcopy(model).requires_grad_(False)
    ref_logprobs = None
    if kl:
        with torch.no_grad():
            ref_logprobs = torch.randn(seqs.response_ids.shape) * 0.1 - 2.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ppo_update(model, optimizer, seqs, None, ref_logprobs, batch, algo, grad_clip)  # momentum
    params = list(model.parameters())
    parts = mech.gradient_parts(model, params, seqs, batch, ref_logprobs, algo, ref)
    deltas = mech.adamw_step_parts(optimizer, params, parts.answer, parts.other, grad_clip)
    full = [sum(d) for d in zip(*deltas.values())]
    before = [p.detach().clone() for p in params]
    ppo_update(model, optimizer, seqs, None, ref_logprobs, batch, algo, grad_clip)
    for p, b, d in zip(params, before, full):  # steps of ~lr = 1e-2, equal to ~1e-5
        torch.testing.assert_close(p.detach() - b, d, atol=1e-5, rtol=1e-3)
    assert all(d.abs().sum() > 0 for d in deltas["history"])  # the first step's momentum
    answer_moves = any(d.abs().sum() > 0 for d in deltas["answer"])
    assert answer_moves == (algo.answer_weight > 0)  # w = 0, KL masked: no answer part at all
    assert parts.drift["mech/kl_answer_count"] == int(batch.responses.answer_mask.sum())
    assert (
        parts.drift["mech/kl_answer_sum"] > 0 and parts.drift["mech/logit_drift_reasoning_sum"] > 0
    )


def test_probe_needs_adamw():
    model, _ = random_toy_model(num_layers=1, seed=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="AdamW"):
        mech.adamw_step_parts(sgd, list(model.parameters()), [None], [None], 1.0)


@pytest.mark.slow
def test_a_run_logs_the_mechanism_and_keeps_its_trajectory(tiny_overrides, metric_table):
    # Self-Certainty beside OM-GRPO's reward: a continuous part, so every group has reward
    # spread and both steps update the weights whatever the barely trained base answers (with
    # the vote and format parts alone it earned 0 everywhere on some machines: nothing trained,
    # and a probe that disturbed the update could not show)
    parts = "reward.parts=[soft_vote,format,self_certainty]"
    common = [*tiny_overrides, "trainer.steps=2", "eval.every=0", parts]
    plain = RunStore(train(compose([*common, "run.name=plain"]))).read_metrics()
    assert (plain["grad/norm"] > 0).all()  # both steps updated the weights
    probed = RunStore(
        train(compose([*common, "run.name=probed", "diagnostics.mechanism_every=1"]))
    ).read_metrics()
    names = set(probed.columns)
    assert metric_table.undocumented(names, "native") == []
    assert {"mech/gate_first", "mech/gate_stop", "mech/d_box1_other", "mech/leak_cos"} <= names
    assert {"mech/kl_answer", "mech/logit_drift_reasoning", "time/mechanism"} <= names
    assert probed["mech/gate_first"].dropna().between(0, 1).all()
    assert list(probed["train/step"]) == [1, 2] and probed["mech/gate_first"].notna().all()
    kept = [c for c in plain.columns if not c.startswith(("time/", "perf/", "mem/"))]
    pd.testing.assert_frame_equal(plain[kept], probed[kept])


@pytest.mark.slow
def test_the_update_frees_each_micro_batchs_logits_before_the_next_forward_and_the_step(
    monkeypatch,
):
    """Logits (m x T x V) are the update's largest tensor: held over to the next micro-batch's
    forward or to the optimizer step they add to both peaks (0.87 GiB on Qwen2.5-7B, m = 1)."""
    import weakref

    from omgrpo.backends.native import update

    model, tok = random_toy_model(num_layers=1, seed=4)
    seqs, batch = _step(tok)
    alive: list[weakref.ref] = []
    response_logits = update.response_logits

    def logits_checked(policy, part):
        assert all(ref() is None for ref in alive), "a micro-batch's logits outlived it"
        out = response_logits(policy, part)
        alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(update, "response_logits", logits_checked)

    class CheckedAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            assert all(ref() is None for ref in alive), "logits alive at the optimizer step"
            return super().step(closure)

    optimizer = CheckedAdamW(model.parameters(), lr=1e-3)
    out = ppo_update(model, optimizer, seqs, None, None, batch, _algo(micro_batch_size=2), 1.0)
    assert not out["skipped"] and len(alive) == 3  # 6 rows in micro-batches of 2


def test_step_loss_is_grpo_loss_on_the_indexed_rows():
    """`step_loss` (the update's and the probe's one loss builder) against `grpo_loss` called
    by hand on rows 1 and 4 of a step, with a KL term, old log-probs and the kl override."""
    from omgrpo.core.losses import grpo_loss
    from omgrpo.core.step import step_loss

    _, tok = random_toy_model(num_layers=1, seed=5)
    seqs, batch = _step(tok)
    idx = torch.tensor([1, 4])
    g = torch.Generator().manual_seed(0)
    shape = seqs.response_ids.shape
    old, ref = (torch.randn(shape, generator=g) * 0.1 - 2.0 for _ in range(2))
    logprobs = old[idx] + torch.randn((2, shape[1]), generator=g) * 0.05
    mask = seqs.response_mask[idx]
    algo = _algo(answer_weight=0.3, kl_coef=0.05, agg="seq-mean-token-sum")
    for kl in (None, 0.0):
        got, _ = step_loss(
            batch,
            idx,
            logprobs,
            mask,
            algo,
            mask.sum(),
            old_logprobs=old,
            ref_logprobs=ref,
            kl_coef=kl,
        )
        want, _ = grpo_loss(
            logprobs,
            old[idx],
            ref[idx],
            batch.advantages[idx],
            mask,
            batch.responses.answer_mask[idx],
            answer_weight=0.3,
            clip=0.2,
            kl_coef=0.05 if kl is None else 0.0,
            agg="seq-mean-token-sum",
            num_tokens=mask.sum(),
        )
        torch.testing.assert_close(got, want)


def test_step_loss_takes_the_generic_masks_token_mask_row_by_row():
    """A scored step's `token_mask` (the generic masks) reaches the loss of rows `idx` in any
    order: `step_loss` equals `grpo_loss` given `token_mask[idx]` by hand, differs from the
    unmasked loss, and leaves exactly zero gradient on the masked tokens."""
    import dataclasses

    from omgrpo.core.losses import grpo_loss
    from omgrpo.core.step import step_loss

    _, tok = random_toy_model(num_layers=1, seed=5)
    seqs, batch = _step(tok)
    shape = seqs.response_ids.shape
    g = torch.Generator().manual_seed(1)
    token_mask = (torch.rand(shape, generator=g) < 0.3) & seqs.response_mask.bool()
    masked_batch = dataclasses.replace(batch, token_mask=token_mask)
    idx = torch.tensor([4, 0, 2])  # shuffled, as a mini-batch's rows
    old = torch.randn(shape, generator=g) * 0.1 - 2.0
    mask = seqs.response_mask[idx]
    algo = _algo(answer_weight=1.0, kl_coef=0.0, agg="token-mean")
    logprobs = (old[idx] + torch.randn((3, shape[1]), generator=g) * 0.05).requires_grad_()
    got, _ = step_loss(masked_batch, idx, logprobs, mask, algo, mask.sum(), old_logprobs=old)
    want, _ = grpo_loss(
        logprobs,
        old[idx],
        None,
        batch.advantages[idx],
        mask,
        batch.responses.answer_mask[idx],
        answer_weight=1.0,
        clip=algo.clip,
        kl_coef=0.0,
        agg="token-mean",
        num_tokens=mask.sum(),
        token_mask=token_mask[idx],
    )
    torch.testing.assert_close(got, want)
    unmasked, _ = step_loss(batch, idx, logprobs, mask, algo, mask.sum(), old_logprobs=old)
    assert not torch.isclose(got, unmasked)
    (grad,) = torch.autograd.grad(got, logprobs)
    assert token_mask[idx].any() and (grad[token_mask[idx]] == 0).all()
    trained = mask.bool() & ~token_mask[idx]
    assert (grad[trained] != 0).any()
