"""The verl backend's loss and advantage pieces against verl 0.9.1 itself (CPU, real verl).

- `omgrpo_ppo_loss` equals verl's `ppo_loss` (loss, gradient, shared metrics) when nothing is
  masked, and with w = 0 answer tokens get exactly zero gradient from both the PG and the KL
  term while reasoning tokens keep the gradient they had with w = 1;
- `apply_answer_weighting` on a DataProto: w on answer tokens, the format advantage in the
  format-only variant; `weight_jagged` on TransferQueue-shaped rows with a padding row as
  verl's balance step adds it (one-token response, another rollout's longer answer mask).
"""

from __future__ import annotations

try:
    import verl  # noqa: F401
except ModuleNotFoundError as exc:  # CI runs these with real verl: say how to get it
    raise ModuleNotFoundError(
        "tests/test_verl_*.py need verl: install with pip install -e '.[dev,verl]' (or make setup)"
    ) from exc

import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.trainer.ppo.core_algos import kl_penalty
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.metric import Metric
from verl.workers.utils.losses import ppo_loss

from omgrpo.backends.verl import ANSWER_MASK_KEY, FORMAT_SCORE_KEY, TOKEN_MASK_KEY
from omgrpo.backends.verl.advantage import (
    apply_answer_weighting,
    weight_advantages,
    weight_jagged,
)
from omgrpo.backends.verl.config import compose_verl
from omgrpo.backends.verl.loss import loss_metric_means, omgrpo_ppo_loss
from omgrpo.core.losses import group_advantages, kl_k3

PROMPT_LENS = [3, 5, 4, 2]
RESPONSE_LENS = [6, 4, 7, 5]
# Answer-span tokens of each response (positions within the response).
ANSWER_POS = [[3, 4], [1], [], [2, 3]]


@pytest.fixture(scope="module")
def actor_config_factory():
    """ActorConfig as the workers build it, from the paper preset (k3 KL 0.005, clip 0.2)."""
    node = compose_verl("paper_qwen3_1p7b").actor_rollout_ref.actor

    def make():  # a fresh config per call: ppo_loss writes global_batch_info into it
        return omega_conf_to_dataclass(node)

    return make


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def make_micro_batch(seed: int = 0, advantages: list[float] | None = None, answer=ANSWER_POS):
    """A micro-batch as verl's engine hands it to the loss (jagged fields from TransferQueue,
    global batch info as non-tensor data) and the model's no-padding log-probs (a leaf)."""
    g = torch.Generator().manual_seed(seed)
    adv = advantages if advantages is not None else [1.5, -0.5, 0.75, -1.25]
    rows = {k: [] for k in ("prompts", "responses", "response_mask", "old", "ref", "adv", "ans")}
    for p, r, pos, a in zip(PROMPT_LENS, RESPONSE_LENS, answer, adv):
        rows["prompts"].append(torch.randint(4, 50, (p,), generator=g))
        rows["responses"].append(torch.randint(4, 50, (r,), generator=g))
        rows["response_mask"].append(torch.ones(r, dtype=torch.int64))
        rows["old"].append(-torch.rand(r, generator=g) * 2 - 0.1)
        rows["ref"].append(-torch.rand(r, generator=g) * 2 - 0.1)
        rows["adv"].append(torch.full((r,), float(a)))
        mask = torch.zeros(r, dtype=torch.int64)
        mask[pos] = 1
        rows["ans"].append(mask)
    data = TensorDict(
        {
            "prompts": _nested(rows["prompts"]),
            "responses": _nested(rows["responses"]),
            "response_mask": _nested(rows["response_mask"]),
            "old_log_probs": _nested(rows["old"]),
            "ref_log_prob": _nested(rows["ref"]),
            "advantages": _nested(rows["adv"]),
            ANSWER_MASK_KEY: _nested(rows["ans"]),
        },
        batch_size=len(PROMPT_LENS),
    )
    tu.assign_non_tensor(
        data, dp_size=1, batch_num_tokens=sum(RESPONSE_LENS), global_batch_size=len(PROMPT_LENS)
    )
    total = sum(PROMPT_LENS) + sum(RESPONSE_LENS)
    log_probs = (-torch.rand(total, generator=g) * 2 - 0.1).requires_grad_(True)
    return data, log_probs


