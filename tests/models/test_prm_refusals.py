"""A PRM that is not a PRM is refused before it scores anything (issue 37): a checkpoint
without the weights of the head `reward.prm.format` loads (transformers would initialise them
at random: every step scored by noise, and training went on to "run finished" on that random
reward), and a `good_label` past the head's labels. Tiny random checkpoints saved here."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from toy_models import tiny_qwen3_config
from transformers import Qwen3ForCausalLM, Qwen3ForTokenClassification

from omgrpo import cli
from omgrpo.config import PrmConfig
from omgrpo.errors import InputError
from omgrpo.models.prm import load_prm
from omgrpo.models.tokenizer import build_bpe_tokenizer
from omgrpo.models.toy import toy_corpus
from omgrpo.tasks.toy import ToyWorldSpec, generate_sft_problems


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """lm/: a plain causal language model (no classification head); cls/: a
    token-classification PRM with two labels; both with a fast tokenizer."""
    root = tmp_path_factory.mktemp("not-prms")
    torch.manual_seed(0)
    tok = build_bpe_tokenizer(toy_corpus(generate_sft_problems(50, seed=0, spec=ToyWorldSpec())))
    Qwen3ForCausalLM(
        tiny_qwen3_config(tok, num_layers=1, tie_word_embeddings=False)
    ).save_pretrained(root / "lm")
    tok.save_pretrained(root / "lm")
    Qwen3ForTokenClassification(tiny_qwen3_config(tok, num_layers=1, num_labels=2)).save_pretrained(
        root / "cls"
    )
    tok.save_pretrained(root / "cls")
    return root


def _load(path, **kw):
    cfg = OmegaConf.merge(OmegaConf.structured(PrmConfig), kw)
    return load_prm(path, cfg, torch.device("cpu"), torch.float32)


def test_a_language_model_given_as_a_classification_prm_is_refused(checkpoints):
    with pytest.raises(InputError) as err:
        _load(checkpoints / "lm", format="token_classification")
    message = str(err.value)
    assert str(checkpoints / "lm") in message and "reward.prm.path" in message
    assert "not a token_classification PRM" in message and "score.weight" in message


def test_a_classification_prm_given_as_a_causal_lm_is_refused(checkpoints):
    with pytest.raises(InputError, match=r"not a causal_lm PRM: the checkpoint has no lm_head"):
        _load(checkpoints / "cls", format="causal_lm", step_tag="\n")


def test_a_good_label_past_the_heads_labels_is_refused(checkpoints):
    with pytest.raises(
        InputError, match=r"reward\.prm\.good_label: the PRM.s head has 2 labels \(found 2"
    ):
        _load(checkpoints / "cls", format="token_classification", good_label=2)


def test_real_prms_still_load(checkpoints):
    assert _load(checkpoints / "cls", format="token_classification").settings.good_label == 1
    assert _load(checkpoints / "lm", format="causal_lm", good_token="a", bad_token="b")


def test_training_on_a_prm_that_is_not_one_is_refused_before_step_1(
    checkpoints, tmp_path, monkeypatch, capsys, tiny_overrides
):
    """`omgrpo train method=prm reward.prm.path=<a language model>` exits 2 naming the
    checkpoint and the missing head, before anything is written (checked on the meta device,
    no weight read); before, it trained to "run finished"."""
    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        *tiny_overrides,
        "method=prm",
        f"reward.prm.path={checkpoints / 'lm'}",
        "reward.prm.format=token_classification",
        "trainer.steps=2",
    ]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "not a token_classification PRM" in err and "score.weight" in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before Hydra wrote the run's folder
