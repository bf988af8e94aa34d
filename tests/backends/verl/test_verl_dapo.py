"""The DAPO-family options on the verl backend (CPU, real verl 0.9.1), at the loss level:

- each loss aggregation mode (`algorithm.agg` -> verl's `actor.loss_agg_mode`) and the
  asymmetric clip (`clip_low` / `clip_high` -> `actor.clip_ratio_low` / `clip_ratio_high`):
  the native `grpo_loss` and `omgrpo_ppo_loss` give the same loss and per-token gradient on the
  same micro-batch with the answer mask on (w = 0: answer tokens' gradient exactly 0);
- the keys map onto verl's (a non-default omgrpo value names verl's key);
- dynamic sampling, the overlong filter and the soft overlong punishment
  (`omgrpo.backends.verl.dapo`): on a hand-built step (zero-spread groups, truncated rollouts,
  a balance-batch padding row) the trainer's advantage step (verl's real GRPO step on a fake
  TransferQueue) and `omgrpo_ppo_loss` give the native trainer's loss (`dapo_batch`,
  `step_loss`), per-token gradient and `dapo/*` metrics for each mode, at w = 0 and 1; the
  options compose with their keys under `omgrpo.algorithm`, bad values are refused by name.
"""

from __future__ import annotations

try:
    import verl
except ModuleNotFoundError as exc:  # CI runs these with real verl: say how to get it
    raise ModuleNotFoundError(
        "tests/backends/verl need verl: install with pip install -e '.[dev,verl]'"
    ) from exc

import re
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from test_verl_trainer import LAUNCH, FakeTQ
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1 import trainer_base
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass

from omgrpo.backends.native.update import _loss_tokens, dapo_batch
from omgrpo.backends.verl import ANSWER_MASK_KEY, TRUNCATED_KEY
from omgrpo.backends.verl import trainer as trainer_mod
from omgrpo.backends.verl.advantage import weight_advantages
from omgrpo.backends.verl.agent_loop import OmgrpoAgentLoopWorker
from omgrpo.backends.verl.config import compose_verl
from omgrpo.backends.verl.dapo import kept_loss_mask
from omgrpo.backends.verl.loss import omgrpo_ppo_loss
from omgrpo.backends.verl.trainer import OmgrpoTrainer
from omgrpo.core.losses import AGG_MODES, group_advantages, grpo_loss
from omgrpo.core.step import StepBatch, step_loss
from omgrpo.errors import InputError

PROMPT_LEN = 3
LENGTHS = [5, 7, 3, 4]  # unequal: the three modes differ
ANSWER_POS = [[2, 3], [6], [], [1]]
ACTOR = "actor_rollout_ref.actor"


