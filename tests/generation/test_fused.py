"""Fused projections for decoding (`omgrpo.generation.fused`) and the decode step built on them:
the fused matrices share the modules' storage, the model is unchanged for everything else, and
the fused step gives the HF forward's logits for each Llama-family variant it handles."""

import pytest
import torch
from toy_models import random_toy_model
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from omgrpo.generation import engine
from omgrpo.generation.engine import _HFKV, _LeanKV, prefix_tree_forward
from omgrpo.generation.fused import fuse_decoder, shared_rows


def test_fusing_moves_gate_and_up_into_one_tensor_that_the_modules_view():
    model, tok = random_toy_model(2, seed=0)
    ids = torch.tensor([tok("7+5=12", add_special_tokens=False)["input_ids"]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(ids).logits
        blocks = fuse_decoder(model)
        again = fuse_decoder(model)
        after = model(ids).logits
    assert blocks is not None and len(blocks) == 2
    mlp = model.model.layers[0].mlp
    gate_up = blocks[0].gate_up_weight
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    assert torch.equal(gate_up, torch.cat([gate.detach(), up.detach()]))
    assert gate.data_ptr() == gate_up.data_ptr()  # each module's weight views its rows
    assert up.data_ptr() == gate_up.data_ptr() + gate.numel() * gate.element_size()
    assert again[0].gate_up_weight.data_ptr() == gate_up.data_ptr()  # adjacent: no new copy
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(logits, after)


def test_the_qkv_copy_orders_each_kv_heads_queries_then_its_key():
    """4 query heads over 2 KV heads (g = 2), head dim 8: rows q0 q1 k0 q2 q3 k1 v0 v1."""
    model, _ = random_toy_model(1, seed=0, num_heads=4, num_kv_heads=2)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        block = fuse_decoder(model)[0]
    q, k, v = (m.weight.detach().view(-1, 8, 32) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    expected = torch.cat([q[0:2], k[0:1], q[2:4], k[1:2], v]).view(-1, 32)
    assert torch.equal(block.qkv_weight, expected) and block.qk_width == 6 * 8
    scale = block.qk_scale  # q_norm's weight times the scaling on queries, k_norm's on keys
    torch.testing.assert_close(scale[1, 0, 0], attn.q_norm.weight * attn.scaling)
    assert torch.equal(scale[0, 0, 2], attn.k_norm.weight.detach())


def test_a_fused_model_still_trains_and_its_weights_move_in_place():
    """An optimizer built before fusing keeps updating the same parameters, now views."""
    model, tok = random_toy_model(1, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.no_grad():
        gate_up = fuse_decoder(model)[0].gate_up_weight
    snapshot = gate_up.clone()
    ids = torch.tensor([tok("7+5=12", add_special_tokens=False)["input_ids"]])
    model(ids, labels=ids).loss.backward()
    opt.step()
    gate = model.model.layers[0].mlp.gate_proj.weight
    assert gate.grad is not None and not torch.equal(gate_up, snapshot)  # moved in place
    assert torch.equal(gate_up[: gate.shape[0]], gate.detach())


def test_the_decoder_is_not_fused_under_grad_or_with_adapter_layers():
    model, _ = random_toy_model(1, seed=0)
    assert fuse_decoder(model) is None  # grad enabled: the fused matrices carry no gradient

    class Adapter(torch.nn.Linear):  # stands in for peft's LoRA layer (a Linear subclass)
        pass

    attn = model.model.layers[0].self_attn
    adapter = Adapter(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    attn.q_proj = adapter
    with torch.no_grad():
        assert fuse_decoder(model) is None


def test_shared_rows_views_rows_already_adjacent():
    base = torch.arange(12.0).view(6, 2)
    a, b = torch.nn.Parameter(base[:2]), torch.nn.Parameter(base[2:])
    fused = shared_rows([a, b])
    assert fused.data_ptr() == base.data_ptr() and torch.equal(fused, base)


def _tiny(config_cls, **kw):
    config = config_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        **kw,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    "model_of",
    [
        pytest.param(lambda: _tiny(Qwen3Config), id="qwen3-qk-norm"),
        pytest.param(lambda: _tiny(LlamaConfig), id="llama"),
        pytest.param(lambda: _tiny(Qwen2Config), id="qwen2-qkv-bias"),
        pytest.param(lambda: random_toy_model(2, seed=0, num_heads=4, num_kv_heads=1)[0], id="toy"),
    ],
)
@pytest.mark.parametrize("fused", [True, False])
def test_the_decode_step_gives_the_hf_forwards_logits(model_of, fused, monkeypatch):
    """Fused (one product for q/k/v, one for gate/up, q_norm and k_norm as one) or on the
    modules (what LoRA layers get), a lean decode step gives HF's logits at every step, with
    prompts of different lengths sharing rows in groups of 3."""
    model = model_of()
    if not fused:
        monkeypatch.setattr(engine, "fuse_decoder", lambda m: None)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9)]
    feed = torch.randint(3, vocab, (len(prompts) * 3, 6), generator=g)
    logits = []
    with torch.no_grad():
        for backend in (_LeanKV, _HFKV):
            _, cache, mask, pos = prefix_tree_forward(model, prompts, [[0, 0]], 0)
            kv = backend(model, cache, mask, pos, 3, feed.shape[1])
            if backend is _LeanKV:
                assert (kv.blocks is not None) == fused
            logits.append(torch.stack([kv.step(feed[:, s]) for s in range(feed.shape[1])], 1))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_the_rotation_basis_gives_the_rotation_matrices_exactly():
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)
    basis = engine.rotation_basis(8, torch.float32, torch.device("cpu"))
    got = (torch.cat([cos, sin], -1) @ basis).view(3, 8, 8)
    assert torch.equal(got, engine.rotation_matrices(cos, sin))
