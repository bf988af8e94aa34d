"""LoRA on the native trainer (`model.lora.*`, omgrpo/models/lora.py): the settings are checked
naming the key; the policy stays the Hugging Face model the engine drives, with peft's LoRA
layers in place; the reference is that model with the adapters off (the base, bit for bit, no
second copy); the answer mask gives answer tokens exactly zero gradient; a run's checkpoints
hold only the adapters and resume bit for bit; `omgrpo export` merges them into a plain
Hugging Face directory with the trainer's log-probs."""

from __future__ import annotations

import copy
import json

import numpy as np
import pandas as pd
import pytest
import torch
from toy_models import random_toy_model
from toy_runs import train_tiny_run

from omgrpo.backends.native import update as update_module
from omgrpo.backends.native.run import check_config
from omgrpo.backends.native.update import ppo_update
from omgrpo.config import compose
from omgrpo.core.losses import group_advantages
from omgrpo.core.rewards import make_group
from omgrpo.core.step import StepBatch, decode_responses
from omgrpo.core.task import Problem
from omgrpo.generation.engine import lean_decoding_supported
from omgrpo.generation.rollout import (
    Sequences,
    left_pad,
    response_logits,
    response_logprobs,
    right_pad,
)
from omgrpo.models.lora import adapters_off, apply_lora, trainable_parameters
from omgrpo.tasks.prompts import PromptEncoder
from omgrpo.tasks.toy import ToyProbe
from omgrpo.tracking.store import RunStore

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: far faster for these tiny models on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.rank=-1", r"model\.lora\.rank must be an integer >= 0"),
        ("model.lora.alpha=0", r"model\.lora\.alpha must be a number > 0"),
        ("model.lora.alpha=-2.5", r"model\.lora\.alpha must be a number > 0"),
        ("model.lora.dropout=1", r"model\.lora\.dropout must be >= 0 and < 1"),
        ("model.lora.dropout=-0.1", r"model\.lora\.dropout must be >= 0 and < 1"),
        ("model.lora.target_modules=[]", r"model\.lora\.target_modules must be a non-empty"),
        ("model.lora.target_modules=['']", r"model\.lora\.target_modules must be a non-empty"),
    ],
)
def test_bad_lora_settings_fail_fast_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        check_config(compose([override]))


def test_lora_is_off_by_default_and_its_defaults_are_every_block_linear():
    lora = compose([]).model.lora
    assert lora.rank == 0 and lora.alpha > 0 and lora.dropout == 0
    assert list(lora.target_modules) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    check_config(compose(LORA))  # valid
    with pytest.raises(Exception, match=r"model\.lora\.rank"):  # OmegaConf's type check
        compose(["model.lora.rank=1.5"])


def test_unknown_target_modules_are_named():
    model, _ = random_toy_model(num_layers=1, seed=0)
    lora = compose([*LORA, "model.lora.target_modules=[qkv]"]).model.lora
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules=\['qkv'\].*q_proj"):
        apply_lora(model, lora, seed=0)