def _nested(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def make_rows(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Log-probs (current, old within +-0.3: below verl's dual-clip bound, some clipped at
    0.1 / 0.15), ref, a sequence advantage and the answer mask of each row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n, pos in zip(LENGTHS, ANSWER_POS):
        logp = -torch.rand(n, generator=g) * 2 - 0.1
        answer = torch.zeros(n, dtype=torch.bool)
        answer[pos] = True
        rows.append(
            {
                "logp": logp,
                "old": logp + (torch.rand(n, generator=g) - 0.5) * 0.6,
                "ref": -torch.rand(n, generator=g) * 2 - 0.1,
                "adv": torch.randn((), generator=g),
                "answer": answer,
            }
        )
    return rows


def native(rows, w: float, config) -> tuple[torch.Tensor, torch.Tensor]:
    """`grpo_loss` on the padded rows with the actor config's clip, KL and aggregation."""
    logp = _padded([r["logp"] for r in rows]).requires_grad_(True)
    resp = _padded([torch.ones(len(r["logp"]), dtype=torch.bool) for r in rows])
    loss, _ = grpo_loss(
        logp,
        _padded([r["old"] for r in rows]),
        _padded([r["ref"] for r in rows]),
        torch.stack([r["adv"] for r in rows]),
        resp,
        _padded([r["answer"] for r in rows]),
        answer_weight=w,
        clip=config.clip_ratio,
        clip_low=config.clip_ratio_low,
        clip_high=config.clip_ratio_high,
        kl_coef=config.kl_loss_coef,
        agg=config.loss_agg_mode,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad


def verl(rows, w: float, config) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`omgrpo_ppo_loss` on the same rows as verl's engine hands them over (advantages weighted
    by the driver), with the global batch info of one micro-batch; each row's gradient."""
    resp = _padded([torch.ones(len(r["logp"]), dtype=torch.int64) for r in rows])
    answer = _padded([r["answer"].long() for r in rows])
    adv = _padded([r["adv"].expand(len(r["logp"])) for r in rows])
    weighted = weight_advantages(adv, resp, answer, w)
    n_rows = len(rows)
    data = TensorDict(
        {
            "prompts": _nested([torch.full((PROMPT_LEN,), 5) for _ in rows]),
            "responses": _nested([torch.full((len(r["logp"]),), 7) for r in rows]),
            "response_mask": _nested([torch.ones(len(r["logp"]), dtype=torch.int64) for r in rows]),
            "old_log_probs": _nested([r["old"] for r in rows]),
            "ref_log_prob": _nested([r["ref"] for r in rows]),
            "advantages": _nested([weighted[i, : len(r["logp"])] for i, r in enumerate(rows)]),
            ANSWER_MASK_KEY: _nested([r["answer"].long() for r in rows]),
        },
        batch_size=n_rows,
    )
    tokens = sum(len(r["logp"]) for r in rows)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=tokens, global_batch_size=n_rows)
    flat = []
    for r in rows:  # response token t's log-prob sits at PROMPT_LEN - 1 + t of its row
        flat += [torch.zeros(PROMPT_LEN - 1), r["logp"], torch.zeros(1)]
    flat = torch.cat(flat).requires_grad_(True)
    loss, _ = omgrpo_ppo_loss(config, {"log_probs": flat}, data, answer_weight=w)
    (grad,) = torch.autograd.grad(loss, flat)
    out, start = [], 0
    for r in rows:
        n = len(r["logp"])
        out.append(grad[start + PROMPT_LEN - 1 : start + PROMPT_LEN - 1 + n])
        start += PROMPT_LEN + n
    return loss, out


def actor_config(overrides: list[str]):
    node = compose_verl("paper_qwen3_1p7b", overrides).actor_rollout_ref.actor
    return omega_conf_to_dataclass(node)


CLIPS = {
    "symmetric": [],
    "asymmetric": [f"{ACTOR}.clip_ratio_low=0.1", f"{ACTOR}.clip_ratio_high=0.15"],
}


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("w", [0.0, 1.0])
@pytest.mark.slow
def test_native_and_verl_losses_agree_for_each_mode_and_clip(mode, clip, w):
    config = actor_config([f"{ACTOR}.loss_agg_mode={mode}", *CLIPS[clip]])
    assert config.loss_agg_mode == mode
    rows = make_rows()
    native_loss, native_grad = native(rows, w, config)
    verl_loss, verl_grads = verl(rows, w, config)
    assert verl_loss.item() == pytest.approx(native_loss.item(), rel=1e-6, abs=1e-9)
    for i, (r, got) in enumerate(zip(rows, verl_grads)):
        torch.testing.assert_close(got, native_grad[i, : len(r["logp"])], rtol=1e-5, atol=1e-9)
        if w == 0.0:
            assert torch.all(got[r["answer"]] == 0) and torch.all(
                native_grad[i][: len(r["logp"])][r["answer"]] == 0
            )
        assert torch.all(got[~r["answer"]] != 0)


@pytest.mark.slow
def test_the_asymmetric_clip_changes_the_loss_on_both_backends():
    rows = make_rows()
    sym = actor_config([])
    asym = actor_config(CLIPS["asymmetric"])
    assert native(rows, 0.0, sym)[0].item() != native(rows, 0.0, asym)[0].item()
    assert verl(rows, 0.0, sym)[0].item() != verl(rows, 0.0, asym)[0].item()


@pytest.mark.parametrize(
    ("override", "verl_key"),
    [
        ("omgrpo.algorithm.clip_low=0.1", "clip_ratio_low"),
        ("omgrpo.algorithm.clip_high=0.28", "clip_ratio_high"),
        ("omgrpo.algorithm.agg=seq-mean-token-mean", "loss_agg_mode"),
    ],
)
def test_omgrpo_keys_verl_holds_name_verls_key(override, verl_key):
    with pytest.raises(ValueError, match=f"set {ACTOR}.{verl_key} instead"):
        compose_verl("paper_qwen3_1p7b", [override])


def test_defaults_leave_verls_clip_and_aggregation_alone():
    cfg = compose_verl("paper_qwen3_1p7b")
    actor = cfg.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (
        0.2,
        0.2,
        "token-mean",
    )
    algo = cfg.omgrpo.algorithm
    assert algo.clip_low is None and algo.clip_high is None and algo.dynamic_sampling is None


# --------------------------------------------------------------------------------------------
# Dynamic sampling, overlong filter, overlong buffer: native vs verl on one hand-built step
# --------------------------------------------------------------------------------------------
MAX_LEN = 6  # the length limit: actor_rollout_ref.rollout.response_length / max_new_tokens
EOS, STOP = 2, 9  # the tokenizer's eos and the generation config's other stop token
CUT = [5, 6, 7, 8, 7, 6]  # MAX_LEN tokens, no stop token at the end: truncated
# 4 prompts x G = 3: (reward, response tokens). b and c have zero spread; a0, b1, c0 are cut
# (a2 reaches the limit but ends in eos, b2 ends in the generation config's stop token).
STEP = {
    "a": [(1.0, CUT), (0.0, [5, 6, EOS]), (1.0, [5, 6, 7, 8, 7, EOS])],
    "b": [(1.0, [5, EOS]), (1.0, CUT), (1.0, [5, 6, 7, STOP])],
    "c": [(0.0, CUT), (0.0, [5, 6, 7, 8, EOS]), (0.0, [5, 6, EOS])],
    "d": [(0.5, [5, 6, 7, EOS]), (0.0, [5, 6, 7, 8, EOS]), (1.0, [5, EOS])],
}
TRUNCATED = [True, False, False, False, True, False, True, False, False, False, False, False]
# buffer 3, factor 0.5: 0 up to 3 tokens, -0.5 / 3 per token over 3, -0.5 at 6 tokens
PENALISED = [0.5, 0.0, 0.5, 1.0, 0.5, 5 / 6, -0.5, -1 / 3, 0.0, 1 / 3, -1 / 3, 1.0]
OPTIONS = {
    "dynamic_sampling": (
        {"dynamic_sampling": True},
        {"dapo/dropped_groups": 2.0, "dapo/kept_rollouts": 0.5},
        [True] * 3 + [False] * 6 + [True] * 3,  # groups b and c dropped
    ),
    "overlong_filter": (
        {"overlong_filter": True},
        {"dapo/truncated": 0.25, "dapo/kept_rollouts": 0.75},
        [not t for t in TRUNCATED],
    ),
    "overlong_buffer": (
        {"overlong_buffer": 3, "overlong_penalty_factor": 0.5},
        {"dapo/overlong_penalty": -0.25},
        [True] * 12,
    ),
    # the penalty gives b and c spread: dynamic sampling then drops nothing
    "all": (
        {
            "dynamic_sampling": True,
            "overlong_filter": True,
            "overlong_buffer": 3,
            "overlong_penalty_factor": 0.5,
        },
        {
            "dapo/overlong_penalty": -0.25,
            "dapo/dropped_groups": 0.0,
            "dapo/truncated": 0.25,
            "dapo/kept_rollouts": 0.75,
        },
        [not t for t in TRUNCATED],
    ),
}


class StoreTQ(FakeTQ):
    """The fake TransferQueue, answering only the fields its rows hold (as TransferQueue does
    for verl's optional fields: values, rollout log-probs, ...)."""

    def kv_batch_get(self, keys, partition_id, select_fields):
        held = [f for f in select_fields if f in self.rows[keys[0]]]
        return super().kv_batch_get(keys, partition_id, held)


def step_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The step as padded (B, MAX_LEN) tensors: ids, response mask, answer mask (the tokens
    at 1 and 2 where the response has a token after them), log-probs, rewards, groups."""
    g = torch.Generator().manual_seed(seed)
    flat = [row for group in STEP.values() for row in group]
    B = len(flat)
    ids = torch.zeros(B, MAX_LEN, dtype=torch.int64)
    resp = torch.zeros(B, MAX_LEN, dtype=torch.bool)
    answer = torch.zeros(B, MAX_LEN, dtype=torch.bool)
    for i, (_, tokens) in enumerate(flat):
        n = len(tokens)
        ids[i, :n] = torch.tensor(tokens)
        resp[i, :n] = True
        answer[i, 1 : min(3, n - 1)] = True
    logp = (-torch.rand(B, MAX_LEN, generator=g) * 2 - 0.1) * resp
    old = (logp + (torch.rand(B, MAX_LEN, generator=g) - 0.5) * 0.6) * resp
    ref = (-torch.rand(B, MAX_LEN, generator=g) * 2 - 0.1) * resp
    return {
        "ids": ids,
        "resp": resp,
        "answer": answer,
        "logp": logp,
        "old": old,
        "ref": ref,
        "rewards": torch.tensor([r for r, _ in flat], dtype=torch.float64),
        "groups": torch.arange(len(STEP)).repeat_interleave(3),
    }


def fake_worker():
    """What `OmgrpoAgentLoopWorker.truncated` reads of its worker: the length limit, the
    tokenizer (eos 2) and verl's model config (generation config eos ids 2 and 9)."""
    tokenizer = SimpleNamespace(
        eos_token_id=EOS, unk_token_id=0, convert_tokens_to_ids=lambda token: 0
    )
    return SimpleNamespace(
        rollout_config=SimpleNamespace(response_length=MAX_LEN),
        tokenizer=tokenizer,
        model_config=SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[EOS, STOP])),
    )


