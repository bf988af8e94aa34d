"""Memory-bounded generation: rows generated in chunks give the rows of one batch (tokens
exactly, log-probs exactly on the returned batch and within 1e-5 in each chunk's own padding),
for the rollout sampler on both decoders and for CAR; the chunk sizes the budget chooses."""

import pytest
import torch
from omegaconf import OmegaConf
from toy_models import random_toy_model

from omgrpo.core.car import CarConfig
from omgrpo.generation import budget, engine, rollout
from omgrpo.generation.budget import ModelShape, chunk_rows, row_chunks
from omgrpo.generation.car import generate_pair_answers
from omgrpo.generation.rollout import Sequences, response_logprobs, sample
from omgrpo.models.tokenizer import build_char_tokenizer
from omgrpo.models.toy import build_toy_model


@pytest.fixture(autouse=True)
def one_thread():
    """These tiny models run ~10x faster on one torch thread than on two when the CI's other
    worker shares the cores; the thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SYSTEM = "<|im_start|>system\nThink step by step.<|im_end|>\n"
QUESTIONS = ["Evaluate left to right: 7+5", "Hi", "Evaluate: 12*3-4+1"]


def _model():
    tok = build_char_tokenizer()
    cfg = OmegaConf.create(dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1))
    return build_toy_model(cfg, tok, seed=0).eval(), tok


def _prompts(tok):
    return [tok(SYSTEM + q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


NEW = 10  # new tokens per row


def _sample(model, tok, prompts, n, **kw):
    # rows stop at any of a seventh of the vocabulary (the random model draws near-uniformly)
    # or at the budget: at different steps
    return sample(
        model,
        prompts,
        n=n,
        max_new_tokens=NEW,
        temperature=kw.pop("temperature", 1.0),
        top_p=kw.pop("top_p", 0.9),
        eos_id=list(range(0, len(tok), 7)),
        pad_id=tok.pad_token_id,
        seed=kw.pop("seed", 7),
        **kw,
    )


def _seed_where(ok, first: int = 7, tries: int = 50) -> int:
    """The first seed from `first` for which `ok(seed)` holds. Which rows a seed draws depends on
    the random model's weights (the transformers version's initialisation), so a property of
    one seed's rows (e.g. about 2 seeds in 3 give 6 distinct rows, some ending early and some
    at the budget) is luck; some seed among 50 has it whatever the weights."""
    for seed in range(first, first + tries):
        if ok(seed):
            return seed
    raise AssertionError(f"no seed in {first}..{first + tries - 1} gives the rows this test needs")


def _ragged(seqs: Sequences) -> bool:
    """Rows that all differ and end at different steps, some at the budget."""
    lengths = seqs.response_mask.sum(-1)
    rows = {tuple(r) for r in seqs.response_ids.tolist()}
    return len(rows) == len(lengths) and bool(lengths.min() < lengths.max() == NEW)


def _equal(a: Sequences, b: Sequences) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(
            (a.prompt_ids, a.prompt_mask, a.response_ids, a.response_mask),
            (b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask),
        )
    )


def _trim(seqs: Sequences) -> Sequences:
    """The rows in their own padding: prompt and response columns no row uses dropped."""
    p = int(seqs.prompt_mask.any(0).long().argmax())
    r = int(seqs.response_mask.sum(-1).max())
    return Sequences(
        seqs.prompt_ids[:, p:],
        seqs.prompt_mask[:, p:],
        seqs.response_ids[:, :r],
        seqs.response_mask[:, :r],
    )


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.slow
def test_chunks_of_1_3_and_all_rows_give_the_same_rows(monkeypatch, lean, temperature):
    monkeypatch.setattr(engine, "lean_decoding_supported", lambda m: lean)
    model, tok = _model()
    prompts, n = _prompts(tok), 2
    seed = 7
    if temperature > 0:  # a seed whose rows differ and stop at different steps
        seed = _seed_where(lambda s: _ragged(_sample(model, tok, prompts, n, seed=s)))
    whole = _sample(model, tok, prompts, n, temperature=temperature, seed=seed)
    if temperature > 0:
        assert len({tuple(r) for r in whole.response_ids.tolist()}) == 6  # rows differ
        lengths = whole.response_mask.sum(-1)
        assert lengths.min() < lengths.max() == NEW  # some rows stopped early
    logprobs = response_logprobs(model, whole)["logprobs"]
    for rows in (1, 3, 6):  # 3 rows: one prompt's 2 rows per chunk
        chunked = _sample(
            model, tok, prompts, n, temperature=temperature, batch_size=rows, seed=seed
        )
        assert _equal(whole, chunked), rows
        assert torch.equal(response_logprobs(model, chunked)["logprobs"], logprobs)
        # each chunk scored in its own (narrower) padding: equal up to float round-off
        for lo, hi in row_chunks(len(prompts), n, rows):
            part = _trim(chunked.select(slice(lo, hi)))
            own = response_logprobs(model, part)["logprobs"]
            mask = part.response_mask.bool()
            torch.testing.assert_close(
                own[mask], logprobs[lo:hi, : mask.shape[1]][mask], atol=1e-5, rtol=1e-5
            )


def test_a_row_splits_across_chunks_of_one_prompts_rows():
    """4 rows per prompt in chunks of 3: pieces of 3 and 1 rows of each prompt."""
    model, tok = _model()
    prompts = _prompts(tok)[:2]
    whole = _sample(model, tok, prompts, 4)
    assert _equal(whole, _sample(model, tok, prompts, 4, batch_size=3))


def test_a_seed_fixes_the_rows_and_none_draws_from_the_global_rng():
    model, tok = _model()
    prompts = _prompts(tok)
    a, b = _sample(model, tok, prompts, 2, seed=1), _sample(model, tok, prompts, 2, seed=2)
    assert not torch.equal(a.response_ids, b.response_ids)
    torch.manual_seed(0)
    c = _sample(model, tok, prompts, 2, seed=None)
    torch.manual_seed(0)
    assert _equal(c, _sample(model, tok, prompts, 2, seed=None, batch_size=1))


@pytest.mark.parametrize("every", [1, 3])
def test_reading_the_device_every_k_tokens_gives_the_same_rows(monkeypatch, every):
    """The loop reads which rows are open every few tokens (on a GPU `CHECK_EVERY` = 32,
    on the CPU every token) and then drops ended prompts; more or fewer reads give the same
    rows (every 32 never reads within NEW tokens; every 1 or 3 drops prompts as they end)."""
    model, tok = _model()
    prompts = _prompts(tok)

    def a_prompt_ends_early(seqs: Sequences) -> bool:
        longest_per_prompt = seqs.response_mask.sum(-1).view(len(prompts), 3).max(-1).values
        return _ragged(seqs) and bool((longest_per_prompt < NEW - 1).any())

    monkeypatch.setattr(engine, "CHECK_EVERY_CPU", 32)  # > NEW: rows are never dropped
    seed = _seed_where(lambda s: a_prompt_ends_early(_sample(model, tok, prompts, 3, seed=s)))
    whole = _sample(model, tok, prompts, 3, seed=seed)
    assert a_prompt_ends_early(whole)
    monkeypatch.setattr(engine, "CHECK_EVERY_CPU", every)
    dropped = []
    real_keep = engine._LeanKV.keep
    monkeypatch.setattr(
        engine._LeanKV, "keep", lambda kv, i: dropped.append(len(i)) or real_keep(kv, i)
    )
    assert _equal(whole, _sample(model, tok, prompts, 3, seed=seed))
    if every == 1:
        assert dropped  # a prompt's rows all ended before the budget and were dropped


def _record_chunks(monkeypatch) -> list[tuple[int, int]]:
    """(prompts, rows per prompt) of every chunk `sample` decodes."""
    seen = []
    real = rollout._sample_chunk

    def spy(model, prompts, n, *args):
        seen.append((len(prompts), n))
        return real(model, prompts, n, *args)

    monkeypatch.setattr(rollout, "_sample_chunk", spy)
    return seen


def test_max_batch_tokens_bounds_every_chunk(monkeypatch):
    model, tok = _model()
    prompts, n, new = _prompts(tok), 2, NEW
    longest = max(map(len, prompts))
    seen = _record_chunks(monkeypatch)
    whole = _sample(model, tok, prompts, n)
    assert seen == [(3, 2)]
    # the lean decoder holds each prompt once and NEW new tokens per row
    for bound, chunks in [
        (2 * longest + 4 * new, [(2, 2), (1, 2)]),  # two prompts fit, three do not
        (2 * longest + 4 * new - 1, [(1, 2)] * 3),  # one prompt with both rows
        (longest + 2 * new - 1, [(1, 1)] * 6),  # not even one prompt's rows: one row
    ]:
        seen.clear()
        assert _equal(whole, _sample(model, tok, prompts, n, max_batch_tokens=bound))
        assert seen == chunks, bound
        for k, rows in seen:
            assert k * longest + k * rows * new <= bound


def test_free_memory_sizes_the_chunks(monkeypatch):
    """Without max_batch_tokens the chunk is what fits the device's free memory now."""
    model, tok = _model()
    prompts, n = _prompts(tok), 2
    shape = budget.model_shape_of(model)
    need = budget.generation_bytes(
        shape,
        4,
        prompts=1,
        rows=2,
        prompt_len=max(map(len, prompts)),
        new_tokens=NEW,
        top_p=0.9,
    )
    monkeypatch.setattr(budget, "free_memory_bytes", lambda device: need)
    seen = _record_chunks(monkeypatch)
    _sample(model, tok, prompts, n)
    assert seen == [(1, 2)] * 3


