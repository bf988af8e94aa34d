"""How a step moves the answer "1": the guess route's mechanism (study v2), measured natively.

`MechanismProbe.measure` runs before a step's update at step 1 (the base) and every
`diagnostics.mechanism_every` steps; it leaves the training trajectory unchanged (its samples
come from a forked RNG, gradients from `torch.autograd.grad` instead of `.grad`, the optimizer's
state is only read, and shifted weights are restored as the same tensors). "1" is the target
answer: the task probe's peak (the toy worlds' guess prior's peak, the paper's collapse answer).

0. Gates, teacher-forced on gold reasoning: each held-out (validation) problem's gold worked
   solution up to its `\\boxed{`. `mech/gate_first`: on gold values that do not start with
   "1", p(the first answer token starts with "1") -- the guess gate, inside the paper's span;
   `mech/gate_stop`: on gold values that start with "1" and go on with a digit, forced up to
   after the "1", p(the answer ends there) -- the truncation gate, at the closing token the
   paper's span leaves unmasked. With `mech/computed_lead`: the share of the step's rollouts
   whose last computed value starts with "1" (the reasoning steered toward such values).
1. The step's direct effect at fixed held-out prefixes (question + the base's own sampled
   reasoning up to `\\boxed{`, drawn once at setup): P(box exactly "1") = p("1") * p(stop after
   it), p(first token "1") and the first answer token's entropy, before the update and after
   each part of it applied alone. The parts split the update exactly (`adamw_step_parts`): the
   step's AdamW preconditioner and clip factor are those of the full gradient, the real update's;
   the new gradient enters the step linearly through the first moment, so the step is the sum of
   the answer tokens' gradient's share, the other tokens' share, and the history (momentum
   carried from earlier steps, and weight decay). The parts sum to the real step in parameter
   space; their effects on a probability add up only to first order, the rest is logged as
   `mech/d_box1_interaction`. With one optimizer step per training step (one PPO epoch, one
   mini-batch: the presets) "full" is the real update; otherwise it is one AdamW step on the
   whole batch.
2. Leakage: the cosine between the reasoning-token PG gradient of the rollouts that box their
   group's majority answer and the gradient that raises those rollouts' answer-span tokens.
3. Drift from the reference (the run's reference model, or a frozen copy of the base when the
   run has none): exact KL(pi || pi_ref) and the RMS change of the centred logits per answer-span
   and reasoning token of the step's rollouts.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from omgrpo.core.answers import extract_boxed
from omgrpo.core.losses import token_logprobs_and_entropy
from omgrpo.core.means import mean_or_nan
from omgrpo.core.rewards import majority_class
from omgrpo.core.spans import response_offsets
from omgrpo.core.step import StepBatch, step_loss
from omgrpo.core.task import Problem, TaskProbe
from omgrpo.generation.rollout import Sequences, left_pad, response_logits, sample
from omgrpo.tasks import task_probe

__all__ = [
    "PARTS",
    "MechanismProbe",
    "Prefixes",
    "adamw_step_parts",
    "answer_probs",
    "computed_lead_shares",
    "flat_cosine",
    "gradient_parts",
    "head_ids",
    "shifted",
]

PARTS = ("answer", "other", "history")
"""The parts an update is split into (`adamw_step_parts`)."""
_ROWS = 64  # prefixes per forward pass


@dataclass
class Prefixes:
    """Held-out sequences that end right before an answer: prompt ids + response head ids."""

    prompts: list[list[int]] = field(default_factory=list)
    heads: list[list[int]] = field(default_factory=list)
    difficulties: list[str | None] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # the box content that followed the head

    def add(self, prompt: list[int], head: list[int], difficulty: str | None, answer: str):
        self.prompts.append(prompt)
        self.heads.append(head)
        self.difficulties.append(difficulty)
        self.answers.append(answer)

    def __len__(self) -> int:
        return len(self.heads)


def head_ids(ids: Sequence[int], offsets: Sequence[tuple[int, int]], pos: int) -> list[int] | None:
    """The leading tokens of `ids` that end at or before character `pos`, or None when no token
    boundary falls at `pos` (the next token starts before it) or there is no such token."""
    k = 0
    while k < len(ids) and offsets[k][1] <= pos:
        k += 1
    if k == 0 or (k < len(ids) and offsets[k][0] < pos):
        return None
    return [int(i) for i in ids[:k]]


def gold_prefixes(tokenizer: Any, encode: Any, problems: Sequence[Problem]) -> Prefixes:
    """Each problem's gold worked solution (tokenized on its own, as in SFT) up to the last
    `\\boxed{`; problems without a solution, a box or a token boundary there are left out."""
    out = Prefixes()
    for p in problems:
        box = extract_boxed(p.solution or "")
        if box is None:
            continue
        enc = tokenizer(p.solution, return_offsets_mapping=True, add_special_tokens=False)
        head = head_ids(enc["input_ids"], enc["offset_mapping"], box.span[0])
        if head is not None:
            out.add(encode(p), head, p.meta.get("difficulty"), box.content)
    return out


def own_prefixes(
    model: torch.nn.Module,
    tokenizer: Any,
    encode: Any,
    problems: Sequence[Problem],
    seed: int,
    **sampling: Any,
) -> Prefixes:
    """One response per problem sampled from `model` (`sampling`: `sample`'s keyword arguments)
    on a forked RNG seeded with `seed`, up to its last `\\boxed{` (rows without one or without
    a token boundary there are left out)."""
    out = Prefixes()
    if not problems:
        return out
    device = next(model.parameters()).device
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        seqs = sample(model, [encode(p) for p in problems], n=1, **sampling)
    special = frozenset(tokenizer.all_special_ids)
    for i, p in enumerate(problems):
        ids = seqs.response_ids[i, : int(seqs.response_mask[i].sum())].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        box = extract_boxed(text)
        if box is None:
            continue
        offsets = response_offsets(tokenizer, ids, text, special=special)
        head = head_ids(ids, offsets, box.span[0])
        if head is not None:
            out.add(encode(p), head, p.meta.get("difficulty"), box.content)
    return out


def tokens_starting_with(tokenizer: Any, chars: str) -> Tensor:
    """(n,) ids of the non-special tokens whose text starts with one of `chars`."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    special = set(tokenizer.all_special_ids)
    return torch.tensor(
        [i for i, t in enumerate(texts) if t[:1] in chars and i not in special], dtype=torch.long
    )


@torch.no_grad()
def answer_probs(
    model: torch.nn.Module,
    prefixes: Prefixes,
    target: Sequence[int],
    lead: Tensor,
    digits: Tensor,
    pad_id: int,
) -> dict[str, Tensor]:
    """(N,) per prefix, teacher-forced with the target answer's tokens `target` appended:
    `first` p(the first answer token is one of `lead`), `entropy` that token's entropy (nats),
    `stop` p(the token after the target is none of `digits`: the answer ends there) and `box`
    p(the answer is exactly the target) = prod p(target tokens) * stop."""
    n = len(target)
    parts: dict[str, list[Tensor]] = {"first": [], "entropy": [], "stop": [], "box": []}
    device = next(model.parameters()).device
    for r0 in range(0, len(prefixes), _ROWS):
        rows = [
            prompt + head + list(target)
            for prompt, head in zip(
                prefixes.prompts[r0 : r0 + _ROWS], prefixes.heads[r0 : r0 + _ROWS]
            )
        ]
        ids, mask = (t.to(device) for t in left_pad(rows, pad_id))
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=n + 1
        ).logits
        logp = torch.log_softmax(logits[:, -(n + 1) :].float(), dim=-1).cpu()  # (R, n + 1, V)
        probs = logp.exp()
        parts["first"].append(probs[:, 0, lead].sum(-1))
        parts["entropy"].append(-(probs[:, 0] * logp[:, 0]).nan_to_num(nan=0.0).sum(-1))
        stop = 1 - probs[:, n, digits].sum(-1)
        forced = logp[:, :n].gather(-1, torch.tensor(target).expand(len(rows), n)[..., None])
        parts["stop"].append(stop)
        parts["box"].append(forced.sum((1, 2)).exp() * stop)
    return {k: torch.cat(v) if v else torch.zeros(0) for k, v in parts.items()}