def test_the_agent_loop_marks_the_truncated_rollouts():
    t = step_tensors()
    cut = OmgrpoAgentLoopWorker.truncated(fake_worker(), t["ids"], t["resp"].long())
    assert cut.tolist() == TRUNCATED


def native_step(t, algo):
    """The native trainer's path: `score_step`'s advantages, `dapo_batch`, then `step_loss`
    over one mini-batch with `ppo_update`'s denominator (`_loss_tokens`)."""
    advantages = group_advantages(t["rewards"].float(), t["groups"], algo.adv_eps)
    batch = StepBatch(
        prompts=[],
        group_ids=t["groups"],
        responses=SimpleNamespace(answer_mask=t["answer"]),
        answers=[],
        correct=[],
        groups=[],
        reward_parts={},
        rewards=t["rewards"].numpy(),
        advantages=advantages,
    )
    seqs = SimpleNamespace(response_ids=t["ids"], response_mask=t["resp"].long())
    batch, metrics = dapo_batch(batch, seqs, algo, MAX_LEN, [EOS, STOP])
    mb = torch.arange(len(t["ids"]))
    logp = t["logp"].clone().requires_grad_(True)
    num_tokens = _loss_tokens(seqs, batch, mb).clamp(min=1)
    loss, _ = step_loss(
        batch, mb, logp, t["resp"], algo, num_tokens, old_logprobs=t["old"], ref_logprobs=t["ref"]
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, metrics


def stored_step(t, truncated: list[bool]) -> dict[str, dict]:
    """The step as the agent loop leaves it in TransferQueue (reward on the last token,
    `loss_mask` a copy of `response_mask`, the answer mask and truncation fields), the old and
    ref passes' log-probs (and the old pass's entropy), and a balance-batch padding row (one
    token, masks 0, uid `pad`)."""
    rows = {}
    for i, uid in enumerate(k for k in STEP for _ in range(3)):
        n = int(t["resp"][i].sum())
        scores = torch.zeros(n)
        scores[-1] = float(t["rewards"][i])
        rows[f"{uid}_{i}_0"] = {
            "uid": uid,
            "responses": t["ids"][i, :n],
            "response_mask": torch.ones(n, dtype=torch.int64),
            "loss_mask": torch.ones(n, dtype=torch.int64),
            "rm_scores": scores,
            "old_log_probs": t["old"][i, :n],
            "ref_log_prob": t["ref"][i, :n],
            "entropy": -t["old"][i, :n],
            ANSWER_MASK_KEY: t["answer"][i, :n].long(),
            TRUNCATED_KEY: torch.tensor(int(truncated[i])),
        }
    rows["pad_0_0"] = {
        "uid": "pad",
        "responses": torch.tensor([EOS]),
        "response_mask": torch.zeros(1, dtype=torch.int64),
        "loss_mask": torch.zeros(1, dtype=torch.int64),
        "rm_scores": torch.zeros(1),
        "old_log_probs": torch.zeros(1),
        "ref_log_prob": torch.zeros(1),
        "entropy": torch.zeros(1),
        ANSWER_MASK_KEY: torch.zeros(1, dtype=torch.int64),
        TRUNCATED_KEY: torch.tensor(0),
    }
    return rows


def verl_step(t, trainer, monkeypatch):
    """The verl path: the trainer's advantage step (omgrpo's DAPO fields, verl's real GRPO
    step, the answer weighting) on the stored step, then the installed loss on the update
    mini-batch (all rows, one micro-batch) with the engine's `batch_num_tokens` (the sum of
    `loss_mask`) and `global_batch_size` (the mini-batch's rows); each real row's gradient."""
    truncated = OmgrpoAgentLoopWorker.truncated(fake_worker(), t["ids"], t["resp"].long())
    fake = StoreTQ(stored_step(t, truncated.tolist()))
    monkeypatch.setattr(trainer_mod, "tq", fake)
    monkeypatch.setattr(trainer_base, "tq", fake)
    keys = list(fake.rows)
    batch = KVBatchMeta(
        keys=keys, tags=[{"is_padding": k.startswith("pad")} for k in keys], partition_id="train"
    )
    metrics = {}
    trainer._compute_advantage(batch, metrics)
    rows = [fake.rows[k] for k in keys]
    fields = [
        "responses",
        "response_mask",
        "loss_mask",
        "old_log_probs",
        "ref_log_prob",
        "advantages",
        ANSWER_MASK_KEY,
    ]
    data = TensorDict(
        {
            "prompts": _nested([torch.full((PROMPT_LEN,), 5) for _ in rows]),
            **{f: _nested([r[f] for r in rows]) for f in fields},
        },
        batch_size=len(rows),
    )
    tokens = int(sum(r["loss_mask"].sum() for r in rows))  # the FSDP engine's batch_num_tokens
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=tokens, global_batch_size=len(rows))
    logp = [t["logp"][i, : len(r["responses"])] for i, r in enumerate(rows[:-1])]
    logp.append(torch.full((1,), -0.5))  # the padding row
    flat = []
    for lp in logp:  # response token j's log-prob sits at PROMPT_LEN - 1 + j of its row
        flat += [torch.zeros(PROMPT_LEN - 1), lp, torch.zeros(1)]
    flat = torch.cat(flat).requires_grad_(True)
    loss, _ = trainer.make_loss_fn()(model_output={"log_probs": flat}, data=data)
    (grad,) = torch.autograd.grad(loss, flat)
    out, start = [], 0
    for lp in logp:
        out.append(grad[start + PROMPT_LEN - 1 : start + PROMPT_LEN - 1 + len(lp)])
        start += PROMPT_LEN + len(lp)
    return loss, out, metrics, rows


