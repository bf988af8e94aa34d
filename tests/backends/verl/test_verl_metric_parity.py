"""The native update and the verl loss define `kl/*`, `entropy/*` and `answer/frac` the same
way: the same hand-built micro-batches (unequal token counts, one without answer tokens) give
equal token-weighted values through `grpo_loss` + the native `UpdateMetrics` and through
`omgrpo_ppo_loss` + verl's SUM reduction + `loss_metric_means` (docs/metrics.md). The generic
masks, the proxy-reward quality (`reward_quality/*`) and the per-problem validation table are
equal in both on the same step."""

from __future__ import annotations

try:
    import verl  # noqa: F401
except ModuleNotFoundError as exc:  # CI runs these with real verl: say how to get it
    raise ModuleNotFoundError(
        "tests/backends/verl need verl: install with pip install -e '.[dev,verl]'"
    ) from exc

import numpy as np
import pandas as pd
import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.metric import Metric

from omgrpo.backends.native.update import UpdateMetrics
from omgrpo.backends.verl import ANSWER_MASK_KEY, TOKEN_MASK_KEY, span_mask_key
from omgrpo.backends.verl.config import compose_verl
from omgrpo.backends.verl.loss import loss_metric_means, omgrpo_ppo_loss
from omgrpo.core.losses import grpo_loss

# Response lengths and answer-token positions of each micro-batch's rows: 12, 3 and 9 response
# tokens, 3, 0 and 1 answer tokens, so a mean of micro-batch means differs from the token mean.
MICRO_BATCHES = [
    [(5, [2, 3]), (7, [6])],
    [(3, [])],
    [(2, [1]), (4, []), (3, [])],
]
COMPARED = ("kl/answer", "kl/reasoning", "entropy/answer", "entropy/reasoning", "answer/frac")


def make_rows(seed: int = 0) -> list[list[dict[str, torch.Tensor]]]:
    """Per row of each micro-batch: log-probs (current, old, ref), entropy, advantage and the
    answer mask, as 1-D tensors over the response."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for micro in MICRO_BATCHES:
        rows = []
        for length, answer_pos in micro:
            answer = torch.zeros(length, dtype=torch.bool)
            answer[answer_pos] = True
            rows.append(
                {
                    "logp": -torch.rand(length, generator=g) * 2 - 0.1,
                    "old": -torch.rand(length, generator=g) * 2 - 0.1,
                    "ref": -torch.rand(length, generator=g) * 2 - 0.1,
                    "entropy": torch.rand(length, generator=g) * 3,
                    "adv": torch.randn((), generator=g).expand(length),
                    "answer": answer,
                }
            )
        out.append(rows)
    return out


def _padded(rows: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([r[key] for r in rows], batch_first=True)


def native_metrics(micro_batches) -> dict[str, float]:
    combined = UpdateMetrics()
    for rows in micro_batches:
        resp = _padded([{"m": torch.ones(len(r["logp"]), dtype=torch.bool)} for r in rows], "m")
        _, metrics = grpo_loss(
            _padded(rows, "logp"),
            _padded(rows, "old"),
            _padded(rows, "ref"),
            torch.stack([r["adv"][0] for r in rows]),
            resp,
            _padded(rows, "answer"),
            entropy=_padded(rows, "entropy"),
        )
        combined.add_micro_batch(metrics, 1.0)
    combined.end_mini_batch(0.0)
    return combined.result()


def _nested(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def verl_micro_batch(rows, prompt_len: int, batch_tokens: int, batch_size: int):
    """A micro-batch as verl's engine hands it to the loss and its no-padding model output
    (the log-prob of response token t sits at prompt_len - 1 + t of its row)."""
    fields = {"prompts": [], "responses": [], "response_mask": [], "old_log_probs": []}
    fields.update({"ref_log_prob": [], "advantages": [], ANSWER_MASK_KEY: []})
    flat_logp, flat_ent = [], []
    for r in rows:
        n = len(r["logp"])
        fields["prompts"].append(torch.full((prompt_len,), 5))
        fields["responses"].append(torch.full((n,), 7))
        fields["response_mask"].append(torch.ones(n, dtype=torch.int64))
        fields["old_log_probs"].append(r["old"])
        fields["ref_log_prob"].append(r["ref"])
        fields["advantages"].append(r["adv"].clone())
        fields[ANSWER_MASK_KEY].append(r["answer"].long())
        for key, flat in (("logp", flat_logp), ("entropy", flat_ent)):
            flat += [torch.zeros(prompt_len - 1), r[key], torch.zeros(1)]
    data = TensorDict({k: _nested(v) for k, v in fields.items()}, batch_size=len(rows))
    tu.assign_non_tensor(
        data, dp_size=1, batch_num_tokens=batch_tokens, global_batch_size=batch_size
    )
    return data, {"log_probs": torch.cat(flat_logp), "entropy": torch.cat(flat_ent)}


def verl_metrics(micro_batches, config_factory) -> dict[str, float]:
    """Each micro-batch through `omgrpo_ppo_loss`, the SUM metrics reduced as verl's worker
    reduces them over micro-batches, then the trainer's `loss_metric_means`."""
    batch_tokens = sum(len(r["logp"]) for rows in micro_batches for r in rows)
    batch_size = sum(len(rows) for rows in micro_batches)
    reduced: dict = {}
    for rows in micro_batches:
        data, output = verl_micro_batch(rows, 3, batch_tokens, batch_size)
        _, metrics = omgrpo_ppo_loss(config_factory(), output, data, answer_weight=0.0)
        for key, metric in metrics.items():
            if isinstance(metric, Metric):
                reduced.setdefault(key, metric.init_list()).append(metric)
            else:
                reduced[key] = metric
    # the actor worker logs the loss's metrics under `actor/`
    return loss_metric_means({f"actor/{k}": _value(m) for k, m in reduced.items()})