def computed_lead_shares(
    texts: Sequence[str], difficulties: Sequence[str | None], probe: TaskProbe, lead: str
) -> dict[str, float]:
    """`mech/computed_lead` (and `_<difficulty>`): share of the responses with a computed value
    (`probe.result_span`) whose last computed value starts with `lead`."""
    hits = []
    for text, d in zip(texts, difficulties):
        span = probe.result_span(text)
        if span is not None:
            hits.append((text[span[0] : span[1]].startswith(lead), d))
    return _by_difficulty("mech/computed_lead", [float(h) for h, _ in hits], [d for _, d in hits])


def _by_difficulty(
    name: str, values: Sequence[float], difficulties: Sequence[str | None]
) -> dict[str, float]:
    """`name`: the mean of `values` (nan: none); `name_<d>` the mean over each difficulty."""
    out = {name: mean_or_nan(values)}
    for d in sorted({d for d in difficulties if d}):
        out[f"{name}_{d}"] = mean_or_nan(v for v, dv in zip(values, difficulties) if dv == d)
    return out


# ----------------------------------------------------------------------------------------------
# Gradients, split by token
# ----------------------------------------------------------------------------------------------
@dataclass
class GradientParts:
    """Per-parameter gradients of one step's loss (`gradient_parts`), each a list aligned with
    the parameters (None: the parameter takes no part in the loss, as torch leaves its `.grad`)."""

    answer: list[Tensor | None]  # of the loss terms at the answer-span tokens
    other: list[Tensor | None]  # of the loss terms at every other response token
    leak_reason: list[Tensor | None]  # PG loss at the reasoning tokens of mode-boxing rollouts
    leak_raise: list[Tensor | None]  # -log p of those rollouts' answer-span tokens
    drift: dict[str, float]  # sums and counts of the drift metrics (`_drift_sums`)