@pytest.mark.slow
def test_car_answers_do_not_depend_on_the_chunks():
    model, tok = random_toy_model(2, seed=0)
    sols = ["2+2 = \\boxed{4}", "2+2 = 5, so \\boxed{5}", "\\boxed{4}"]
    groups = [("What is 2+2?", sols)]  # 3 anchors of 2 pairs
    cfg = CarConfig(temperature=1.0, max_new_tokens=5, chunk_pairs=100)

    def answers(seed, cfg=cfg, **kw):
        return generate_pair_answers(model, tok, groups, cfg, rng=0, seed=seed, **kw)

    # a seed whose 6 pair answers are not mostly alike (3 to 27 % of seeds are, by the weights)
    seed = _seed_where(lambda s: len({t for g in answers(s).texts for t in g}) > 3, first=3)
    whole = answers(seed)
    assert len({t for g in whole.texts for t in g}) > 3
    for pairs in (1, 4):  # anchors split; two whole anchors then one
        chunked = CarConfig(temperature=1.0, max_new_tokens=5, chunk_pairs=pairs)
        assert answers(seed, chunked) == whole
    small = answers(seed, max_batch_tokens=1)
    assert small == whole


# ----------------------------------------------------------------------------------------
# The chunk size (the planner's formula, `omgrpo.generation.budget`)
# ----------------------------------------------------------------------------------------
SHAPE = ModelShape(
    name="hand",
    model_type="qwen3",
    params=0,
    layers=2,
    hidden=8,
    heads=2,
    kv_heads=1,
    head_dim=4,
    intermediate=16,
    vocab=10,
    lean=True,
)