def _value(metric) -> float:
    return float(metric.aggregate()) if isinstance(metric, Metric) else float(metric)


@pytest.fixture(scope="module")
def actor_config_factory():
    node = compose_verl("paper_qwen3_1p7b").actor_rollout_ref.actor
    return lambda: omega_conf_to_dataclass(node)  # fresh: ppo_loss writes into it


@pytest.mark.slow
def test_native_update_and_verl_loss_log_the_same_token_metrics(actor_config_factory):
    micro_batches = make_rows()
    native = native_metrics(micro_batches)
    verl_side = verl_metrics(micro_batches, actor_config_factory)
    for name in COMPARED:
        assert native[name] == pytest.approx(verl_side[name], rel=1e-6), name
    assert native["answer/frac"] == pytest.approx(4 / 24)
    # by hand: the token mean over all micro-batches
    rows = [r for micro in micro_batches for r in micro]
    entropy = torch.cat([r["entropy"] for r in rows])
    answer = torch.cat([r["answer"] for r in rows])
    assert native["entropy/answer"] == pytest.approx(float(entropy[answer].mean()), rel=1e-6)
    # ... which the old definition (mean of micro-batch means, 0 for none) would not give
    old = []
    for micro in micro_batches:
        ent, ans = (torch.cat([r[k] for r in micro]) for k in ("entropy", "answer"))
        old.append(float(ent[ans].mean()) if ans.any() else 0.0)
    assert abs(float(np.mean(old)) - native["entropy/answer"]) > 0.1


def test_the_verl_loss_metric_names_are_in_the_metric_table(actor_config_factory, metric_table):
    names = set(verl_metrics(make_rows(1), actor_config_factory))
    assert metric_table.undocumented(names, "verl") == []
    assert set(COMPARED) | {"pg/answer_weight_share"} <= names


# ----------------------------------------------------------------------------------------------
# Study v4's generic masks: the same masks, metrics and loss in both backends
# ----------------------------------------------------------------------------------------------
MASK_TEXTS = [  # 2 prompts x G = 3, one token per character (char tokenizer)
    "2+2=4\nSo the answer is \\boxed{4}.",
    "\\boxed{15}",
    "no answer",
    "3*3=9\nSo \\boxed{9}",
    "\\boxed{19}.",
    "9-1=8 \\boxed{8}",
]
MASK_METHODS = [
    "om_grpo_no_car_closing_only",
    "om_grpo_no_car_top_entropy",
    "om_grpo_no_car_random_mask",
]