def mode_rows(batch: StepBatch) -> Tensor:
    """(B,) bool: the rollouts whose answer is their group's majority answer."""
    rows = []
    for g in batch.groups:
        top = majority_class(g.classes)
        rows += [top is not None and c == top for c in g.classes]
    return torch.tensor(rows, dtype=torch.bool)


def _add(acc: list[Tensor | None], grads: Sequence[Tensor | None]) -> None:
    for i, g in enumerate(grads):
        if g is not None:
            acc[i] = g.detach().clone() if acc[i] is None else acc[i] + g.detach()


def gradient_parts(
    policy: torch.nn.Module,
    params: list[torch.nn.Parameter],
    seqs: Sequences,
    batch: StepBatch,
    ref_logprobs: Tensor | None,
    algo: Any,
    reference: torch.nn.Module | None = None,
) -> GradientParts:
    """The gradient of the step's loss (`grpo_loss` as `ppo_update` computes it for its first
    optimizer step: ratio 1, the whole batch, micro-batched alike) split by token: d loss /
    d logprob is taken once and sent back through the answer-span tokens and through the other
    response tokens separately, so `answer + other` is the full gradient whatever the
    aggregation; plus the two leakage gradients and, with `reference`, the drift sums."""
    B = len(seqs)
    micro = algo.micro_batch_size or B
    device = next(policy.parameters()).device
    num_tokens = seqs.response_mask.sum().clamp(min=1).to(device)
    mode = mode_rows(batch)
    acc: dict[str, list[Tensor | None]] = {k: [None] * len(params) for k in PARTS[:2]}
    acc.update(leak_reason=[None] * len(params), leak_raise=[None] * len(params))
    drift: dict[str, float] = {}
    policy.train()
    for u0 in range(0, B, micro):
        idx = torch.arange(u0, min(u0 + micro, B))
        part = seqs.select(idx).to(device)
        logits = response_logits(policy, part)
        logprobs, _ = token_logprobs_and_entropy(logits.float(), part.response_ids)
        loss, pg = _losses(logprobs, part, idx, batch, ref_logprobs, algo, num_tokens, B)
        d_loss, d_pg = (
            torch.autograd.grad(x, logprobs, retain_graph=True, allow_unused=True)[0]
            for x in (loss, pg)
        )
        d_loss = torch.zeros_like(logprobs) if d_loss is None else d_loss
        d_pg = torch.zeros_like(logprobs) if d_pg is None else d_pg
        resp = part.response_mask.bool()
        answer = batch.responses.answer_mask[idx].to(device) & resp
        rows = mode[idx].to(device)[:, None]
        outputs = {
            "answer": d_loss * answer,
            "other": d_loss * (resp & ~answer),
            "leak_reason": d_pg * (resp & ~answer & rows),
            "leak_raise": -(answer & rows).to(logprobs.dtype),
        }
        other = _param_grads(logprobs, params, outputs.pop("other"), always=True)
        _add(acc["other"], other)
        for name, out in outputs.items():
            grads = _param_grads(logprobs, params, out)
            # a zero part still reaches what the other one reaches (a zero, not a missing,
            # gradient: AdamW moves such a parameter by its momentum)
            _add(acc[name], grads or [None if g is None else torch.zeros_like(g) for g in other])
        if reference is not None:
            with torch.no_grad():
                ref_logits = response_logits(reference, part)
            _drift_sums(logits.detach(), ref_logits, answer, resp & ~answer, drift)
    return GradientParts(**acc, drift=drift)


