"""Measurements taken at the current weights before a step's update, which the update never
uses: the gradient probe (answer vs reasoning tokens, `trainer.grad_probe_every`) and the
mechanism probe (`omgrpo.backends.native.mechanism`, `diagnostics.mechanism_every`). The
third probe of a step, the task's (`omgrpo.tasks.task_probe`), reads responses in scoring."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from omgrpo.backends.native.run import Run
from omgrpo.core.losses import token_logprobs_and_entropy
from omgrpo.core.step import StepBatch
from omgrpo.generation.rollout import Sequences, response_logits


def step_probes(
    run: Run,
    step: int,
    timer: Callable[[str], AbstractContextManager],
    seqs: Sequences,
    batch: StepBatch,
    ref_logprobs: torch.Tensor | None,
) -> dict[str, float]:
    """The probes due at `step` (`timer` times each stage): the gradient probe's `grad/*` at
    step 1 and every `trainer.grad_probe_every` steps, the `mech/*` metrics when
    `diagnostics.mechanism_every` makes `step` a probe step; taken before the update (the
    mechanism probe splits this step's update)."""
    probe = {}
    probe_every = run.cfg.trainer.grad_probe_every
    if probe_every and (step == 1 or step % probe_every == 0):
        with timer("probe"):
            probe = gradient_probe(run.policy, seqs, batch)
    if run.mechanism is not None and run.mechanism.due(step):
        with timer("mechanism"):
            probe |= run.mechanism.measure(
                run.policy, run.optimizer, seqs, batch, ref_logprobs, run.cfg
            )
    return probe


def gradient_probe(policy, seqs: Sequences, batch: StepBatch, rows: int = 64) -> dict[str, float]:
    """Norms and cosine of the policy-gradient parts of the answer tokens and of the other
    response tokens, at the current weights, on the first `rows` rollouts (ratio 1, no
    masking, no KL: the gradients the OMU weight scales and leaves alone)."""
    policy.train()
    part = seqs.select(torch.arange(min(rows, len(seqs))))
    device = next(policy.parameters()).device
    part = part.to(device)
    logprobs, _ = token_logprobs_and_entropy(
        response_logits(policy, part).float(), part.response_ids
    )
    resp = part.response_mask.bool()
    answer = batch.responses.answer_mask[: len(part)].to(device) & resp
    weighted = -batch.advantages[: len(part)].to(device).unsqueeze(1) * logprobs
    num_tokens = resp.sum().clamp(min=1)
    params = [p for p in policy.parameters() if p.requires_grad]
    flat = []
    for mask in (answer, resp & ~answer):
        grads = torch.autograd.grad(
            (weighted * mask).sum() / num_tokens, params, retain_graph=True, allow_unused=True
        )
        flat.append(
            torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).flatten()
                    for g, p in zip(grads, params)
                ]
            )
        )
    answer_grad, reasoning_grad = flat
    return {
        "grad/answer_norm": float(answer_grad.norm()),
        "grad/reasoning_norm": float(reasoning_grad.norm()),
        "grad/answer_reasoning_cos": float(
            torch.nn.functional.cosine_similarity(answer_grad, reasoning_grad, dim=0)
        ),
    }