def native_step(method: str, entropy_seed: int = 0):
    """The native trainer's scored step on MASK_TEXTS (eos-ended), its per-token entropy and
    its config."""
    from omgrpo.config import compose
    from omgrpo.core.step import score_step
    from omgrpo.models.tokenizer import build_char_tokenizer
    from omgrpo.tasks import Problem

    tok = build_char_tokenizer()
    rows = [
        torch.tensor([*tok.encode(t, add_special_tokens=False), tok.eos_token_id])
        for t in MASK_TEXTS
    ]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    cfg = compose([f"method={method}"])
    problems = [
        Problem(id="p0", question="?", answer="4"),
        Problem(id="p1", question="?", answer="9"),
    ]
    batch = score_step(tok, ids, mask, problems, cfg)
    entropy = torch.rand(ids.shape, generator=torch.Generator().manual_seed(entropy_seed)) * 3
    return batch, entropy, cfg


def stored_step(batch, entropy) -> TensorDict:
    """The step's rows as verl's TransferQueue holds them at the advantage step: what the agent
    loop handed (answer mask, the spans the masks read), verl's GRPO advantages and old-pass
    entropy, and a balance-batch padding row last (row 0's fields, a one-token response with
    response_mask 0, entropy 99 that must never count)."""
    r = batch.responses
    fields = {"response_mask": [], "advantages": [], ANSWER_MASK_KEY: [], "entropy": []}
    fields.update({span_mask_key(s): [] for s in r.span_masks})
    for k, n in enumerate(r.mask.sum(-1).tolist()):
        fields["response_mask"].append(torch.ones(n, dtype=torch.int64))
        fields["advantages"].append(torch.full((n,), float(batch.advantages[k])))
        fields[ANSWER_MASK_KEY].append(r.answer_mask[k, :n].long())
        fields["entropy"].append(entropy[k, :n])
        for span, m in r.span_masks.items():
            fields[span_mask_key(span)].append(m[k, :n].long())
    for rows in fields.values():
        rows.append(rows[0].clone())
    fields["response_mask"][-1] = torch.zeros(1, dtype=torch.int64)
    fields["advantages"][-1] = torch.zeros(1)
    fields["entropy"][-1] = torch.full((1,), 99.0)
    out = {k: _nested(v) for k, v in fields.items()}
    out["uid"] = [str(g) for g in batch.group_ids.tolist()] + ["pad"]
    return tu.get_tensordict(out)


@pytest.mark.parametrize("method", MASK_METHODS)
@pytest.mark.slow
def test_native_and_verl_draw_the_same_masks_and_log_the_same_mask_metrics(method):
    from omgrpo.backends.verl.advantage import generic_masks, weight_jagged
    from omgrpo.core.step import masked_step

    batch, entropy, cfg = native_step(method)
    native, native_metrics = masked_step(batch, cfg.algorithm, seed=13, step=7, entropy=entropy)
    algo = compose_verl("paper_qwen3_1p7b", [f"method={method}"]).omgrpo.algorithm
    data = stored_step(batch, entropy)
    masked, verl_metrics = generic_masks(data, algo, seed=13, step=7)
    assert set(native_metrics) == {"mask/frac", "mask/answer_overlap"}
    assert verl_metrics == native_metrics  # one implementation: equal, not close
    assert native_metrics["mask/frac"] > 0
    lengths = batch.responses.mask.sum(-1).tolist()
    if native.token_mask is None:  # closing_only: the answer weight masks
        assert masked is None
    else:
        for k, n in enumerate(lengths):
            assert torch.equal(masked[k, :n], native.token_mask[k, :n]), k
        assert not masked[-1].any()  # the padding row
    # the driver's advantage step: 0 on the masked tokens, the mask stored for the loss
    names = list(data.keys())  # (iterating a TensorDict gives rows)
    drop = ["entropy", *(k for k in names if k.startswith("omgrpo_span_"))]
    out = weight_jagged(data.exclude(*drop), float(algo.answer_weight), False, 1e-6, masked)
    assert (TOKEN_MASK_KEY in list(out.keys())) == (masked is not None)
    w = float(algo.answer_weight)
    for k, (adv, n) in enumerate(zip(out["advantages"].unbind(), lengths)):
        gone = batch.responses.answer_mask[k, :n] if w == 0 else native.token_mask[k, :n]
        expected = torch.where(gone, 0.0, float(batch.advantages[k]))
        assert torch.equal(adv, expected), k