def _param_grads(
    logprobs: Tensor, params: list, grad_output: Tensor, always: bool = False
) -> tuple | None:
    """d(grad_output . logprobs) / d params; None for an all-zero `grad_output` unless
    `always` (a backward pass saved)."""
    if not always and not grad_output.any():
        return None
    return torch.autograd.grad(
        logprobs, params, grad_outputs=grad_output, retain_graph=True, allow_unused=True
    )


def _losses(logprobs, part, idx, batch, ref_logprobs, algo, num_tokens, B) -> tuple:
    """The step's loss on one micro-batch as `ppo_update` computes it (ratio 1, scaled as its
    micro-batches are), and its PG term alone (the same loss without the KL term)."""
    args = (batch, idx, logprobs, part.response_mask, algo, num_tokens)
    loss = step_loss(*args, ref_logprobs=ref_logprobs)[0]
    pg = step_loss(*args, ref_logprobs=ref_logprobs, kl_coef=0.0)[0]
    scale = 1.0 if algo.agg == "token-mean" else len(idx) / B
    return loss * scale, pg * scale


@torch.no_grad()
def _drift_sums(
    logits: Tensor, ref_logits: Tensor, answer: Tensor, reasoning: Tensor, sums: dict
) -> None:
    """Add this micro-batch's exact KL(pi || pi_ref) and centred-logit RMS change per token of
    each role to `sums` (`<metric>_sum`, `<metric>_count`)."""
    logp = torch.log_softmax(logits.float(), -1)
    ref_logp = torch.log_softmax(ref_logits.float(), -1)
    kl = (logp.exp() * (logp - ref_logp)).sum(-1)
    centred = logits.float() - logits.float().mean(-1, keepdim=True)
    ref_centred = ref_logits.float() - ref_logits.float().mean(-1, keepdim=True)
    rms = (centred - ref_centred).pow(2).mean(-1).sqrt()
    for role, mask in (("answer", answer), ("reasoning", reasoning)):
        for name, value in (("kl", kl), ("logit_drift", rms)):
            key = f"mech/{name}_{role}"
            sums[key + "_sum"] = sums.get(key + "_sum", 0.0) + float(value[mask].sum())
            sums[key + "_count"] = sums.get(key + "_count", 0.0) + float(mask.sum())


def flat_cosine(a: Sequence[Tensor | None], b: Sequence[Tensor | None]) -> float:
    """Cosine between two gradients given per parameter (None: zero); nan if one is zero."""
    dot = na = nb = 0.0
    for x, y in zip(a, b):
        if x is not None:
            na += float(x.double().pow(2).sum())
        if y is not None:
            nb += float(y.double().pow(2).sum())
        if x is not None and y is not None:
            dot += float((x.double() * y.double()).sum())
    return dot / math.sqrt(na * nb) if na > 0 and nb > 0 else math.nan