def response_positions(i: int) -> list[int]:
    """Flat indices of row i's response log-probs in the no-padding model output (verl shifts
    log-probs left by one token: position t of the response is predicted at offset - R - 1 + t)."""
    end = sum(PROMPT_LENS[: i + 1]) + sum(RESPONSE_LENS[: i + 1])
    return [end - RESPONSE_LENS[i] - 1 + t for t in range(RESPONSE_LENS[i])]


def answer_flat_index() -> tuple[list[int], list[int]]:
    answer, reasoning = [], []
    for i, pos in enumerate(ANSWER_POS):
        flat = response_positions(i)
        answer += [flat[t] for t in pos]
        reasoning += [flat[t] for t in range(RESPONSE_LENS[i]) if t not in pos]
    return answer, reasoning


def run_loss(fn, config, data, log_probs, entropy=None, **kwargs):
    output = {"log_probs": log_probs}
    if entropy is not None:
        output["entropy"] = entropy
    loss, metrics = fn(config, output, data.clone(), **kwargs)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, metrics, grad


def metric_value(m) -> float:
    """A loss metric as verl aggregates it (`Metric`) or a plain number."""
    return float(m.aggregate()) if hasattr(m, "aggregate") else float(m)


def test_verl_low_var_kl_is_omgrpo_k3():
    logp, ref = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), kl_k3(logp, ref))


@pytest.mark.parametrize("answer_weight", [0.0, 1.0])
@pytest.mark.slow
def test_equals_verl_ppo_loss_when_nothing_is_masked(actor_config_factory, answer_weight):
    """No answer tokens (any w) or w = 1 (any mask): verl's ppo_loss, value and gradient."""
    no_answers = [[] for _ in ANSWER_POS]
    data, logp = make_micro_batch(answer=no_answers if answer_weight == 0.0 else ANSWER_POS)
    entropy = torch.rand(logp.shape[0])
    ref_loss, ref_metrics, ref_grad = run_loss(
        ppo_loss, actor_config_factory(), data, logp, entropy
    )
    loss, metrics, grad = run_loss(
        omgrpo_ppo_loss, actor_config_factory(), data, logp, entropy, answer_weight=answer_weight
    )
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)
    assert ref_grad.abs().sum() > 0
    for key, value in ref_metrics.items():  # verl's metrics are all there, unchanged
        assert metric_value(metrics[key]) == pytest.approx(metric_value(value), abs=0), key
    split = {f"kl/{k}_{s}" for k in ("answer", "reasoning") for s in ("sum", "count")}
    assert split <= set(metrics)


def test_answer_batch_without_mask_field_is_verl_loss(actor_config_factory):
    data, logp = make_micro_batch()
    data = data.exclude(ANSWER_MASK_KEY)
    ref_loss, _, _ = run_loss(ppo_loss, actor_config_factory(), data, logp)
    loss, _, _ = run_loss(omgrpo_ppo_loss, actor_config_factory(), data, logp, answer_weight=0.0)
    assert loss.item() == ref_loss.item()


def weighted_batch(answer_weight: float, advantages=None):
    """A micro-batch whose advantages were weighted by the trainer (as in a real step)."""
    data, logp = make_micro_batch(advantages=advantages)
    padded = data.select("advantages", "response_mask", ANSWER_MASK_KEY).to_padded_tensor()
    weighted = weight_advantages(
        padded["advantages"], padded["response_mask"], padded[ANSWER_MASK_KEY], answer_weight
    )
    rows = [weighted[i, :r] for i, r in enumerate(RESPONSE_LENS)]
    data["advantages"] = _nested(rows)
    return data, logp