@pytest.mark.parametrize("w", [0.0, 1.0])
@pytest.mark.slow
def test_native_and_verl_losses_agree_with_a_token_mask(actor_config_factory, w):
    """One micro-batch, ratio below verl's dual-clip bound: the native `grpo_loss` with a token
    mask and verl's loss (advantages weighted and masked by the driver, KL masked through
    `omgrpo_token_mask`) give the same loss and per-token gradient, 0 on masked tokens."""
    from omgrpo.backends.verl.advantage import weight_advantages

    (rows,) = make_rows(2)[:1]
    g = torch.Generator().manual_seed(5)
    masks = []
    for r in rows:
        r["old"] = r["logp"] + (torch.rand(len(r["logp"]), generator=g) - 0.5) * 0.6
        masks.append(torch.rand(len(r["logp"]), generator=g) < 0.3)
    config = actor_config_factory()
    n_tokens = sum(len(r["logp"]) for r in rows)
    # native
    logp = _padded(rows, "logp").requires_grad_(True)
    resp = _padded([{"m": torch.ones(len(r["logp"]), dtype=torch.bool)} for r in rows], "m")
    masked = _padded([{"m": m} for m in masks], "m")
    native_loss, _ = grpo_loss(
        logp,
        _padded(rows, "old"),
        _padded(rows, "ref"),
        torch.stack([r["adv"][0] for r in rows]),
        resp,
        _padded(rows, "answer"),
        answer_weight=w,
        clip=config.clip_ratio,
        kl_coef=config.kl_loss_coef,
        num_tokens=n_tokens,
        token_mask=masked,
    )
    (native_grad,) = torch.autograd.grad(native_loss, logp)
    # verl: the driver's weighted, masked advantages and the token mask field
    weighted = weight_advantages(
        _padded(rows, "adv"), resp, _padded(rows, "answer"), w, token_mask=masked
    )
    data, output = verl_micro_batch(rows, 3, n_tokens, len(rows))
    data["advantages"] = _nested([weighted[i, : len(r["logp"])] for i, r in enumerate(rows)])
    data[TOKEN_MASK_KEY] = _nested([m.long() for m in masks])
    flat = output["log_probs"].clone().requires_grad_(True)
    verl_loss, _ = omgrpo_ppo_loss(config, {"log_probs": flat}, data, answer_weight=w)
    (flat_grad,) = torch.autograd.grad(verl_loss, flat)
    assert verl_loss.item() == pytest.approx(native_loss.item(), rel=1e-6)
    start = 0
    for i, r in enumerate(rows):  # row i's response log-probs sit after its 3 - 1 prompt slots
        n = len(r["logp"])
        got = flat_grad[start + 2 : start + 2 + n]
        torch.testing.assert_close(got, native_grad[i, :n], rtol=1e-5, atol=1e-9)
        assert (got[masks[i]] == 0).all()
        start += 3 + n


# ----------------------------------------------------------------------------------------------
# Proxy-reward quality and the per-problem table: the same numbers in both backends
# ----------------------------------------------------------------------------------------------
QUALITY_GROUPS = {  # label -> G = 4 responses: spread, zero spread (all agree), wrong majority
    "4": ["\\boxed{4}", "so \\boxed{4}.", "\\boxed{5}", "no answer"],
    "9": ["\\boxed{9}"] * 4,
    "7": ["\\boxed{1}", "\\boxed{1}", "\\boxed{7}", "\\boxed{2}"],
}
QUALITY = (
    "reward_quality/reward_acc",
    "reward_quality/majority_ratio",
    "reward_quality/reward_correct_corr",
    "reward_quality/zero_spread_groups",
    "answers/top_vote_acc",
)


def _padded_ids(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [
        torch.tensor([*tok.encode(t, add_special_tokens=False), tok.eos_token_id]) for t in texts
    ]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    return ids, torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], True)


