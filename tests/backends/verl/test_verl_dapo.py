"""The DAPO-family options on the verl backend (CPU, real verl 0.9.1), at the loss level:

- each loss aggregation mode (`algorithm.agg` -> verl's `actor.loss_agg_mode`) and the
  asymmetric clip (`clip_low` / `clip_high` -> `actor.clip_ratio_low` / `clip_ratio_high`):
  the native `grpo_loss` and `omgrpo_ppo_loss` give the same loss and per-token gradient on the
  same micro-batch with the answer mask on (w = 0: answer tokens' gradient exactly 0);
- the keys map onto verl's (a non-default omgrpo value names verl's key), and the native-only
  options are refused by name.
"""

from __future__ import annotations

try:
    import verl
except ModuleNotFoundError as exc:  # CI runs these with real verl: say how to get it
    raise ModuleNotFoundError(
        "tests/backends/verl need verl: install with pip install -e '.[dev,verl]'"
    ) from exc

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass

from omgrpo.backends.verl import ANSWER_MASK_KEY
from omgrpo.backends.verl.advantage import weight_advantages
from omgrpo.backends.verl.config import compose_verl
from omgrpo.backends.verl.loss import omgrpo_ppo_loss
from omgrpo.core.losses import AGG_MODES, grpo_loss

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


@pytest.mark.parametrize(
    "override",
    [
        "omgrpo.algorithm.dynamic_sampling=true",
        "omgrpo.algorithm.overlong_filter=true",
        "omgrpo.algorithm.overlong_buffer=64",
    ],
)
def test_native_only_dapo_options_are_refused_on_verl(override):
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=f"{key}=.* is native-only"):
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
