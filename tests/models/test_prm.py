"""PRM checkpoints of both formats, built tiny and random here and loaded from disk as a user's
would be: step boundaries land on the step tags, batched scores equal a plain one-by-one loop."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from toy_models import tiny_qwen3_config
from transformers import Qwen3ForCausalLM, Qwen3ForTokenClassification

from omgrpo.config import PrmConfig
from omgrpo.core.process import split_steps
from omgrpo.models.prm import ProcessRewardModel, load_prm
from omgrpo.models.tokenizer import build_bpe_tokenizer
from omgrpo.models.toy import toy_corpus
from omgrpo.tasks.toy import ToyWorldSpec, generate_sft_problems

RESPONSES = [
    "7+5=12\n12*3=36\nSo the answer is \\boxed{36}.",
    "4-1=3\n\nSo the answer is \\boxed{3}.",
    "So the answer is \\boxed{1}.",
    "",  # no steps at all
    "9*2=18\n18+40=58\n58-7=51\n51*1=51\nSo the answer is \\boxed{51}.",
]
QUESTIONS = [f"Evaluate left to right: {i}+1" for i in range(len(RESPONSES))]


def _tokenizer():
    problems = generate_sft_problems(200, seed=0, spec=ToyWorldSpec())
    return build_bpe_tokenizer(toy_corpus(problems))


def _config(tok, **kw):
    return tiny_qwen3_config(tok, **kw)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A causal-LM PRM with a special step tag (as Qwen's `<extra_0>`) and a token-classification
    PRM reading the newline after each step, saved with save_pretrained."""
    root = tmp_path_factory.mktemp("prms")
    torch.manual_seed(0)
    tok = _tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<step>"]})
    causal = Qwen3ForCausalLM(_config(tok, tie_word_embeddings=False))
    causal.save_pretrained(root / "causal")
    tok.save_pretrained(root / "causal")
    tok = _tokenizer()
    classifier = Qwen3ForTokenClassification(_config(tok, num_labels=2))
    classifier.save_pretrained(root / "cls")
    tok.save_pretrained(root / "cls")
    return root


def _load(path, **kw) -> ProcessRewardModel:
    cfg = OmegaConf.merge(OmegaConf.structured(PrmConfig), kw)
    return load_prm(path, cfg, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def prms(checkpoints):
    return {
        "causal_lm": _load(checkpoints / "causal", format="causal_lm", step_tag="<step>"),
        "token_classification": _load(checkpoints / "cls", format="token_classification"),
    }


@pytest.mark.parametrize("fmt", ["causal_lm", "token_classification"])
def test_steps_are_scored_at_their_tags(prms, fmt):
    """Each score is read at the token holding the step tag, right after that step's text."""
    prm = prms[fmt]
    tag = prm.settings.step_tag
    tok = prm.tokenizer
    for question, response in zip(QUESTIONS, RESPONSES):
        steps = prm.steps(response)
        assert steps == [response[a:b] for a, b in split_steps(response)]
        ids, positions = prm.encode(question, steps)
        assert len(positions) == len(steps) and positions == sorted(set(positions))
        for step, pos in zip(steps, positions):
            upto = tok.decode(ids[: pos + 1], skip_special_tokens=False)
            assert upto.endswith(step + tag), (upto, step)
            assert question in upto  # the question precedes every step


def test_a_special_tag_is_its_own_token(prms):
    prm = prms["causal_lm"]
    ids, positions = prm.encode(QUESTIONS[0], prm.steps(RESPONSES[0]))
    tag_id = prm.tokenizer.convert_tokens_to_ids("<step>")
    assert [ids[p] for p in positions] == [tag_id] * 3


@pytest.mark.parametrize("fmt", ["causal_lm", "token_classification"])
@pytest.mark.slow
def test_batched_scores_equal_a_plain_loop(prms, fmt):
    """Right-padded batches give each response the scores of a batch of one, computed here from
    the model's logits with the format's own rule, written out."""
    prm = prms[fmt]
    scores = prm(QUESTIONS, RESPONSES)
    reference = []
    for question, response in zip(QUESTIONS, RESPONSES):
        ids, positions = prm.encode(question, prm.steps(response))
        with torch.no_grad():
            logits = prm.model(input_ids=torch.tensor([ids])).logits[0]
        row = []
        for pos in positions:
            if fmt == "causal_lm":
                good = prm.tokenizer.convert_tokens_to_ids("+")
                bad = prm.tokenizer.convert_tokens_to_ids("-")
                pair = logits[pos, [good, bad]]
                row.append(float(torch.exp(pair[0]) / torch.exp(pair).sum()))
            else:
                row.append(float(torch.softmax(logits[pos], -1)[1]))
        reference.append(row)
    assert [len(s) for s in scores] == [3, 2, 1, 0, 5]
    assert all(0 < x < 1 for s in scores for x in s)
    for got, want in zip(scores, reference):
        assert got == pytest.approx(want, abs=1e-6)
    one_by_one = [prm([q], [r])[0] for q, r in zip(QUESTIONS, RESPONSES)]
    assert scores == one_by_one


def test_the_prm_is_frozen(prms):
    for prm in prms.values():
        assert not prm.model.training
        assert not any(p.requires_grad for p in prm.model.parameters())


def test_the_budget_leaves_later_batches_unscored(prms):
    prm = prms["token_classification"]
    prm.batch_size, prm.budget_s = 2, 0.0
    try:
        assert prm(QUESTIONS, RESPONSES) == [None] * len(RESPONSES)
        prm.budget_s = math.inf
        assert all(s is not None for s in prm(QUESTIONS, RESPONSES))
    finally:
        prm.batch_size, prm.budget_s = 64, math.inf


def test_bad_settings_are_named(checkpoints):
    with pytest.raises(ValueError, match=r"reward\.prm\.format"):
        _load(checkpoints / "cls")
    with pytest.raises(ValueError, match="good_token"):
        _load(checkpoints / "causal", format="causal_lm", step_tag="<step>", good_token="+-+x")