def test_chunk_rows_by_hand():
    """fp32 (4 bytes), 4 rows per prompt, prompts of 10 tokens, 20 new tokens, top-p 1.

    K/V per token: 2 layers x 2 x 1 K/V head x 4 x 4 B = 64 B; one layer's prefill work per
    prompt token 4 x (2·8 + 2·8 + 2·4 + 3·16) + 8·8 = 416 B; the decoder's q/k/v copy
    2 layers x (2 + 2·1) heads x 4 x 8 x 4 B = 1024 B.
    k whole prompts (4k rows): K/V (10k + 80k) x 64 = 5760k, its one-layer copy / 4 = 1440k,
    prefill 10k x 416 = 4160k, sampling 4k x 10 x (4 + 12) = 640k, draws 4k x 20 x 4 = 320k:
    12320k + 1024 bytes. r < 4 rows of one prompt: K/V (10 + 20r) x 64 = 640 + 1280r, copy
    160 + 320r, prefill 4160, sampling 160r, draws 80r: 5984 + 1840r bytes.
    """
    kw = dict(rows=24, group=4, prompt_len=10, new_tokens=20, top_p=1.0)
    lengths = dict(prompt_len=10, new_tokens=20, top_p=1.0)
    assert budget.generation_bytes(SHAPE, 4, prompts=3, rows=12, **lengths) == 37984
    assert budget.generation_bytes(SHAPE, 4, prompts=1, rows=2, **lengths) == 9664
    by_budget = {
        40_000: 12,  # 3 prompts: 37984; 4: 50304
        13_344: 4,  # exactly one prompt
        13_343: 3,  # 3 rows of it: 11504
        10_000: 2,  # 2 rows: 9664; 3: 11504
        8_000: 1,  # 1 row: 7824
        100: 1,  # nothing fits: still one row (the plan refuses it)
        10**9: 24,  # everything
    }
    for budget_bytes, rows in by_budget.items():
        assert chunk_rows(SHAPE, 4, **kw, budget_bytes=budget_bytes) == rows, budget_bytes
    # K/V tokens: 90 per prompt with its 4 rows; 10 + 20r for r rows of one prompt
    assert chunk_rows(SHAPE, 4, **kw, max_batch_tokens=200) == 8
    assert chunk_rows(SHAPE, 4, **kw, max_batch_tokens=50) == 2
    assert chunk_rows(SHAPE, 4, **kw, max_rows=7) == 4  # whole prompts under a row bound
    assert chunk_rows(SHAPE, 4, **kw, max_rows=3) == 3
    # CAR's prompts are held per row: 30 tokens per row
    car = dict(kw, group=1, per_row=True)
    assert chunk_rows(SHAPE, 4, **car, max_batch_tokens=100) == 3


def test_row_chunks():
    assert row_chunks(3, 2, 6) == [(0, 6)]
    assert row_chunks(3, 2, 4) == [(0, 4), (4, 6)]
    assert row_chunks(3, 2, 3) == [(0, 2), (2, 4), (4, 6)]
    assert row_chunks(2, 4, 3) == [(0, 3), (3, 4), (4, 7), (7, 8)]
    assert row_chunks(2, 2, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