@pytest.fixture(scope="module")
def dapo_configs():
    cache = {}

    def get(option: str, mode: str, w: float):
        if (option, mode, w) not in cache:
            keys = OPTIONS[option][0]
            cache[option, mode, w] = compose_verl(
                "paper_qwen3_1p7b",
                [
                    *LAUNCH,
                    f"actor_rollout_ref.rollout.response_length={MAX_LEN}",
                    f"{ACTOR}.loss_agg_mode={mode}",
                    f"omgrpo.algorithm.answer_weight={w}",
                    *[f"omgrpo.algorithm.{k}={str(v).lower()}" for k, v in keys.items()],
                ],
            )
        return cache[option, mode, w]

    return get


@pytest.mark.parametrize("w", [0.0, 1.0])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.slow
def test_native_and_verl_agree_under_each_dapo_option(option, mode, w, dapo_configs, monkeypatch):
    cfg = dapo_configs(option, mode, w)
    trainer = OmgrpoTrainer(cfg)  # no Ray: the workers are built later, in init()
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    algo = OmegaConf.merge(
        cfg.omgrpo.algorithm,
        {"agg": mode, "clip": actor.clip_ratio, "kl_coef": actor.kl_loss_coef},
    )
    _, expected_metrics, kept = OPTIONS[option]
    t = step_tensors()

    native_loss, native_grad, native_metrics = native_step(t, algo)
    verl_loss, verl_grads, verl_metrics, rows = verl_step(t, trainer, monkeypatch)

    assert native_metrics == pytest.approx(expected_metrics)
    dapo = {k: v for k, v in verl_metrics.items() if k.startswith("dapo/")}
    assert dapo == pytest.approx(expected_metrics)
    # Without a dropped row verl's seq-mean modes divide by the mini-batch's rows, the padding
    # row included (docs/configuration.md: empty responses), the native trainer by the 12 real
    # ones; with dynamic sampling or the overlong filter both divide by the kept rows.
    scale = 1.0
    if mode != "token-mean" and not trainer.make_loss_fn().keywords.get("dapo_rows"):
        scale = (len(rows) - 1) / len(rows)
    assert verl_loss.item() == pytest.approx(scale * native_loss.item(), rel=1e-5, abs=1e-8)
    for i, got in enumerate(verl_grads[:-1]):
        n, answer = len(got), t["answer"][i, : len(got)]
        want = scale * native_grad[i, :n]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
        if not kept[i]:  # out of the loss: no gradient at all
            assert torch.all(got == 0) and torch.all(want == 0)
        else:
            assert torch.all(got[~answer] != 0)
        if w == 0.0:  # the answer tokens' gradient is exactly zero
            assert torch.all(got[answer] == 0) and torch.all(want[answer] == 0)
    assert torch.all(verl_grads[-1] == 0)  # the padding row
    # the rewards verl's GRPO step read (the penalty on each rollout's last token)
    rewards = [float(r["rm_scores"].sum()) for r in rows[:-1]]
    penalised = "overlong_penalty_factor" in OPTIONS[option][0]
    assert rewards == pytest.approx(PENALISED if penalised else t["rewards"].tolist())
    # verl's loss_mask: the kept rows' tokens (token-mean) or one token per kept row
    counts = [int(r["loss_mask"].sum()) for r in rows]
    if option == "overlong_buffer":  # nothing dropped: loss_mask untouched
        assert counts == [int(n) for n in t["resp"].sum(-1)] + [0]
    elif mode == "token-mean":
        assert counts == [int(n) * k for n, k in zip(t["resp"].sum(-1), kept)] + [0]
    else:
        assert counts == [int(k) for k in kept] + [0]