# ----------------------------------------------------------------------------------------------
# The update, split
# ----------------------------------------------------------------------------------------------
def adamw_step_parts(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    answer: Sequence[Tensor | None],
    other: Sequence[Tensor | None],
    grad_clip: float,
) -> dict[str, list[Tensor]]:
    """The change one `optimizer.step()` (torch AdamW) would make to `params` with the gradient
    `answer + other`, clipped to norm `grad_clip` (0: not) as the trainer clips, split into
    `PARTS`. With the full gradient's clip factor c, step t, s = lr / (1 - beta1^t) and
    d = sqrt(v_t / (1 - beta2^t)) + eps (v_t from the full gradient, as the real step):
    answer = -s (1 - beta1) c g_answer / d, other = the same with g_other, history =
    -s beta1 m_{t-1} / d - lr wd theta. They sum to the real step; a parameter without a
    gradient (None in both) does not move, as AdamW skips it."""
    if not isinstance(optimizer, torch.optim.AdamW):
        raise TypeError(f"the mechanism probe splits AdamW steps; got {type(optimizer).__name__}")
    used = [a is not None or o is not None for a, o in zip(answer, other)]
    full = [_sum(a, o, p) for a, o, p in zip(answer, other, params)]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g, u in zip(full, used) if u))
    clip = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, list[Tensor]] = {k: [] for k in PARTS}
    for p, a, o, g, u in zip(params, answer, other, full, used):
        group = group_of[id(p)]
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("the mechanism probe splits plain AdamW steps (no amsgrad, maximize)")
        if not u:
            for k in PARTS:
                out[k].append(torch.zeros_like(p))
            continue
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        state = optimizer.state.get(p, {})
        t = float(state["step"]) + 1 if "step" in state else 1.0
        m = state.get("exp_avg", torch.zeros_like(p))
        v = beta2 * state.get("exp_avg_sq", torch.zeros_like(p)) + (1 - beta2) * (clip * g) ** 2
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)) + group["eps"]
        s = lr / (1 - beta1**t)
        out["answer"].append(-s * (1 - beta1) * clip * _sum(a, None, p) / denom)
        out["other"].append(-s * (1 - beta1) * clip * _sum(o, None, p) / denom)
        decay = lr * group["weight_decay"] * p.detach()
        out["history"].append(-s * beta1 * m / denom - decay)
    return out


def _sum(a: Tensor | None, b: Tensor | None, like: Tensor) -> Tensor:
    out = torch.zeros_like(like)
    for x in (a, b):
        if x is not None:
            out = out + x
    return out


@contextmanager
def shifted(params: Sequence[torch.nn.Parameter], delta: Sequence[Tensor]) -> Iterator[None]:
    """`params` moved by `delta` inside the block; afterwards they hold their own tensors
    again (restored, not subtracted, so no round-off is left behind)."""
    saved = [p.data for p in params]
    try:
        for p, d in zip(params, delta):
            p.data = p.data + d.to(p.dtype)
        yield
    finally:
        for p, s in zip(params, saved):
            p.data = s


