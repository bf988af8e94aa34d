"""The gradient probe and the shuffled-advantage null control (the collapse study's diagnostics)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omgrpo.backends.native.probes import gradient_probe
from omgrpo.backends.native.update import shuffled_advantages
from omgrpo.config import compose
from omgrpo.core.losses import token_logprobs_and_entropy
from omgrpo.core.step import score_step
from omgrpo.generation.rollout import Sequences, response_logits
from omgrpo.models.tokenizer import build_char_tokenizer
from omgrpo.models.toy import build_toy_model
from omgrpo.tasks import Problem

TEXTS = ["1+1=2\n\\boxed{2}", "1+1=3\n\\boxed{1}", "\\boxed{7}", "2+2=4\n\\boxed{4}"]


def _setup():
    tok = build_char_tokenizer()
    model = build_toy_model(
        SimpleNamespace(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), tok, seed=0
    )
    rows = [torch.tensor(tok.encode(t, add_special_tokens=False)) for t in TEXTS]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=tok.pad_token_id)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    prompt = torch.tensor(tok.encode("Q: 1+1", add_special_tokens=False)).repeat(len(TEXTS), 1)
    seqs = Sequences(prompt, torch.ones_like(prompt), ids, mask)
    problems = [
        Problem(id="a", question="1+1", answer="2"),
        Problem(id="b", question="2+2", answer="4"),
    ]
    batch = score_step(tok, ids, mask, problems, compose(["method=mv"]))
    return model, seqs, batch


@pytest.mark.slow
def test_probe_parts_sum_to_the_unmasked_policy_gradient():
    model, seqs, batch = _setup()
    probe = gradient_probe(model, seqs, batch)
    # reference: one backward of the unmasked PG loss; the parts add up to it (linearity)
    model.zero_grad()
    logprobs, _ = token_logprobs_and_entropy(
        response_logits(model, seqs).float(), seqs.response_ids
    )
    resp = seqs.response_mask.bool()
    (-(batch.advantages.unsqueeze(1) * logprobs * resp).sum() / resp.sum()).backward()
    full = torch.cat([p.grad.flatten() for p in model.parameters()])
    a, r, cos = (
        probe["grad/answer_norm"],
        probe["grad/reasoning_norm"],
        probe["grad/answer_reasoning_cos"],
    )
    assert a > 0 and r > 0
    # |a + r|^2 = |a|^2 + |r|^2 + 2 |a| |r| cos
    expected = (a * a + r * r + 2 * a * r * cos) ** 0.5
    assert abs(float(full.norm()) - expected) < 1e-4 * max(1.0, expected)


@pytest.mark.slow
def test_probe_without_answers_has_no_answer_gradient():
    model, seqs, batch = _setup()
    batch.responses.answer_mask.zero_()
    assert gradient_probe(model, seqs, batch)["grad/answer_norm"] == 0.0


def test_shuffled_advantages_permute_within_groups():
    _, _, batch = _setup()
    batch.advantages = torch.tensor([1.0, -1.0, 3.0, -3.0])
    seen = set()
    # seeds until all 4 permutations occurred (20 fixed seeds miss one with probability 1.3 %,
    # which torch's randperm decides; 200 seeds miss one with probability 4e-25)
    for seed in range(200):
        out = shuffled_advantages(batch, torch.Generator().manual_seed(seed))
        assert sorted(out.advantages[:2].tolist()) == [-1.0, 1.0]
        assert sorted(out.advantages[2:].tolist()) == [-3.0, 3.0]
        seen.add(tuple(out.advantages.tolist()))
        if len(seen) == 4 and seed >= 19:
            break
    assert len(seen) == 4  # every within-group permutation occurs
    assert batch.advantages.tolist() == [1.0, -1.0, 3.0, -3.0]  # the input is untouched