def test_the_dapo_metric_names_are_documented_for_verl(metric_table):
    names = {name for _, metrics, _ in OPTIONS.values() for name in metrics}
    assert metric_table.undocumented(names, "verl") == []


@pytest.mark.parametrize("mode", AGG_MODES)
def test_a_mini_batch_with_every_row_dropped_has_loss_zero(mode):
    """No kept row (batch_num_tokens 0): loss 0 and a zero gradient, not 0 / 0, as natively."""
    config = actor_config([f"{ACTOR}.loss_agg_mode={mode}"])
    rows = make_rows()
    n = len(rows)
    data = TensorDict(
        {
            "prompts": _nested([torch.full((PROMPT_LEN,), 5) for _ in rows]),
            "responses": _nested([torch.full((len(r["logp"]),), 7) for r in rows]),
            "response_mask": _nested([torch.ones(len(r["logp"]), dtype=torch.int64) for r in rows]),
            "loss_mask": _nested([torch.zeros(len(r["logp"]), dtype=torch.int64) for r in rows]),
            "old_log_probs": _nested([r["old"] for r in rows]),
            "ref_log_prob": _nested([r["ref"] for r in rows]),
            "advantages": _nested([r["adv"].expand(len(r["logp"])) for r in rows]),
            ANSWER_MASK_KEY: _nested([r["answer"].long() for r in rows]),
        },
        batch_size=n,
    )
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=0, global_batch_size=n)
    flat = torch.cat([torch.zeros(PROMPT_LEN + len(r["logp"])) for r in rows])
    flat.requires_grad_(True)
    loss, metrics = omgrpo_ppo_loss(
        config, {"log_probs": flat}, data, answer_weight=0.0, dapo_rows=True
    )
    (grad,) = torch.autograd.grad(loss, flat)
    assert loss.item() == 0.0 and torch.all(grad == 0)
    # the token metrics still cover every row
    assert metrics["kl/reasoning_count"].aggregate() == sum(int((~r["answer"]).sum()) for r in rows)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_kept_loss_mask_counts_tokens_or_rows(mode):
    resp = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 0]])
    keep = torch.tensor([True, False, True, True])
    got = kept_loss_mask(resp, keep, mode)
    if mode == "token-mean":
        assert got.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 0, 0]]
    else:
        assert got.tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0]]
    assert got.dtype == resp.dtype


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_the_dapo_options_compose_on_verl(option):
    keys = OPTIONS[option][0]
    overrides = [f"omgrpo.algorithm.{k}={str(v).lower()}" for k, v in keys.items()]
    cfg = compose_verl("paper_qwen3_1p7b", [*LAUNCH, *overrides])
    algo = cfg.omgrpo.algorithm
    assert {k: algo[k] for k in keys} == keys
    fn = OmgrpoTrainer(cfg).make_loss_fn()
    drops = bool(keys.get("dynamic_sampling") or keys.get("overlong_filter"))
    assert fn.keywords.get("dapo_rows", False) == drops