def _lora_toy(seed: int = 0):
    """A random toy Qwen3 (2 layers), a frozen copy of it, and its LoRA wrapper with B made
    non-zero (so that the adapters change what the model computes)."""
    model, tok = random_toy_model(num_layers=2, seed=seed)
    base = copy.deepcopy(model).requires_grad_(False)
    peft_model = apply_lora(model, compose(LORA).model.lora, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model, base, peft_model, tok


RESPONSES = [  # two groups of three, every rollout boxes an answer
    ["7+5=12\nSo the answer is \\boxed{12}.", "7+5=13\nSo \\boxed{13}.", "7+5=12\n\\boxed{1}."],
    ["2*3=6\nSo the answer is \\boxed{6}.", "2*3=5\n\\boxed{5}.", "2*3=6\n\\boxed{6}."],
]


def _step(tok):
    """Sequences and a scored StepBatch of RESPONSES (spread rewards in both groups)."""
    problems = [
        Problem("p0", "Evaluate left to right: 7+5", "12"),
        Problem("p1", "Evaluate left to right: 2*3", "6"),
    ]
    encode = PromptEncoder(tok, 512)
    prompts = [encode(p) for p, group in zip(problems, RESPONSES) for _ in group]
    eos = tok.eos_token_id
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for g in RESPONSES for t in g]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_token_id)
    response_ids, response_mask = right_pad(ids, tok.pad_token_id)
    seqs = Sequences(prompt_ids, prompt_mask, response_ids, response_mask)
    responses = decode_responses(tok, response_ids, response_mask, ToyProbe("1"), "boxed")
    rewards = np.array([1.0, 0.5, 0.0, 1.0, 0.0, 0.5])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    batch = StepBatch(
        prompts=problems,
        group_ids=group_ids,
        responses=responses,
        answers=responses.answers,
        correct=[None] * 6,
        groups=[make_group(responses.answers[3 * g : 3 * g + 3]) for g in range(2)],
        reward_parts={"soft_vote": rewards},
        rewards=rewards,
        advantages=group_advantages(torch.tensor(rewards, dtype=torch.float32), group_ids),
    )
    return seqs, batch


@torch.no_grad()
def test_the_policy_is_the_hf_model_and_its_reference_is_the_base_without_a_copy():
    model, base, peft_model, tok = _lora_toy()
    # peft changed the model in place: the engine drives the HF model, not the wrapper
    assert peft_model.get_base_model() is model and lean_decoding_supported(model)
    trainable = trainable_parameters(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in names)
    assert len(names) == 2 * 7 * 2  # A and B of 7 modules in 2 layers
    seqs, _ = _step(tok)
    # the engine's lean scorer (prompts once per group, the blocks' modules called one by one)
    # computes what the plain forward of the LoRA model computes
    lean = response_logits(model, seqs)
    plain = response_logits(model, seqs, share_prefix=False)
    resp = seqs.response_mask.bool()
    torch.testing.assert_close(lean[resp], plain[resp], atol=1e-5, rtol=1e-5)
    with_adapters = response_logprobs(model, seqs)["logprobs"]
    frozen = response_logprobs(base, seqs)["logprobs"]
    assert not torch.equal(with_adapters, frozen)  # the adapters matter
    with adapters_off(peft_model) as reference:
        # the same module and weights as the policy, computing the base bit for bit
        assert reference is model
        assert torch.equal(response_logprobs(reference, seqs)["logprobs"], frozen)
    assert torch.equal(response_logprobs(model, seqs)["logprobs"], with_adapters)  # back on


