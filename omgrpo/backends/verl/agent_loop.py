"""Group-level rewards inside verl's agent loop (soft vote + CAR on the policy's own servers).

verl's reward loop scores rollouts one at a time; OM-GRPO's reward needs all G rollouts of a
prompt (soft vote) and fresh generations of the *current* policy (CAR's pairwise answers). In
verl 0.9.1 all G sessions of a prompt run inside one agent-loop worker (`_run_prompt`), and the
worker holds the client of the policy's rollout servers. `OmgrpoAgentLoopWorker` therefore
lets each session finish generating, waits until the prompt's G sessions are there, then:

1. runs CAR: for each ordered pair (i, j) the paper's contrast prompt (the rollout's own chat
   prompt, "Here are two possible solutions: ... \\boxed{") is sent to the rollout servers for
   a short answer (`omgrpo.car.max_new_tokens`); the servers are awake in the generation stage,
   so this is the policy being trained;
2. scores the group with the native trainer's `omgrpo.core.step.score_step`: soft vote over the
   rollouts' answers plus the pair answers, format, the PRM's process reward (step scores from
   the run's PRM actor, `omgrpo.backends.verl.prm`), ...; each rollout's answer-token mask;
3. presets every rollout's `reward_score` (verl then skips its per-sample reward) and hands the
   rollout to verl's own post-processing with two extra fields, `omgrpo_answer_mask` and
   `omgrpo_format`, which verl stores in TransferQueue next to `response_mask` (with a generic
   mask, `omgrpo.core.masks`, also `omgrpo_span_<span>`: the token masks of the spans it reads;
   the driver draws the mask step-wide, `omgrpo.backends.verl.advantage.generic_masks`; with
   `algorithm.overlong_filter`, `omgrpo_truncated`: whether the response was cut by the length
   limit, `truncated`).

If a session fails, the others of its prompt stop waiting and fail too, so verl's replay buffer
sees one failed group (as without the plugin). Validation rollouts take verl's path unchanged
(per-sample `compute_score`). Only single-turn agent loops are supported.

Enabled by `actor_rollout_ref.rollout.agent.agent_loop_manager_class=
omgrpo.backends.verl.agent_loop.OmgrpoAgentLoopManager` (set in the presets).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import ray
import torch
from verl.trainer.ppo.v1 import AgentLoopManagerTQ, AgentLoopWorkerTQ

from omgrpo.backends.verl import (
    ANSWER_MASK_KEY,
    FORMAT_SCORE_KEY,
    RECORD_KEY,
    TRUNCATED_KEY,
    span_mask_key,
)
from omgrpo.backends.verl.config import section
from omgrpo.backends.verl.prm import PRM_SERVER_NAME, PrmClient, question_of, start_prm_server
from omgrpo.backends.verl.record import CarRecord, RolloutRecord
from omgrpo.backends.verl.reward import label_of, pred_of
from omgrpo.core.answers import Grader
from omgrpo.core.car import (
    CarResult,
    PairAnswer,
    car_text,
    cut_solutions,
    enumerate_pairs,
    read_pair_answer,
)
from omgrpo.core.dapo import truncated_rows
from omgrpo.core.process import ProcessScorer
from omgrpo.core.rewards import format_score
from omgrpo.core.step import StepBatch, score_step
from omgrpo.generation.engine import stop_token_ids
from omgrpo.tasks import Problem

__all__ = ["OmgrpoAgentLoopManager", "OmgrpoAgentLoopWorker", "car_prompt_ids"]

logger = logging.getLogger(__name__)

# Ray forbids subclassing an actor class; verl's own class behind @ray.remote is this one.
_WorkerBase = AgentLoopWorkerTQ.__ray_metadata__.modified_class


def car_prompt_ids(
    tokenizer: Any,
    prompt_ids: list[int],
    solution_1: list[int],
    solution_2: list[int],
    max_solution_tokens: int,
    max_len: int,
    max_new_tokens: int,
    advice: str = "raise actor_rollout_ref.rollout.max_model_len",
) -> tuple[list[int], tuple[bool, bool]]:
    """Token ids of the paper's CAR prompt for one ordered pair, and which solution was cut.

    The rollout's own prompt (chat template, question, open assistant turn) is followed by
    `omgrpo.core.car.car_text`'s tail ("Here are two possible solutions: [Solution 1] ...
    [Solution 2] ... the correct final answer is \\boxed{"), as the native CAR builds it. Each
    solution (decoded, special tokens dropped) is cut by `omgrpo.core.car.cut_solutions` to its
    first `max_solution_tokens` tokens (<= 0: whole), as natively, and further so that the
    prompt plus `max_new_tokens` fits in `max_len` (vLLM rejects longer prompts). The length is
    checked on the final ids: encoding the concatenated text can merge or split tokens at the
    joins, so the cut shrinks until the prompt fits.

    Returns:
        ``(ids, (cut_1, cut_2))``; the cut is the same for every pair of a group (same
        prompt, same budget), so a solution's flag is the same in all its pairs.
    """
    sols = [tokenizer.decode(s, skip_special_tokens=True) for s in (solution_1, solution_2)]
    budget = max_len - max_new_tokens  # prompt tokens vLLM accepts with room for the answer
    template = len(tokenizer.encode(car_text("", "", ""), add_special_tokens=False))
    limit = (budget - len(prompt_ids) - template) // 2
    if max_solution_tokens > 0:
        limit = min(limit, max_solution_tokens)
    while limit >= 1:
        texts, cut = cut_solutions(tokenizer, sols, limit)
        ids = list(prompt_ids) + tokenizer.encode(
            car_text("", texts[0], texts[1]), add_special_tokens=False
        )
        over = len(ids) - budget
        if over <= 0:
            return ids, (cut[0], cut[1])  # one flag per solution
        limit -= over // 2 + 1
    raise ValueError(
        f"CAR prompt does not fit: prompt {len(prompt_ids)} + template {template} + "
        f"omgrpo.car.max_new_tokens {max_new_tokens} tokens leave no room for the two solutions "
        f"within {max_len} tokens; {advice}"
    )


class _Group:
    """The sessions of one prompt, waiting for each other to be scored together."""

    def __init__(self, n: int):
        self.n = n
        self.outputs: dict[int, tuple[Any, dict[str, Any]]] = {}
        self.fields: dict[int, dict[str, torch.Tensor]] = {}
        self.done = asyncio.Event()
        self.error: BaseException | None = None

    def add(self, session_id: int, output: Any, kwargs: dict[str, Any]) -> bool:
        """Register a finished session; True for the session that completes the group."""
        self.outputs[int(session_id)] = (output, kwargs)
        return len(self.outputs) == self.n

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.done.set()

    async def wait(self) -> None:
        await self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"another rollout of this prompt failed: {self.error!r}")


class OmgrpoAgentLoopWorker(_WorkerBase):
    """verl's TransferQueue agent-loop worker with OM-GRPO's group rewards (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.omgrpo = section(self.config)
        self._groups: dict[str, _Group] = {}
        self._warned_no_index = False

    async def _run_prompt(
        self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False
    ) -> None:
        if trajectory["validate"]:
            return await super()._run_prompt(prompt, sampling_params, trajectory, trace)
        n = int(prompt.get("__rollout_n__", self.config.actor_rollout_ref.rollout.n))
        uid = prompt["uid"]
        self._groups[uid] = _Group(n)
        try:
            await super()._run_prompt(prompt, sampling_params, trajectory, trace)
        finally:
            self._groups.pop(uid, None)

    async def _run_agent_loop(self, sampling_params: dict, trajectory: dict, **kwargs: Any) -> Any:
        try:
            return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)
        except BaseException as exc:
            group = self._groups.get(kwargs.get("uid"))
            if group is not None:  # release the sessions waiting for this one
                group.fail(exc)
            raise

    async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> Any:
        group = None if validate else self._groups.get(kwargs["uid"])
        if group is None:
            return await super()._agent_loop_postprocess(output, validate, **kwargs)
        outputs = output if isinstance(output, list) else [output]
        if len(outputs) != 1:
            raise NotImplementedError(
                "omgrpo's verl backend supports single-turn agent loops (one output per session)"
            )
        session = int(kwargs["session_id"])
        if group.add(session, outputs[0], kwargs):
            try:
                await self._score_group(group)
            except BaseException as exc:
                group.fail(exc)
                raise
            group.done.set()
        await group.wait()
        # Extra kwargs become TransferQueue fields of this rollout (verl: field.update(kwargs)).
        return await super()._agent_loop_postprocess(
            output, validate, **kwargs, **group.fields[session]
        )

    # ------------------------------------------------------------------------------------
    def _process_scorer(self) -> ProcessScorer | None:
        """With the `process` reward, this worker's client of the run's PRM actor (created by
        `OmgrpoAgentLoopManager`); None without it."""
        if "process" not in self.omgrpo.reward.parts:
            return None
        if getattr(self, "_prm", None) is None:
            handle = ray.get_actor(PRM_SERVER_NAME)
            self._prm = PrmClient.remote(handle, self.omgrpo.reward.prm.budget_s)
        return self._prm

    def _context_limit(self) -> tuple[int, str]:
        """The servers' context length (what vLLM checks prompts against) and how to raise
        it: `max_model_len`, or the model's `max_position_embeddings` when that is null (verl's
        vLLM server sets it so)."""
        cfg = self.rollout_config
        lower = "lower omgrpo.car.max_new_tokens or data.max_prompt_length"
        if cfg.max_model_len:
            return int(cfg.max_model_len), (
                f"raise actor_rollout_ref.rollout.max_model_len (up to the model's "
                f"max_position_embeddings) or {lower}"
            )
        from verl.workers.rollout.utils import get_max_position_embeddings

        limit = get_max_position_embeddings(self.model_config.hf_config)
        return limit, (
            f"the limit is the model's max_position_embeddings (actor_rollout_ref.rollout."
            f"max_model_len is null), so {lower}"
        )

    async def _pair_answers(
        self, prompt_ids: list[int], responses: list[list[int]], uid: str, seed: str
    ) -> tuple[CarResult, float, float]:
        """CAR's pair answers of one group from the policy's rollout servers, with the wall
        clock of the first request and of the last answer."""
        car = self.omgrpo.car
        pairs = enumerate_pairs(len(responses), car.pairs_per_anchor, random.Random(seed))
        max_len, advice = self._context_limit()
        prompts, cut = [], set()
        for i, j in pairs:
            ids, (cut_i, cut_j) = car_prompt_ids(
                self.tokenizer,
                prompt_ids,
                responses[i],
                responses[j],
                int(car.max_solution_tokens),
                max_len,
                int(car.max_new_tokens),
                advice,
            )
            prompts.append(ids)
            cut |= {i} if cut_i else set()
            cut |= {j} if cut_j else set()
        params = {
            "max_tokens": int(car.max_new_tokens),
            "temperature": float(car.temperature),
            "top_p": float(car.top_p),
        }

        async def one(k: int) -> tuple[PairAnswer, str]:
            # One request id per anchor: verl's load balancer routes an id to the same server
            # (sticky sessions), so the anchor's pairs, which share the prompt and solution 1,
            # meet their prefix in that server's cache.
            out = await self.llm_client.generate(
                f"{uid}-car-{pairs[k][0]}", prompt_ids=prompts[k], sampling_params=dict(params)
            )
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            return read_pair_answer(text), text

        async def anchor(ks: list[int]) -> list[tuple[PairAnswer, str]]:
            # With full_determinism verl hands the request id to vLLM as is: requests sharing
            # an id must not overlap there, so an anchor's pairs then go one after the other.
            if getattr(self.rollout_config, "full_determinism", False):
                return [await one(k) for k in ks]
            return list(await asyncio.gather(*(one(k) for k in ks)))

        by_anchor: dict[int, list[int]] = {}
        for k, (i, _) in enumerate(pairs):
            by_anchor.setdefault(i, []).append(k)
        start = time.time()
        results = await asyncio.gather(*(anchor(ks) for ks in by_anchor.values()))
        got = {k: a for ks, out in zip(by_anchor.values(), results) for k, a in zip(ks, out)}
        # `car/truncated` counts each cut solution once per group, as the native CAR does.
        car = CarResult(
            pairs=[pairs], answers=[[]], texts=[[]], truncated=len(cut), num_pairs=len(pairs)
        )
        for k in range(len(pairs)):
            car.add(0, *got[k])
        return car, start, time.time()

    def _prompt_id(self, kwargs: dict[str, Any], prompt_ids: list[int]) -> str:
        """Stable id of the prompt across steps (the label-flip diagnostic): the dataset's
        `extra_info.index`; without one (verl would then give every row index 0), a hash of
        the prompt's tokens, with a warning once per worker."""
        source = kwargs.get("data_source", "")
        extra = kwargs.get("extra_info")
        if isinstance(extra, dict) and extra.get("index") is not None:
            return f"{source}/{_plain(extra['index'])}"
        if not self._warned_no_index:
            self._warned_no_index = True
            logger.warning(
                "omgrpo: training rows have no extra_info.index; answers/label_flip_rate uses a "
                "hash of the prompt tokens as the prompt id (docs/verl.md, data format)"
            )
        digest = hashlib.sha1(str(list(prompt_ids)).encode()).hexdigest()[:16]
        return f"{source}/prompt-{digest}"

    async def _score_group(self, group: _Group) -> None:
        sessions = sorted(group.outputs)
        outputs = [group.outputs[s][0] for s in sessions]
        kwargs0 = group.outputs[sessions[0]][1]
        label = label_of((kwargs0.get("reward_model") or {}).get("ground_truth"))
        responses = [torch.as_tensor(list(o.response_ids), dtype=torch.int64) for o in outputs]
        prompt_ids = list(outputs[0].prompt_ids)
        om = self.omgrpo

        car, span = None, (0.0, 0.0)
        if om.car.enable:
            seed = f"{kwargs0.get('global_steps')}-{kwargs0['uid']}"
            car, *span = await self._pair_answers(
                prompt_ids, [r.tolist() for r in responses], str(kwargs0["uid"]), seed
            )
        process = self._process_scorer()
        # The PRM reads the question (so it must be there); the rollout table shows it.
        question = question_of(kwargs0, required=process is not None)
        problem = Problem(id=self._prompt_id(kwargs0, prompt_ids), question=question, answer=label)
        ids = torch.nn.utils.rnn.pad_sequence(responses, batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in responses], True)
        batch, timeouts = await asyncio.to_thread(
            score_group, self.tokenizer, ids, mask, problem, om, car, process
        )
        records = rollout_records(batch, timeouts, car, span)
        cut = self.truncated(ids, mask) if om.algorithm.get("overlong_filter") else None
        for k, (session, output, record) in enumerate(zip(sessions, outputs, records)):
            output.reward_score = float(batch.rewards[k])
            output.extra_fields["reward_extra_info"] = {
                "score": output.reward_score,
                **record.rewards,
                "acc": float(bool(record.correct)),
                "pred": pred_of(record.answer),
            }
            output.extra_fields[RECORD_KEY] = record.to_dict()
            n = len(responses[k])
            group.fields[session] = {
                ANSWER_MASK_KEY: batch.responses.answer_mask[k, :n].long(),
                # The format reward (paper §3.1), for the format-only advantage.
                FORMAT_SCORE_KEY: torch.tensor(format_score(record.answer), dtype=torch.float32),
                # With a generic mask: the spans it reads (the driver draws it step-wide).
                **{
                    span_mask_key(span): mask[k, :n].long()
                    for span, mask in batch.responses.span_masks.items()
                },
            }
            if cut is not None:  # the overlong filter's rollouts (the driver drops them)
                group.fields[session][TRUNCATED_KEY] = cut[k].long()

    def truncated(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(G,) bool: the group's responses (`ids`, `mask`: (G, T) right-padded) cut by the
        length limit, `actor_rollout_ref.rollout.response_length` tokens without one of the
        model's stop tokens at the end (`omgrpo.core.dapo.truncated_rows`; the stop tokens as the
        native trainer's, `stop_token_ids`: the tokenizer's eos, the generation config's and the
        chat template's end of turn)."""
        limit = int(self.rollout_config.response_length)
        return truncated_rows(ids, mask, limit, stop_token_ids(self.tokenizer, self.model_config))


def rollout_records(
    batch: StepBatch, timeouts: int, car: CarResult | None, span: Sequence[float]
) -> list[RolloutRecord]:
    """Each rollout's record of one scored group (`batch` holds one prompt), for the driver's
    metrics; `span`: CAR's (start, end) wall clock."""
    problem = batch.prompts[0]
    records = []
    for k, (answer, correct) in enumerate(zip(batch.answers, batch.correct)):
        car_record = None
        if car is not None:
            mine = [(p, a) for p, a in zip(car.pairs[0], car.answers[0]) if p[0] == k]
            car_record = CarRecord(
                pairs=[p for p, _ in mine],
                answers=[a for _, a in mine],
                truncated=car.truncated,
                unclosed=car.unclosed,
                empty=car.empty,
                start=span[0],
                end=span[1],
            )
        records.append(
            RolloutRecord(
                answer=answer,
                correct=correct,
                label=problem.answer,
                prompt_id=problem.id,
                session=k,
                rewards={part: float(v[k]) for part, v in batch.reward_parts.items()},
                grading_timeouts=timeouts,  # the group's, on every rollout
                car=car_record,
                text=batch.responses.texts[k],
                question=problem.question,
                step_scores=None if batch.step_scores is None else batch.step_scores[k],
                process=None if batch.process is None else batch.process[k],
            )
        )
    return records


def score_group(
    tokenizer: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    problem: Problem,
    om: Any,
    car: CarResult | None,
    process: ProcessScorer | None = None,
) -> tuple[StepBatch, int]:
    """`score_step` on one prompt's rollouts, its answer comparisons within one grading budget
    (`omgrpo.reward.grading_budget_s`: groups are scored concurrently in the agent-loop
    workers, so each has its own); returns the scored group and the comparisons it left
    undecided (`answers/grading_timeouts`). `process`: the PRM client (reward `process`)."""
    grader = Grader.from_config(om.reward)
    batch = score_step(tokenizer, ids, mask, [problem], om, car=car, grader=grader, process=process)
    return batch, grader.timeouts


def _plain(value: Any) -> Any:
    """numpy scalars (verl's non-tensor batch) as Python values."""
    return value.item() if hasattr(value, "item") else value


class OmgrpoAgentLoopManager(AgentLoopManagerTQ):
    """verl's TransferQueue agent-loop manager, spawning `OmgrpoAgentLoopWorker`s."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(OmgrpoAgentLoopWorker)
        om = section(self.config)
        # the workers find the PRM actor by name when they first score a group
        self.prm_server = start_prm_server(om) if "process" in om.reward.parts else None