# ----------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------
class MechanismProbe:
    """What the measurements keep over a run: the held-out prefixes (gold and the base's own),
    the target answer's tokens and the reference the drift is measured from."""

    def __init__(
        self,
        every: int,
        tokenizer: Any,
        target: str,
        gold: Prefixes,
        own: Prefixes,
        reference: torch.nn.Module,
    ):
        self.every, self.target, self.gold, self.own = every, target, gold, own
        self.reference, self.pad_id = reference, tokenizer.pad_token_id
        self.target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
        self.lead = tokens_starting_with(tokenizer, target[:1])
        self.digits = tokens_starting_with(tokenizer, "0123456789")
        # the gates' rows: gold values that do not start like the target (boxing "1" there is
        # a guess, not a copy), and those that start with it and go on with a digit (stopping
        # after the "1" truncates them)
        n = len(target)
        self.first_rows = [not a.startswith(target[:1]) for a in gold.answers]
        self.stop_rows = [a.startswith(target) and a[n : n + 1].isdigit() for a in gold.answers]

    @classmethod
    def build(
        cls,
        cfg: Any,
        policy: torch.nn.Module,
        ref: torch.nn.Module | None,
        tokenizer: Any,
        encode: Any,
        problems: Sequence[Problem],
        stop_ids: list[int],
    ) -> MechanismProbe | None:
        """The probe of a run about to start (None: `diagnostics.mechanism_every` is 0).
        `policy` still holds the base's weights (setup, before any checkpoint is loaded), so
        the own prefixes are the base's whether the run starts or resumes; `problems`: the
        held-out problems."""
        if cfg.diagnostics.mechanism_every <= 0:
            return None
        problems = list(problems)[: cfg.diagnostics.mechanism_prompts]
        own = own_prefixes(
            policy,
            tokenizer,
            encode,
            problems,
            seed=cfg.seed * 1_000_003 + 17,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            eos_id=stop_ids,
            pad_id=tokenizer.pad_token_id,
        )
        reference = ref if ref is not None else copy.deepcopy(policy).eval().requires_grad_(False)
        gold = gold_prefixes(tokenizer, encode, problems)
        every = cfg.diagnostics.mechanism_every
        return cls(every, tokenizer, task_probe(cfg.task).peak or "1", gold, own, reference)

    def due(self, step: int) -> bool:
        return self.every > 0 and (step == 1 or step % self.every == 0)

    def measure(
        self,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        seqs: Sequences,
        batch: StepBatch,
        ref_logprobs: Tensor | None,
        cfg: Any,
    ) -> dict[str, float]:
        """The `mech/*` metrics of this step (module docstring), before its update:
        `ref_logprobs` are the step's reference log-probs when the loss has a KL term. Runs on
        a forked RNG, so that a train-mode forward (dropout) cannot move the run's stream."""
        algo, probe = cfg.algorithm, task_probe(cfg.task)
        difficulties = batch.per_rollout([p.meta.get("difficulty") for p in batch.prompts])
        out = {
            **self.gates(policy),
            **computed_lead_shares(batch.responses.texts, difficulties, probe, self.target),
        }
        params = [p for p in policy.parameters() if p.requires_grad]
        device = params[0].device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            grads = gradient_parts(policy, params, seqs, batch, ref_logprobs, algo, self.reference)
        deltas = adamw_step_parts(optimizer, params, grads.answer, grads.other, cfg.optim.grad_clip)
        out.update(self.direct_effects(policy, params, deltas))
        out["mech/leak_cos"] = flat_cosine(grads.leak_reason, grads.leak_raise)
        sums = grads.drift
        for key in [k[: -len("_sum")] for k in sums if k.endswith("_sum")]:
            count = sums[key + "_count"]
            out[key] = sums[key + "_sum"] / count if count else math.nan
        return out

    def _probs(self, policy: torch.nn.Module, prefixes: Prefixes) -> dict[str, Tensor]:
        policy.eval()
        return answer_probs(policy, prefixes, self.target_ids, self.lead, self.digits, self.pad_id)

    def gates(self, policy: torch.nn.Module) -> dict[str, float]:
        """`mech/gate_first*` and `mech/gate_stop*` on the gold prefixes."""
        probs = self._probs(policy, self.gold)
        out = {}
        for name, key, rows in (
            ("first", "first", self.first_rows),
            ("stop", "stop", self.stop_rows),
        ):
            kept = [(float(p), d) for p, d, r in zip(probs[key], self.gold.difficulties, rows) if r]
            out |= _by_difficulty(f"mech/gate_{name}", [p for p, _ in kept], [d for _, d in kept])
        return out

    def direct_effects(
        self, policy: torch.nn.Module, params: list, deltas: dict[str, list[Tensor]]
    ) -> dict[str, float]:
        """P(box "1"), p(first "1") and the first answer token's entropy at the own prefixes,
        before the update, and their change under the full update and each part alone."""
        diff = self.own.difficulties
        before = self._probs(policy, self.own)
        out = {
            **_by_difficulty("mech/p_box1", before["box"].tolist(), diff),
            **_by_difficulty("mech/p_first1", before["first"].tolist(), diff),
            "mech/entropy_first": mean_or_nan(before["entropy"].tolist()),
        }
        full = [sum(parts) for parts in zip(*(deltas[k] for k in PARTS))]
        changes = {}
        for part, delta in (("full", full), *((k, deltas[k]) for k in PARTS)):
            with shifted(params, delta):
                after = self._probs(policy, self.own)
            changes[part] = {k: (after[k] - before[k]).tolist() for k in ("box", "first")}
            out |= _by_difficulty(f"mech/d_box1_{part}", changes[part]["box"], diff)
            out |= _by_difficulty(f"mech/d_first1_{part}", changes[part]["first"], diff)
            out[f"mech/d_entropy_first_{part}"] = mean_or_nan(
                (after["entropy"] - before["entropy"]).tolist()
            )
        out["mech/d_box1_interaction"] = out["mech/d_box1_full"] - sum(
            out[f"mech/d_box1_{k}"] for k in PARTS
        )
        return out
