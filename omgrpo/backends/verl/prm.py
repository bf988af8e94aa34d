"""The `process` reward on verl: a frozen PRM in its own Ray actor, called by the agent loop.

verl 0.9.1's reward models (`reward.reward_model`, `verl.experimental.reward_loop`) are served
by vLLM / SGLang and read one score per sequence (`/classify`: the last token's), per sample;
a PRM's reward needs a score at every step tag, and omgrpo scores a prompt's G rollouts
together. So the PRM runs the way verl runs its reward-loop workers: a Ray actor holding the
model, created by the driver's agent-loop manager and called from the agent-loop workers (as
verl's agent loop calls `reward_loop_worker_handles`), here with the scoring code the native
trainer uses (`omgrpo.models.prm`, `omgrpo.core.process`):

- `PrmServer` loads the checkpoint of `omgrpo.reward.prm` (`load_prm`: eval mode, no gradient,
  in no optimizer: the PRM never trains) on `omgrpo.prm_server.num_gpus` GPUs (0: the CPU).
- Batched: the groups the agent-loop workers send while it is busy wait, and are scored
  `reward.prm.batch_size` responses per forward pass across groups, in arrival order.
- Budgeted: each group's request carries a deadline (`reward.prm.budget_s` from when its group
  asked, time in the queue included); responses not started by then are left unscored (None:
  the group's mean score, `prm/unscored_share`). A batch already running is not cut.

`PrmClient` is the `omgrpo.core.process.ProcessScorer` that `score_step` calls in the worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omgrpo.core.process import StepScores

__all__ = ["PRM_SERVER_NAME", "PrmClient", "PrmServer", "question_of", "start_prm_server"]

PRM_SERVER_NAME = "omgrpo_prm_server"
"""Name of the run's PRM actor (Ray namespaces keep runs apart)."""


@dataclass
class _Request:
    """One group's (question, steps) items, its deadline and its scores as they come."""

    items: list[tuple[str, list[str]]]
    deadline: float
    out: list[StepScores] = field(default_factory=list)
    started: int = 0  # items handed to a batch so far (in order)

    @property
    def open(self) -> bool:
        return self.started < len(self.items)


class PrmServer:
    """A frozen PRM serving `score` requests (module docstring). `prm`: an already loaded
    `omgrpo.models.prm.ProcessRewardModel` (tests); else it is loaded from `prm_cfg`."""

    def __init__(
        self, prm_cfg: Any = None, prm: Any = None, clock: Callable[[], float] = time.time
    ):
        if prm is None:
            prm = _load(prm_cfg)
        self.prm, self.clock = prm, clock
        self._pending: list[_Request] = []
        self._busy: asyncio.Lock | None = None

    async def score(
        self, questions: Sequence[str], responses: Sequence[str], deadline: float
    ) -> list[StepScores]:
        """Each response's step scores (None: not started by `deadline`, wall clock)."""
        items = [(q, self.prm.steps(r)) for q, r in zip(questions, responses)]
        request = _Request(items, deadline, [None] * len(items))
        self._pending.append(request)
        self._busy = self._busy or asyncio.Lock()
        async with self._busy:  # one forward pass at a time; it may carry other groups' items
            while request.open:
                batch = self._next_batch()
                if not batch:
                    break
                texts = [r.items[i] for r, i in batch]
                scores = await asyncio.to_thread(self.prm.score_batch, texts)
                for (r, i), s in zip(batch, scores):
                    r.out[i] = [float(x) for x in s]
        return request.out

    def _next_batch(self) -> list[tuple[_Request, int]]:
        """Up to batch_size (request, item) pairs, oldest request first; a request past its
        deadline gives up the items it has not started."""
        now, size, batch = self.clock(), self.prm.batch_size, []
        for request in list(self._pending):
            if now >= request.deadline:
                request.started = len(request.items)
            take = min(len(request.items) - request.started, size - len(batch))
            batch += [(request, request.started + k) for k in range(take)]
            request.started += take
            if not request.open:
                self._pending.remove(request)
            if len(batch) == size:
                break
        return batch


def _load(prm_cfg: Any) -> Any:
    """The PRM of `prm_cfg` on this actor's GPU (Ray sets CUDA_VISIBLE_DEVICES) or the CPU."""
    import torch

    from omgrpo.models.loading import resolve_dtype
    from omgrpo.models.prm import load_prm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return load_prm(prm_cfg.path, prm_cfg, device, resolve_dtype(prm_cfg.dtype, device))


class PrmClient:
    """The `ProcessScorer` of one agent-loop worker: `submit(questions, responses, deadline)`
    sends a group to the PRM server and blocks for its step scores (`score_step` runs in a
    worker thread); the deadline is `budget_s` from the call."""

    def __init__(
        self,
        submit: Callable[[list[str], list[str], float], list[StepScores]],
        budget_s: float,
        clock: Callable[[], float] = time.time,
    ):
        self.submit, self.budget_s, self.clock = submit, float(budget_s), clock

    def __call__(self, questions: list[str], responses: list[str]) -> list[StepScores]:
        return self.submit(list(questions), list(responses), self.clock() + self.budget_s)

    @classmethod
    def remote(cls, handle: Any, budget_s: float) -> PrmClient:
        """A client of the Ray actor `handle` (`start_prm_server`)."""
        import ray

        return cls(lambda q, r, d: ray.get(handle.score.remote(q, r, d)), budget_s)


def start_prm_server(om: Any) -> Any:
    """The run's PRM actor (created, or the existing one of this name) for the `omgrpo`
    section `om`, with `om.prm_server`'s Ray resources."""
    import ray
    from omegaconf import OmegaConf

    prm_cfg = OmegaConf.create(OmegaConf.to_container(om.reward.prm, resolve=True))
    actor = ray.remote(PrmServer).options(
        name=PRM_SERVER_NAME,
        get_if_exists=True,
        num_cpus=float(om.prm_server.num_cpus),
        num_gpus=float(om.prm_server.num_gpus),
    )
    return actor.remote(prm_cfg)


def question_of(kwargs: dict[str, Any], required: bool = True) -> str:
    """The question a PRM reads: the last user message of the row's chat prompt (`raw_prompt`;
    omgrpo's rows hold the system instruction and the bare question, as the native trainer's
    `Problem.question`). A row without one raises when `required` (the PRM needs it), else
    gives "" (the rollout table's `question`)."""
    messages = kwargs.get("raw_prompt")
    messages = [] if messages is None else list(messages)  # a list, or verl's numpy array
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        if not required:
            return ""
        raise ValueError(
            "reward 'process' on verl reads the question from the row's chat prompt "
            "(`prompt`: a list of messages with a user message); this row has none"
        )
    return str(users[-1]["content"])