@pytest.mark.parametrize("method", ["om_grpo_no_car", "mv"])
def test_native_and_verl_log_the_same_proxy_reward_quality(method):
    """The native trainer scores the step at once (`score_step` + `step_metrics`); verl's agent
    loop scores each group on its own (`score_group`), hands records through TransferQueue
    (`to_dict`) in an interleaved row order, and the driver rebuilds the step
    (`records_metrics`): the `reward_quality/*` values (and the vote's accuracy, TTRL's label
    accuracy) are equal, not close."""
    from omgrpo.backends.verl.agent_loop import rollout_records, score_group
    from omgrpo.backends.verl.metrics import records_metrics
    from omgrpo.config import compose
    from omgrpo.core.step import LoopState, score_step, step_metrics
    from omgrpo.models.tokenizer import build_char_tokenizer
    from omgrpo.tasks import Problem

    tok = build_char_tokenizer()
    problems = [
        Problem(id=f"toy/{i}", question="?", answer=y) for i, y in enumerate(QUALITY_GROUPS)
    ]
    ids, mask = _padded_ids(tok, [t for texts in QUALITY_GROUPS.values() for t in texts])
    native = score_step(tok, ids, mask, problems, compose([f"method={method}"]))
    native_m = step_metrics(native, LoopState(), 0.6)

    om = compose_verl("paper_qwen3_1p7b", [f"method={method}"]).omgrpo
    rows = []  # (uid, record, reward) per rollout
    for problem, texts in zip(problems, QUALITY_GROUPS.values()):
        group, timeouts = score_group(tok, *_padded_ids(tok, texts), problem, om, None)
        records = rollout_records(group, timeouts, None, (0.0, 0.0))
        rows += [(problem.id, r.to_dict(), float(x)) for r, x in zip(records, group.rewards)]
    rows = rows[1::2] + rows[::2]  # verl's batch order is not the groups' order
    verl_m = records_metrics(
        [u for u, _, _ in rows],
        [r for _, r, _ in rows],
        [x for _, _, x in rows],
        confident_share=0.6,
        state=LoopState(),
    )
    for name in QUALITY:
        a, b = native_m[name], verl_m[name]
        assert a == b or (np.isnan(a) and np.isnan(b)), name
    assert native_m["reward_quality/zero_spread_groups"] == pytest.approx(1 / 3)
    assert native_m["reward_quality/majority_ratio"] == pytest.approx((2 / 4 + 1 + 2 / 4) / 3)
    assert native_m["answers/top_vote_acc"] == pytest.approx(2 / 3)


def test_native_and_verl_validation_write_the_same_problem_rows():
    """The per-problem table from the native validation's grouped answers and from verl's
    per-sample validation outputs (`compute_score` with the row's `extra_info`, samples of a
    prompt under one fresh uid, interleaved) is the same table."""
    from omgrpo.backends.verl.data import verl_rows
    from omgrpo.backends.verl.metrics import validation_problems
    from omgrpo.backends.verl.reward import compute_score
    from omgrpo.core.answers import Grader
    from omgrpo.core.problems import problem_table
    from omgrpo.core.step import extract_answer, is_correct
    from omgrpo.tasks import Problem

    problems = [
        Problem(id=f"val-{i}", question="?", answer=y) for i, y in enumerate(QUALITY_GROUPS)
    ]
    grader = Grader()
    answers = [[extract_answer(t) for t in texts] for texts in QUALITY_GROUPS.values()]
    correct = [
        [bool(is_correct(a, p.answer, grader)) for a in group]
        for group, p in zip(answers, problems)
    ]
    native = problem_table(3, [p.id for p in problems], answers, correct)

    samples = []  # (uid, compute_score's output) per sample
    for i, (row, texts) in enumerate(zip(verl_rows(problems, "toy"), QUALITY_GROUPS.values())):
        for text in texts:
            out = compute_score("toy", text, row["reward_model"]["ground_truth"], row["extra_info"])
            samples.append((f"uuid-{i}", out))
    samples = samples[::3] + samples[1::3] + samples[2::3]
    extra = {k: [s[k] for _, s in samples] for k in ("problem", "pred", "acc")}
    verl_side = validation_problems(3, [u for u, _ in samples], extra)
    verl_side = verl_side.set_index("problem_id").loc[native["problem_id"]].reset_index()
    pd.testing.assert_frame_equal(native, verl_side, check_dtype=False)
    assert native["modal_answer"].tolist() == ["4", "9", "1"]
    assert validation_problems(3, ["u"], {"pred": ["4"], "acc": [1.0]}) is None  # no ids
