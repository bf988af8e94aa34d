"""The generation engine: the lean Llama-family decoder against the HF forward it replaces, and
the prefix tree's scoring layout against the plain forward."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_models import random_toy_model

from omgrpo.generation import engine
from omgrpo.generation.engine import (
    _HFKV,
    _LeanKV,
    decode,
    lean_decoding_supported,
    prefix_tree_forward,
    shared_prompt_logits,
)

SYSTEM = "<|im_start|>system\nThink step by step.<|im_end|>\n"
QUESTIONS = ["Evaluate left to right: 7+5", "Hi", "Evaluate: 12*3-4+1"]


def _model(num_heads=4, num_kv_heads=2):
    return random_toy_model(2, seed=0, num_heads=num_heads, num_kv_heads=num_kv_heads)


def _prompts(tok):
    return [tok(SYSTEM + q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


@pytest.mark.parametrize(("heads", "kv_heads", "group"), [(4, 2, 3), (2, 2, 1), (4, 1, 2)])
@pytest.mark.slow
def test_lean_decoder_gives_the_hf_forwards_logits_at_every_step(heads, kv_heads, group):
    model, tok = _model(heads, kv_heads)
    assert lean_decoding_supported(model)
    prompts = _prompts(tok)
    feed = torch.randint(4, len(tok), (len(prompts) * group, 6), generator=torch.Generator())
    with torch.no_grad():
        logits = []
        for backend in (_LeanKV, _HFKV):
            _, cache, mask, pos = prefix_tree_forward(model, prompts, [[0] * 3], tok.pad_token_id)
            kv = backend(model, cache, mask, pos, group, feed.shape[1])
            logits.append(torch.stack([kv.step(feed[:, s]) for s in range(feed.shape[1])], 1))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bucket", [1, 4, 16])
def test_bucketed_attention_widths_give_the_exact_widths_logits(bucket):
    """Under CUDA graphs each step attends over a width rounded up to a bucket, the unwritten
    slots of the preallocated cache hidden by a bias made on the device: the same logits as
    attending over exactly the tokens so far (bucket 16 > the 6 tokens: one static width)."""
    model, tok = _model()
    prompts = _prompts(tok)
    feed = torch.randint(4, len(tok), (len(prompts) * 2, 6), generator=torch.Generator())
    with torch.no_grad():
        logits = []
        for width_bucket in (None, bucket):
            _, cache, mask, pos = prefix_tree_forward(model, prompts, [[0] * 3], tok.pad_token_id)
            kv = _LeanKV(model, cache, mask, pos, 2, 8, width_bucket)
            logits.append(torch.stack([kv.step(feed[:, s]) for s in range(feed.shape[1])], 1))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-6, rtol=1e-6)


def test_sample_categorical_flags_bad_weights_on_the_device_when_asked():
    """With `log_mass` the check is a sum on the device: finite exactly while every row's
    weights were a distribution."""
    log_mass = torch.zeros(1)
    probs = torch.tensor([[0.5, 0.5], [0.2, 0.8]])
    engine.sample_categorical(probs, torch.tensor([0.1, 0.9]), log_mass)
    assert log_mass.isfinite().item()
    for bad in ([[0.5, float("nan")]], [[0.5, float("inf")]], [[0.0, 0.0]]):
        log_mass = torch.zeros(1)
        engine.sample_categorical(torch.tensor(bad), torch.tensor([0.3]), log_mass)
        assert not log_mass.isfinite().item(), bad


def _greedy(model, tok, prompts, group, max_new_tokens, stop):
    """Greedy decoding of `group` rows per prompt on top of a one-level prefill."""
    with torch.no_grad():
        logits, cache, mask, pos = prefix_tree_forward(
            model, prompts, [[0] * len(prompts)], tok.pad_token_id
        )
        return decode(
            model,
            logits[:, -1],
            cache,
            mask,
            pos,
            group=group,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            top_p=1.0,
            stop=stop,
            pad_id=tok.pad_token_id,
        )


@pytest.mark.slow
def test_lean_and_hf_decoding_give_the_same_greedy_tokens(monkeypatch):
    model, tok = _model()
    prompts = _prompts(tok)
    # The stop token is the one prompt 0's rows decode 4th when nothing stops them, and only
    # those rows stop at it: they stop early (at its first occurrence), the others run on, by
    # construction. (A fixed stop token, "7", left every row running to the end for most
    # random models: whether a random model ever decodes it is luck.)
    free, _ = _greedy(model, tok, prompts, 2, 12, stop=lambda rows, toks: toks < 0)
    target = int(free[0, 3])
    outputs = []
    for lean in (True, False):
        monkeypatch.setattr(engine, "lean_decoding_supported", lambda m, lean=lean: lean)
        outputs.append(
            _greedy(
                model, tok, prompts, 2, 12, stop=lambda rows, toks: (rows < 2) & (toks == target)
            )
        )
    (lean_tokens, lean_len), (hf_tokens, hf_len) = outputs
    assert torch.equal(lean_tokens, hf_tokens) and torch.equal(lean_len, hf_len)
    assert lean_len[:2].max() <= 4 and (lean_len[2:] == 12).all()  # stopped early, ran on
    for row, n in zip(lean_tokens, lean_len):
        assert (row[n:] == tok.pad_token_id).all()


def _shared_prompt_tree(model, prompts, tail_ids, tail_mask):
    levels = [[0] * len(prompts), [tuple(p) for p in prompts]]
    logits, *_ = prefix_tree_forward(model, prompts, levels, 0, (tail_ids, tail_mask), 4)
    return logits[:, :-1]


def _shared_prompt_lean(model, prompts, tail_ids, tail_mask):
    return shared_prompt_logits(model, prompts, tail_ids, tail_mask, 0, chunks=3)


@pytest.mark.parametrize("scorer", [_shared_prompt_tree, _shared_prompt_lean])
@pytest.mark.slow
def test_prompt_shared_scoring_equals_the_plain_forward_with_gradients(scorer):
    model, tok = _model()
    p = _prompts(tok)
    # rows out of order, groups of 3, 2 and 1, prompts and responses of different lengths
    prompts = [p[0], p[1], p[0], p[2], p[0], p[1]]
    tails = [[5, 6, 7], [8], [9, 10], [11, 12, 13], [14], [15, 16]]
    tail_ids = torch.zeros(6, 3, dtype=torch.long)
    tail_mask = torch.zeros(6, 3, dtype=torch.long)
    for i, t in enumerate(tails):
        tail_ids[i, : len(t)], tail_mask[i, : len(t)] = torch.tensor(t), 1
    shared = scorer(model, prompts, tail_ids, tail_mask)
    logprobs = shared.log_softmax(-1).gather(-1, tail_ids[..., None])[..., 0]
    (logprobs * tail_mask).sum().backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for i, (p, t) in enumerate(zip(prompts, tails)):  # each row alone, unpadded
        alone = model(input_ids=torch.tensor([p + t])).logits[0, -len(t) - 1 : -1]
        torch.testing.assert_close(shared[i, : len(t)], alone, atol=1e-5, rtol=1e-5)
        alone.log_softmax(-1).gather(-1, torch.tensor(t)[:, None]).sum().backward()
    for a, p in zip(shared_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_sample_categorical_draws_each_token_at_its_probability():
    torch.manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 2.0]])
    draws = torch.stack([engine.sample_categorical(probs) for _ in range(20_000)])
    for row, weights in enumerate(probs):
        freq = torch.bincount(draws[:, row], minlength=4).double() / len(draws)
        expected = (weights / weights.sum()).double()
        # 20k draws: a frequency's standard error is <= 0.0036; 5 of them is far in the tail
        assert torch.allclose(freq, expected, atol=0.018), (row, freq, expected)
        assert (freq[expected == 0] == 0).all()  # zero weight: never drawn


def test_sample_categorical_at_the_top_of_the_cdf_draws_the_last_possible_token(monkeypatch):
    # u == total can happen by round-off: the token is then the last of positive weight,
    # never a zero-weight one after it (e.g. one removed by top-p)
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, **kw))
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.2, 0.0, 0.3, 0.5]])
    assert engine.sample_categorical(probs).tolist() == [1, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_top_uniform_never_falls_off_the_cdf_or_onto_a_zero_weight(dtype):
    """`UNIFORM_TOP` times any total rounds below the total: with the largest uniform, 10,000
    random rows (totals from 1e-30 to 1e30, a zero-weight tail as top-p leaves) each draw a
    token of positive weight."""
    g = torch.Generator().manual_seed(0)
    probs = torch.rand((10_000, 7), generator=g, dtype=dtype)
    probs *= 10.0 ** torch.randint(-30, 31, (10_000, 1), generator=g).to(dtype)
    probs[:, 5:] = 0.0
    top = torch.full((10_000,), engine.UNIFORM_TOP, dtype=dtype)
    tok = engine.sample_categorical(probs, top)
    assert (tok <= 4).all() and (probs[torch.arange(10_000), tok] > 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sample_categorical_rejects_weights_that_are_not_a_distribution(bad):
    with pytest.raises(ValueError, match="finite"):
        engine.sample_categorical(torch.tensor([[0.5, bad]]))
    with pytest.raises(ValueError, match="not all zero"):
        engine.sample_categorical(torch.zeros(1, 3))


@settings(max_examples=300)  # derandomized, no database: the conftest profile
@given(st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=5))
@pytest.mark.slow
def test_common_prefix_len_equals_a_plain_scan(rows):
    n = 0
    while all(len(r) > n for r in rows) and len({r[n] for r in rows}) == 1:
        n += 1
    assert engine.common_prefix_len(rows) == n


@pytest.mark.slow
def test_decoding_drops_ended_prompts_and_keeps_the_rest_exact(monkeypatch):
    """Prompts end one after another (down to a single prefix node): the lean decoder drops
    ended prompts' rows and gives the HF path's greedy tokens for the rest."""
    model, tok = _model()
    prompts = _prompts(tok) * 2  # 6 prefix nodes
    group = 3
    outputs = []
    for lean in (True, False):
        monkeypatch.setattr(engine, "lean_decoding_supported", lambda m, lean=lean: lean)
        calls = {"n": 0}

        def stop(rows, toks, calls=calls):  # prompt k's rows end at decode step k + 1
            calls["n"] += 1
            return rows // group < calls["n"]

        outputs.append(_greedy(model, tok, prompts, group=group, max_new_tokens=8, stop=stop))
    (lean_tokens, lean_len), (hf_tokens, hf_len) = outputs
    assert lean_len.tolist() == [k // group + 1 for k in range(len(prompts) * group)]
    assert torch.equal(lean_tokens, hf_tokens) and torch.equal(lean_len, hf_len)


def test_rotation_matrices_rotate_as_hfs_rotary_embedding():
    """Decoding rotates q and k by one matrix per row: x @ R = x * cos + rotate_half(x) * sin."""
    from transformers.models.llama.modeling_llama import rotate_half

    cos, sin, x = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 5, 8)
    expected = x * cos[:, None] + rotate_half(x) * sin[:, None]
    got = torch.bmm(x, engine.rotation_matrices(cos, sin))
    torch.testing.assert_close(got, expected)


def test_the_graph_runner_decodes_what_eager_decoding_does(monkeypatch):
    """`_CudaGraphSteps`' bookkeeping on the CPU: capture stands in as "record the step, replay
    = run it", the warm-up as a plain run. Decoding through it gives eager decoding's rows
    exactly (same widths: bucket 4), with steps captured per width and re-captured after
    ended rows are dropped."""
    captured, replays = [], []

    def capture(body):
        captured.append(1)
        return lambda: replays.append(1) or body()

    monkeypatch.setattr(engine._CudaGraphSteps, "_capture", staticmethod(capture))
    monkeypatch.setattr(engine._CudaGraphSteps, "_warm_up", staticmethod(lambda body: body()))
    monkeypatch.setattr(engine, "CHECK_EVERY_CPU", 3)
    model, tok = _model()
    prompts = _prompts(tok) * 2
    stops = torch.tensor(list(range(0, len(tok), 9)))

    def run(graphs: bool):
        with torch.no_grad():
            logits, cache, mask, pos = prefix_tree_forward(
                model, prompts, [[0] * len(prompts)], tok.pad_token_id
            )
            return decode(model, logits[:, -1], cache, mask, pos, group=2, max_new_tokens=14,
                          temperature=1.0, top_p=0.9, stop=stops, pad_id=tok.pad_token_id,
                          uniforms=engine.row_uniforms(5, 12, 14), graphs=graphs,
                          width_bucket=4)  # fmt: skip

    eager_tokens, eager_lengths = run(False)
    assert not captured
    tokens, lengths = run(True)
    assert torch.equal(tokens, eager_tokens) and torch.equal(lengths, eager_lengths)
    assert len(set(eager_lengths.tolist())) > 1  # rows ended at different steps
    assert len(captured) >= 2 and len(replays) > len(captured)