@torch.no_grad()
def test_the_engines_decoder_runs_the_adapters():
    """Greedy rollouts of the LoRA policy through the engine's decoder (lean on this Qwen3, a
    K/V cache, prompts shared by their rows) are the tokens of a plain full-forward greedy
    loop of the same model, and not the base's: a decoder that read the base layers' weights
    beside the LoRA modules (a fused projection, say) would decode the base instead."""
    from omgrpo.generation.rollout import sample

    model, base, peft_model, tok = _lora_toy(seed=2)
    prompts = [tok("Evaluate left to right: 7+5", add_special_tokens=False)["input_ids"]]
    prompts.append(tok("Q: 2*3", add_special_tokens=False)["input_ids"])
    new = 12
    kw = dict(n=2, max_new_tokens=new, temperature=0.0, top_p=1.0, eos_id=[-1], pad_id=0)

    def plain_greedy(m):
        rows = []
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(new):
                ids = torch.cat([ids, m(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            rows += [ids[0, len(p) :].tolist()] * 2
        return rows

    model.eval()
    decoded = sample(model, prompts, **kw).response_ids.tolist()
    expected, of_base = plain_greedy(model), plain_greedy(base)
    assert expected != of_base  # the adapters change the greedy tokens here
    assert decoded == expected
    with adapters_off(peft_model) as reference:
        assert sample(reference, prompts, **kw).response_ids.tolist() == of_base
    del peft_model


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_answer_tokens_get_exactly_zero_gradient_under_lora(monkeypatch, kl_coef):
    """OM-GRPO's mask (w = 0, the KL term masked too) through the trainer's update on a LoRA
    policy: d loss / d log-prob is exactly zero on every answer-span token and non-zero on
    reasoning tokens; only the adapters move, the base weights keep their bits."""
    model, base, peft_model, tok = _lora_toy(seed=1)
    seqs, batch = _step(tok)
    answer = batch.responses.answer_mask.bool() & seqs.response_mask.bool()
    reasoning = seqs.response_mask.bool() & ~answer
    assert answer.any(dim=1).all()  # every rollout has an answer span
    ref_logprobs = None
    if kl_coef:
        with torch.no_grad(), adapters_off(peft_model) as reference:
            ref_logprobs = response_logprobs(reference, seqs)["logprobs"]
    grads = []
    real = update_module.step_loss

    def capturing(batch, idx, logprobs, *args, **kwargs):
        logprobs.register_hook(lambda g: grads.append((idx, g.detach().clone())))
        return real(batch, idx, logprobs, *args, **kwargs)

    monkeypatch.setattr(update_module, "step_loss", capturing)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    algo = compose(["algorithm.micro_batch_size=4", f"algorithm.kl_coef={kl_coef}"]).algorithm
    assert algo.answer_weight == 0 and algo.answer_kl_weight is None
    model.train()
    out = ppo_update(model, optimizer, seqs, None, ref_logprobs, batch, algo, grad_clip=1.0)
    assert not out["skipped"] and out["grad/norm"] > 0
    assert len(grads) == 2  # micro-batches of 4 and 2 rows
    grad = torch.zeros(seqs.response_ids.shape)
    for idx, g in grads:
        grad[idx, : g.shape[1]] = g
    assert torch.equal(grad[answer], torch.zeros_like(grad[answer]))
    assert (grad[reasoning] != 0).sum() > reasoning.sum() // 2
    for name, p in model.named_parameters():
        if name in frozen:
            assert p.grad is None and torch.equal(p.detach(), frozen[name]), name
    moved = [n for n, p in model.named_parameters() if n in adapters and p.grad is not None]
    assert len(moved) == len(adapters)
    assert all(not torch.equal(dict(model.named_parameters())[n], adapters[n]) for n in moved)
    del base


VOLATILE = ("time/", "mem/", "perf/")
SPREAD = "reward.parts=[soft_vote,format,self_certainty]"  # every group has reward spread


def _metrics(run_dir):
    df = RunStore(run_dir).read_metrics()
    return df[[c for c in df.columns if not c.startswith(VOLATILE)]]


@pytest.mark.slow
def test_a_lora_run_resumes_bit_exactly_from_adapter_only_checkpoints(tiny_overrides):
    from omgrpo.backends.native.checkpoint import STATE_FILE, verify_checkpoint
    from omgrpo.backends.native.trainer import train

    common = [*tiny_overrides, *LORA, "trainer.steps=4", "trainer.save_every=2", SPREAD]
    full = train(compose([*common, "run.name=full"]))
    killed = train(compose([*common, "run.name=killed"]), stop_after=3)
    assert RunStore(killed).latest_checkpoint().name == "step_000002"
    resumed = train(compose([*common, "run.name=killed", "run.resume=true"]))
    a, b = _metrics(full), _metrics(resumed)
    assert list(a["train/step"]) == [0, 1, 2, 3, 4]
    assert (a["grad/norm"].dropna() > 0).all() and a["grad/norm"].count() == 4  # it trained
    # the KL term's reference is the base: zero before the adapters first move, then not
    assert a["kl/reasoning"].iloc[1] == 0 and (a["kl/reasoning"].iloc[2:] > 0).all()
    pd.testing.assert_frame_equal(a, b)

    checkpoint = RunStore(full).latest_checkpoint()
    verify_checkpoint(checkpoint)  # the same sha256 manifest as every checkpoint
    state = torch.load(checkpoint / STATE_FILE, weights_only=False)
    assert "model" not in state and state["base_dtype"] == "float32"
    assert set(state) >= {"adapters", "optimizer", "scheduler", "rng", "loop", "step", "config"}
    adapters = state["adapters"]
    assert len(adapters) == 2 * 7 and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    assert len(state["optimizer"]["state"]) == len(adapters)  # AdamW over the adapters only
    assert all(v.dtype == torch.float32 for v in adapters.values())


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base_cache):
    return train_tiny_run(tmp_path_factory.mktemp("lora-export-runs"), base_cache, tuple(LORA))


@pytest.mark.slow
def test_lora_export_merges_the_adapters_into_a_plain_hf_directory(lora_run, tmp_path):
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from omgrpo.backends.native.checkpoint import restore_weights
    from omgrpo.backends.native.export import run_base_dir
    from omgrpo.cli import main
    from omgrpo.generation.rollout import sample, stop_token_ids
    from omgrpo.models.loading import load_model, load_tokenizer
    from omgrpo.tasks.registry import TASKS

    out = tmp_path / "hf"
    assert main(["export", str(lora_run), str(out)]) == 0
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "omgrpo_export.json"} <= files
    assert not any(name.startswith("adapter_") for name in files)  # no peft files
    meta = json.loads((out / "omgrpo_export.json").read_text())
    assert meta["step"] == 3 and meta["dtype"] == "float32"
    assert meta["config"]["model"]["lora"]["rank"] == 4

    # the policy as the trainer holds it at step 3: base + adapters (what a resume loads)
    config = RunStore(lora_run).read_config()
    cfg = OmegaConf.create(config)
    base = run_base_dir(config)
    policy = load_model(base, torch.device("cpu"), torch.float32)
    peft_model = apply_lora(policy, cfg.model.lora, seed=123)
    state = torch.load(RunStore(lora_run).checkpoint_dir(3) / "state.pt", weights_only=False)
    restore_weights(state, policy, peft_model)
    policy.eval()

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in n for n, _ in hf.named_parameters())
    tokenizer = load_tokenizer(base)
    problems = TASKS["toy"](cfg.task).test[:3]
    prompts = [PromptEncoder(tokenizer, 512)(p) for p in problems]
    seqs = sample(
        policy,
        prompts,
        n=2,
        max_new_tokens=16,
        temperature=1.0,
        top_p=1.0,
        eos_id=stop_token_ids(tokenizer, policy),
        pad_id=tokenizer.pad_token_id,
        seed=0,
    )
    resp = seqs.response_mask.bool()
    ours = response_logprobs(policy, seqs)["logprobs"]
    theirs = response_logprobs(hf, seqs)["logprobs"]
    # W x + (alpha / r) B (A x) against (W + (alpha / r) B A) x in fp32: round-off apart
    # (4.8e-7 at most here), not bit-identical as a full fine-tuning export is
    torch.testing.assert_close(theirs[resp], ours[resp], atol=1e-5, rtol=1e-5)
    # and that is step 3's policy, not the base: the adapters trained, only targeted weights moved
    base_model = AutoModelForCausalLM.from_pretrained(meta["base_model"]).eval()
    assert not torch.allclose(response_logprobs(base_model, seqs)["logprobs"][resp], ours[resp])
    trained, frozen = hf.state_dict(), base_model.state_dict()
    moved = {k for k in trained if not torch.equal(trained[k], frozen[k])}
    assert moved and all(k.rsplit(".", 2)[-2].endswith("_proj") for k in moved)

    # `omgrpo eval --backend native` loads the run's checkpoint merged the same way
    from omgrpo.eval.checkpoints import choose_checkpoint
    from omgrpo.eval.runner import load_policy, resolve_target

    target = resolve_target(lora_run)
    evaluated, _, _ = load_policy(target, choose_checkpoint(lora_run, "last", config), "cpu")
    assert not any("lora" in n for n, _ in evaluated.named_parameters())
    assert all(p.requires_grad for p in evaluated.parameters())  # as from_pretrained gives it
    assert torch.equal(response_logprobs(evaluated, seqs)["logprobs"][resp], theirs[resp])
