"""The native update and the verl loss define `kl/*`, `entropy/*` and `answer/frac` the same
way: the same hand-built micro-batches (unequal token counts, one without answer tokens) give
equal token-weighted values through `grpo_loss` + the native `UpdateMetrics` and through
`omgrpo_ppo_loss` + verl's SUM reduction + `loss_metric_means` (docs/metrics.md)."""

from __future__ import annotations

try:
    import verl  # noqa: F401
except ModuleNotFoundError as exc:  # CI runs these with real verl: say how to get it
    raise ModuleNotFoundError(
        "tests/backends/verl need verl: install with pip install -e '.[dev,verl]'"
    ) from exc

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.metric import Metric

from omgrpo.backends.native.update import UpdateMetrics
from omgrpo.backends.verl import ANSWER_MASK_KEY
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