def test_zero_gradient_on_answer_tokens_with_w0(actor_config_factory):
    answer, reasoning = answer_flat_index()
    # PG and KL together.
    data, logp = weighted_batch(0.0)
    _, metrics, grad = run_loss(
        omgrpo_ppo_loss, actor_config_factory(), data, logp, answer_weight=0.0
    )
    assert torch.all(grad[answer] == 0)
    assert torch.all(grad[reasoning] != 0)
    assert metric_value(metrics["kl/answer_sum"]) > 0  # the KL is still measured on answer tokens

    # PG alone (KL off): answer tokens get nothing; reasoning tokens do.
    config = actor_config_factory()
    object.__setattr__(config, "use_kl_loss", False)  # frozen dataclass; a test-only switch
    _, _, grad_pg = run_loss(omgrpo_ppo_loss, config, data, logp, answer_weight=0.0)
    assert torch.all(grad_pg[answer] == 0) and grad_pg[reasoning].abs().sum() > 0

    # KL alone (all advantages 0): answer tokens get nothing; reasoning tokens do.
    data0, logp0 = weighted_batch(0.0, advantages=[0.0] * len(PROMPT_LENS))
    _, _, grad_kl = run_loss(
        omgrpo_ppo_loss, actor_config_factory(), data0, logp0, answer_weight=0.0
    )
    assert torch.all(grad_kl[answer] == 0) and grad_kl[reasoning].abs().sum() > 0


def test_token_mask_takes_tokens_out_of_the_kl_term(actor_config_factory):
    """`omgrpo_token_mask` (the generic masks; the driver has zeroed their advantages): KL
    weight 0 on its tokens, the other tokens' gradient unchanged (the denominator is all
    response tokens); KL alone here (advantages 0), so only the KL term moves anything."""
    masked_pos = [[0, 5], [], [1, 2, 3], [4]]
    data, logp = weighted_batch(1.0, advantages=[0.0] * len(PROMPT_LENS))
    _, _, full = run_loss(omgrpo_ppo_loss, actor_config_factory(), data, logp, answer_weight=1.0)
    rows = []
    for pos, n in zip(masked_pos, RESPONSE_LENS):
        row = torch.zeros(n, dtype=torch.int64)
        row[pos] = 1
        rows.append(row)
    data[TOKEN_MASK_KEY] = _nested(rows)
    _, metrics, grad = run_loss(
        omgrpo_ppo_loss, actor_config_factory(), data, logp, answer_weight=1.0
    )
    masked = [response_positions(i)[t] for i, pos in enumerate(masked_pos) for t in pos]
    every = [p for i in range(4) for p in response_positions(i)]
    kept = sorted(set(every) - set(masked))
    assert (grad[masked] == 0).all() and (full[masked] != 0).all()
    torch.testing.assert_close(grad[kept], full[kept], rtol=0, atol=0)
    # the KL metrics still measure every token (unweighted k3 per role)
    assert metric_value(metrics["kl/reasoning_count"]) + metric_value(
        metrics["kl/answer_count"]
    ) == sum(RESPONSE_LENS)


def test_kl_split_is_a_token_mean_over_micro_batches(actor_config_factory):
    """A micro-batch without answer tokens adds nothing to kl/answer (no 0 pulled into a mean
    of means): sums and counts are reduced alike and divided once per step."""
    with_answers, logp1 = make_micro_batch(seed=1)
    without, logp2 = make_micro_batch(seed=2, answer=[[] for _ in ANSWER_POS])
    reduced: dict[str, Metric] = {}
    kld, masks = [], []
    for data, logp in ((with_answers, logp1), (without, logp2)):
        _, metrics, _ = run_loss(
            omgrpo_ppo_loss, actor_config_factory(), data, logp, answer_weight=0.0
        )
        for key in ("kl/answer_sum", "kl/answer_count", "kl/reasoning_sum", "kl/reasoning_count"):
            reduced.setdefault(key, metrics[key].init_list()).append(metrics[key])
        padded = data.select("ref_log_prob", ANSWER_MASK_KEY).to_padded_tensor()
        lp = torch.stack(
            [
                torch.nn.functional.pad(logp.detach()[response_positions(i)], (0, 7 - r))
                for i, r in enumerate(RESPONSE_LENS)
            ]
        )
        kld.append(kl_k3(lp, padded["ref_log_prob"]))
        masks.append(padded[ANSWER_MASK_KEY].bool())
    assert metric_value(reduced["kl/answer_count"]) == sum(len(p) for p in ANSWER_POS)
    out = loss_metric_means({f"actor/{k}": m.aggregate() for k, m in reduced.items()})
    assert set(out) == {"kl/answer", "kl/reasoning"}
    expected = torch.cat([k[m] for k, m in zip(kld, masks)]).mean()
    assert out["kl/answer"] == pytest.approx(float(expected), rel=1e-5)
    # a step without any answer token: nan, not 0
    empty = loss_metric_means({"actor/kl/answer_sum": 0.0, "actor/kl/answer_count": 0.0})
    assert math.isnan(empty["kl/answer"])


