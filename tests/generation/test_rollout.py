"""The sampler and `response_logprobs` against plain references: HF greedy generate, and
log-probs of unpadded rows."""

import pytest
import torch
from omegaconf import OmegaConf

from omgrpo.generation.rollout import hf_checkpointing, response_logprobs, sample
from omgrpo.models.tokenizer import build_char_tokenizer
from omgrpo.models.toy import build_toy_model


def _model():
    tok = build_char_tokenizer()
    cfg = OmegaConf.create(dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1))
    return build_toy_model(cfg, tok, seed=0).eval(), tok


def _prompts(tok):
    texts = ["Evaluate left to right: 7+5", "Hi", "Evaluate: 12*3-4+1"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _sample(model, tok, prompts, *, n: int, max_new_tokens: int, temperature: float):
    """`n` responses per prompt, without a nucleus cut, stopping at the tokenizer's EOS."""
    return sample(
        model,
        prompts,
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
    )


def _two_samples_each(model, tok, prompts):
    """Two sampled responses (10 tokens at most) per prompt, from seed 0."""
    torch.manual_seed(0)
    return _sample(model, tok, prompts, n=2, max_new_tokens=10, temperature=1.0)


@pytest.mark.slow
def test_greedy_sampling_matches_hf_generate_on_each_prompt_alone():
    model, tok = _model()
    prompts = _prompts(tok)
    batch = _sample(model, tok, prompts, n=1, max_new_tokens=12, temperature=0.0)
    for i, p in enumerate(prompts):
        ref = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, len(p) :]
        n = int(batch.response_mask[i].sum())
        assert batch.response_ids[i, :n].tolist() == ref[:n].tolist()


@pytest.mark.slow
def test_logprobs_do_not_depend_on_batch_padding():
    model, tok = _model()
    prompts = _prompts(tok)
    batch = _two_samples_each(model, tok, prompts)
    together = response_logprobs(model, batch, with_stats=True)
    for i in range(len(batch)):
        alone = response_logprobs(model, batch.select(slice(i, i + 1)))
        n = int(batch.response_mask[i].sum())
        # alone: no left padding beyond this prompt's own width
        torch.testing.assert_close(
            together["logprobs"][i, :n], alone["logprobs"][0, :n], atol=1e-5, rtol=1e-5
        )
    assert (together["entropy"] >= 0).all()
    assert (together["self_certainty"] >= -1e-5).all()  # KL(U || p) >= 0


@pytest.mark.slow
def test_sampling_is_reproducible_from_the_rng_state_and_chunking_is_transparent():
    model, tok = _model()
    prompts = _prompts(tok)
    kwargs = dict(
        n=3,
        max_new_tokens=8,
        temperature=1.0,
        top_p=0.9,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
    )
    torch.manual_seed(1)
    a = sample(model, prompts, **kwargs)
    torch.manual_seed(1)
    b = sample(model, prompts, **kwargs)
    assert torch.equal(a.response_ids, b.response_ids)
    greedy = dict(kwargs, temperature=0.0)
    whole = sample(model, prompts, **greedy)
    chunked = sample(model, prompts, batch_size=2, **greedy)
    for i in range(len(whole)):
        n = int(whole.response_mask[i].sum())
        assert whole.response_ids[i, :n].tolist() == chunked.response_ids[i, :n].tolist()


@pytest.mark.slow
def test_shared_prefix_forward_equals_the_plain_forward_with_gradients():
    model, tok = _model()
    system = tok(
        "<|im_start|>system\nLet's think step by step.<|im_end|>\n", add_special_tokens=False
    )["input_ids"]
    prompts = [system + p for p in _prompts(tok)]
    batch = _two_samples_each(model, tok, prompts)
    from omgrpo.generation.rollout import response_logits

    mask = batch.response_mask.bool()
    fast = response_logits(model, batch, share_prefix=True)
    fast[mask].logsumexp(-1).sum().backward()
    fast_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = response_logits(model, batch, share_prefix=False)
    plain[mask].logsumexp(-1).sum().backward()
    torch.testing.assert_close(fast[mask], plain[mask], atol=1e-5, rtol=1e-5)
    for a, p in zip(fast_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-4, rtol=1e-4)


def test_any_of_several_stop_tokens_ends_a_response():
    model, tok = _model()
    prompts = _prompts(tok)[:1]
    kwargs = dict(n=1, max_new_tokens=10, temperature=0.0, top_p=1.0, pad_id=tok.pad_token_id)
    free = sample(model, prompts, eos_id=tok.pad_token_id, **kwargs).response_ids[0].tolist()
    stop = free[3]
    cut = free.index(stop)
    out = sample(model, prompts, eos_id=[tok.eos_token_id, stop], **kwargs)
    assert int(out.response_mask[0].sum()) == cut + 1  # the stop token itself is kept
    assert out.response_ids[0, : cut + 1].tolist() == free[: cut + 1]


def _tiny_hf(kind: str):
    """A tiny random Llama or Qwen3 (fp32) in train mode (dropout is 0: deterministic)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    return model_cls(config_cls(**shape)).train()


def _ragged_batch():
    """Rows of 2 prompts (a shared prefix, different lengths) with responses of 1 to 5 tokens."""
    from omgrpo.generation.engine import left_pad, right_pad
    from omgrpo.generation.rollout import Sequences

    prompts = [[3, 4, 5, 6, 7], [3, 4, 9]] * 2
    responses = [[10, 11, 12], [13], [14, 15, 16, 17, 18], [19, 20]]
    return Sequences(*left_pad(prompts, 0), *right_pad(responses, 0))


def _update_grads(model, seqs):
    """The update's loss shape through `response_logits` as `ppo_update` calls it: the
    gradients of the token log-probs (weighted per row) and the call count of layer 0's MLP."""
    from omgrpo.core.losses import token_logprobs_and_entropy
    from omgrpo.generation.rollout import response_logits

    calls = []
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    model.zero_grad(set_to_none=True)
    logits = response_logits(model, seqs)
    logprobs, _ = token_logprobs_and_entropy(logits.float(), seqs.response_ids)
    weights = torch.tensor([1.0, -0.5, 2.0, 0.25])[:, None]
    (logprobs * weights * seqs.response_mask).sum().backward()
    hook.remove()
    return [p.grad.clone() for p in model.parameters()], logprobs.detach(), len(calls)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_gradient_checkpointing_gives_the_update_the_same_gradients(kind):
    model, seqs = _tiny_hf(kind), _ragged_batch()
    plain_grads, plain_logprobs, _ = _update_grads(model, seqs)
    model.gradient_checkpointing_enable()
    assert hf_checkpointing(model)
    grads, logprobs, calls = _update_grads(model, seqs)
    assert calls == 2  # one forward of the batch, and layer 0 recomputed in backward
    mask = seqs.response_mask.bool()
    torch.testing.assert_close(logprobs[mask], plain_logprobs[mask], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # the no-grad pass (old log-probs) in train mode with checkpointing on: same values
    old = response_logprobs(model, seqs, micro_batch_size=3)["logprobs"]
    torch.testing.assert_close(old[mask], plain_logprobs[mask], atol=1e-5, rtol=1e-5)