def test_without_the_options_the_loss_ignores_loss_mask():
    fn = OmgrpoTrainer(compose_verl("paper_qwen3_1p7b", LAUNCH)).make_loss_fn()
    assert "dapo_rows" not in fn.keywords


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["omgrpo.algorithm.overlong_buffer=0"], "omgrpo.algorithm.overlong_buffer"),
        (["omgrpo.algorithm.overlong_buffer=-3"], "omgrpo.algorithm.overlong_buffer"),
        (
            ["omgrpo.algorithm.overlong_buffer=65", "actor_rollout_ref.rollout.response_length=64"],
            "omgrpo.algorithm.overlong_buffer",
        ),
        (
            ["omgrpo.algorithm.overlong_buffer=8", "omgrpo.algorithm.overlong_penalty_factor=-1"],
            "omgrpo.algorithm.overlong_penalty_factor",
        ),
        (
            ["omgrpo.algorithm.overlong_penalty_factor=1"],
            "omgrpo.algorithm.overlong_penalty_factor",
        ),
        (
            ["omgrpo.algorithm.dynamic_sampling=true", f"{ACTOR}.strategy=megatron"],
            "omgrpo.algorithm.dynamic_sampling",
        ),
        (
            ["omgrpo.algorithm.overlong_filter=true", f"{ACTOR}.strategy=megatron"],
            "omgrpo.algorithm.overlong_filter",
        ),
    ],
)
def test_bad_dapo_values_are_refused_naming_the_key(overrides, key):
    with pytest.raises(InputError, match=re.escape(key)):
        compose_verl("paper_qwen3_1p7b", [*LAUNCH, *overrides])