def test_reasoning_gradient_does_not_depend_on_w(actor_config_factory):
    """Masking never renormalises: the denominator stays all response tokens."""
    _, reasoning = answer_flat_index()
    grads = []
    for w in (0.0, 0.5, 1.0):
        data, logp = weighted_batch(w)
        _, _, grad = run_loss(omgrpo_ppo_loss, actor_config_factory(), data, logp, answer_weight=w)
        grads.append(grad[reasoning])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], grads[2], rtol=0, atol=0)


def test_half_weight_scales_answer_gradient(actor_config_factory):
    answer, _ = answer_flat_index()
    data1, logp1 = weighted_batch(1.0)
    data5, logp5 = weighted_batch(0.5)
    _, _, g1 = run_loss(omgrpo_ppo_loss, actor_config_factory(), data1, logp1, answer_weight=1.0)
    _, _, g5 = run_loss(omgrpo_ppo_loss, actor_config_factory(), data5, logp5, answer_weight=0.5)
    torch.testing.assert_close(g5[answer], 0.5 * g1[answer])


# ------------------------------------------------------------------------------------------
# Advantage weighting on a DataProto (what the trainer does after verl's GRPO step)
# ------------------------------------------------------------------------------------------
def grpo_proto(format_scores=(1.0, 0.0, 1.0, 1.0, 1.0, 1.0)):
    """Two prompts x G=3, advantages as verl's GRPO writes them (A_i on every response token)."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.4])
    uids = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]))
    T = 5
    lengths = [5, 3, 4, 5, 2, 4]
    response_mask = torch.zeros(6, T, dtype=torch.int64)
    for i, n in enumerate(lengths):
        response_mask[i, :n] = 1
    answer = torch.zeros(6, T, dtype=torch.int64)
    answer[0, 3:5] = 1
    answer[2, 1] = 1
    answer[3, 4] = 1
    answer[4, 1:4] = 1  # reaches past the response (length 2): only token 1 counts
    batch = TensorDict(
        {
            "advantages": adv.unsqueeze(-1) * response_mask,
            "response_mask": response_mask,
            ANSWER_MASK_KEY: answer,
            FORMAT_SCORE_KEY: torch.tensor(format_scores),
        },
        batch_size=6,
    )
    return DataProto(batch=batch, non_tensor_batch={"uid": uids}), adv, response_mask, answer


@pytest.mark.parametrize("w", [0.0, 0.25, 1.0])
def test_advantage_weighting_on_dataproto(w):
    proto, adv, resp, answer = grpo_proto()
    out = apply_answer_weighting(proto, w)
    got = out.batch["advantages"]
    ans = answer.bool() & resp.bool()
    expected = adv.unsqueeze(-1).expand(6, 5) * resp
    expected = torch.where(ans, expected * w, expected)
    torch.testing.assert_close(got, expected)
    assert torch.equal(out.batch[ANSWER_MASK_KEY], (answer * resp))
    assert got[4, 2:].abs().sum() == 0  # outside the response


def test_format_only_advantages_on_dataproto():
    fmt = (1.0, 0.0, 1.0, 1.0, 1.0, 1.0)
    proto, adv, resp, answer = grpo_proto(fmt)
    out = apply_answer_weighting(proto, 0.0, format_only=True)
    got = out.batch["advantages"]
    fmt_adv = group_advantages(torch.tensor(fmt), torch.tensor([0, 0, 0, 1, 1, 1]))
    assert fmt_adv[3:].abs().sum() == 0 and fmt_adv[:3].abs().sum() > 0
    ans = answer.bool() & resp.bool()
    for i in range(6):
        for t in range(5):
            if not resp[i, t]:
                assert got[i, t] == 0
            elif ans[i, t]:
                assert got[i, t] == pytest.approx(float(fmt_adv[i]))
            else:
                assert got[i, t] == pytest.approx(float(adv[i]))


def jagged_rollouts_with_padding_row(format_only: bool = False) -> TensorDict:
    """Rows as TransferQueue holds them after verl's balance step: 2 prompts x G=2, then a
    padding row (`upsample_batch_to_divisible_size`): a copy of row 0's fields with a
    one-token response, response_mask 0 and its own uid, so its copied answer mask and format
    score are longer / staler than its response."""
    lengths, answer_pos = [5, 3, 4, 2], [[3, 4], [1], [], [0, 1]]
    adv = [1.0, -1.0, 0.5, -0.5]
    rows = {"response_mask": [], "advantages": [], ANSWER_MASK_KEY: []}
    for n, pos, a in zip(lengths, answer_pos, adv):
        rows["response_mask"].append(torch.ones(n, dtype=torch.int64))
        rows["advantages"].append(torch.full((n,), a))
        mask = torch.zeros(n, dtype=torch.int64)
        mask[pos] = 1
        rows[ANSWER_MASK_KEY].append(mask)
    rows["response_mask"].append(torch.zeros(1, dtype=torch.int64))
    rows["advantages"].append(torch.zeros(1))
    rows[ANSWER_MASK_KEY].append(rows[ANSWER_MASK_KEY][0].clone())  # 5 tokens, response 1
    fields = {k: _nested(v) for k, v in rows.items()}
    fields["uid"] = ["a", "a", "b", "b", "pad0"]
    if format_only:
        fields[FORMAT_SCORE_KEY] = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    return tu.get_tensordict(fields)


@pytest.mark.parametrize("format_only", [False, True])
def test_padding_row_copied_from_another_rollout_gets_no_answer_tokens(format_only):
    data = jagged_rollouts_with_padding_row(format_only)
    out = weight_jagged(data, 0.0, format_only=format_only)
    lengths = [5, 3, 4, 2, 1]
    for key in ("advantages", ANSWER_MASK_KEY):
        assert out[key].is_nested and out[key].offsets().diff().tolist() == lengths
    adv = out["advantages"].unbind()
    answer = out[ANSWER_MASK_KEY].unbind()
    assert adv[4].tolist() == [0.0] and answer[4].tolist() == [0]  # padding row: nothing left
    assert answer[0].tolist() == [0, 0, 0, 1, 1]
    if format_only:  # group a: formats 1, 0 -> +-1/sqrt(2) on answer tokens
        assert adv[0][3:].tolist() == pytest.approx([2**-0.5] * 2, rel=1e-5)
    else:
        assert adv[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert adv[3].tolist() == [0.0, 0.0] and adv[2].tolist() == [0.5] * 4


def test_missing_answer_mask_names_the_agent_loop():
    proto, _, _, _ = grpo_proto()
    proto.batch = proto.batch.exclude(ANSWER_MASK_KEY)
    with pytest.raises(KeyError, match="agent_loop_manager_class"):
        apply_answer_weighting(proto, 0.0)


@pytest.mark.parametrize(("w", "share"), [(0.0, 0.0), (0.5, 3.0 / 19.5), (1.0, 6.0 / 22.5)])
def test_answer_share_of_pg_weight(actor_config_factory, w, share):
    """`pg/answer_weight_share` by hand: |A| = [1.5, 0.5, 0.75, 1.25] on [6, 4, 7, 5] response
    tokens, [2, 1, 0, 2] of them answer tokens weighted by w: answer 6w, reasoning
    4*1.5 + 3*0.5 + 7*0.75 + 3*1.25 = 16.5; `answer/frac` = 5 / 22."""
    data, logp = weighted_batch(w)
    _, metrics, _ = run_loss(omgrpo_ppo_loss, actor_config_factory(), data, logp, answer_weight=w)
    out = loss_metric_means({f"actor/{k}": metric_value(m) for k, m in metrics.items()})
    assert out["pg/answer_weight_share"] == pytest.approx(share, abs=0 if w == 0 else 1e-6)
    assert out["answer/frac"] == pytest.approx(5 / 22)
    assert not any(k.endswith(("_sum", "_count")) for k in out)  # replaced by the means
