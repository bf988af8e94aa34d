"""The verl backend's reward pieces on a hand-built group (CPU, real verl classes, no Ray).

The agent-loop worker is driven directly: its rollout-server client is a fake that answers
CAR prompts with the second solution's answer, and verl's own TransferQueue post-processing is
replaced by a recorder, so the test sees exactly the rewards, answer masks and extra fields the
worker hands to verl.
"""

from __future__ import annotations

try:
    import verl  # noqa: F401
except ModuleNotFoundError as exc:  # CI runs these with real verl: say how to get it
    raise ModuleNotFoundError(
        "tests/test_verl_*.py need verl: install with pip install -e '.[dev,verl]' (or make setup)"
    ) from exc

import asyncio
import logging
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.experimental.agent_loop import AgentLoopOutput
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.workers.rollout.replica import TokenOutput

from omgrpo.backends.verl import (
    ANSWER_MASK_KEY,
    FORMAT_SCORE_KEY,
    RECORD_KEY,
    SPAN_MASK_PREFIX,
    span_mask_key,
)
from omgrpo.backends.verl import agent_loop as al
from omgrpo.backends.verl.advantage import apply_answer_weighting
from omgrpo.backends.verl.config import OmgrpoVerlConfig
from omgrpo.backends.verl.metrics import records_metrics
from omgrpo.backends.verl.record import RolloutRecord
from omgrpo.backends.verl.reward import NO_ANSWER, compute_score
from omgrpo.config import compose
from omgrpo.core.car import CAR_INTRO, CAR_MIDDLE, CAR_OUTRO, CarResult, car_text, cut_solutions
from omgrpo.core.losses import answer_token_advantages
from omgrpo.core.prompt import build_messages
from omgrpo.core.step import LoopState, decode_responses, extract_answer, score_step
from omgrpo.core.step import step_metrics as native_step_metrics
from omgrpo.models.tokenizer import build_char_tokenizer
from omgrpo.tasks import Problem

PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
RESPONSES = ["2+2=4 so \\boxed{4}", "two and two: \\boxed{4}", "I think \\boxed{5}"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text: str, eos: bool = True) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])


def test_compute_score_is_label_free_with_pred_and_acc():
    out = compute_score("math", "so \\boxed{\\frac{1}{2}}", ground_truth="0.5")
    assert out == {"score": 1.0, "format": 1.0, "acc": 1.0, "pred": "\\frac{1}{2}"}
    wrong = compute_score("math", "\\boxed{3}", ground_truth="4")
    assert wrong["score"] == 1.0 and wrong["acc"] == 0.0  # the score never reads the label
    none = compute_score("math", "no box here", ground_truth=4)
    assert none == {"score": 0.0, "format": 0.0, "acc": 0.0, "pred": NO_ANSWER}
    assert compute_score("math", "\\boxed{4}", ground_truth=None)["acc"] == 0.0


def test_compute_score_applies_math_verify_switch():
    """The presets pass omgrpo.reward.math_verify to verl's reward workers (reward_kwargs);
    it applies to that call only (no process-wide switch)."""
    # only the math-verify fallback can match these
    off = compute_score("math", "\\boxed{2\\sqrt{3}}", ground_truth="\\sqrt{12}", math_verify=False)
    assert off["acc"] == 0.0
    on = compute_score("math", "\\boxed{2\\sqrt{3}}", ground_truth="\\sqrt{12}")  # None: on
    assert on["acc"] == 1.0


def test_agent_loop_soft_vote_and_answer_masks(tok, monkeypatch):
    worker, handed = make_worker(tok, monkeypatch, car=False)
    texts = [*RESPONSES, "no answer"]
    outs = asyncio.run(run_group(worker, tok, texts))
    # voters: 4, 4, 5 (None casts no vote) -> "4": 2/3, "5": 1/3
    records = [o.extra_fields[RECORD_KEY] for o in outs]
    assert [r["rewards"]["soft_vote"] for r in records] == pytest.approx([2 / 3, 2 / 3, 1 / 3, 0])
    assert [r["rewards"]["format"] for r in records] == [1.0, 1.0, 1.0, 0.0]
    assert [o.reward_score for o in outs] == pytest.approx([5 / 3, 5 / 3, 4 / 3, 0.0])
    assert [r["answer"] for r in records] == ["4", "4", "5", None]
    assert [r["correct"] for r in records] == [True, True, False, False]
    for k, (text, out) in enumerate(zip(texts, outs)):
        mask = handed[k][1][ANSWER_MASK_KEY]
        assert mask.dtype == torch.int64 and mask.shape == (len(out.response_ids),)
        # one token per character: only the answer inside \boxed{...} is marked
        expected = [text.rindex("{") + 1] if "{" in text else []
        assert mask.nonzero().flatten().tolist() == expected


def test_car_prompt_ids_paper_template_and_budget(tok):
    prompt = ids(tok, PROMPT, eos=False)
    s1, s2 = ids(tok, "A" * 30), ids(tok, "B" * 5)
    out, cut = al.car_prompt_ids(tok, prompt, s1, s2, 10, max_len=4096, max_new_tokens=8)
    assert out[: len(prompt)] == prompt and cut == (True, False)
    text = tok.decode(out[len(prompt) :])
    assert text == CAR_INTRO + "A" * 10 + CAR_MIDDLE + "B" * 5 + CAR_OUTRO
    # A short context cuts the solutions further so prompt + answer fit.
    template = len(CAR_INTRO + CAR_MIDDLE + CAR_OUTRO)
    max_len = len(prompt) + template + 8 + 2 * 4
    out, cut = al.car_prompt_ids(tok, prompt, s1, s2, 0, max_len=max_len, max_new_tokens=8)
    assert len(out) + 8 <= max_len and cut == (True, True)
    with pytest.raises(ValueError, match=r"no room for the two solutions.*max_model_len"):
        al.car_prompt_ids(tok, prompt, s1, s2, 10, max_len=len(prompt) + 5, max_new_tokens=8)


class GrowingTokenizer:
    """A tokenizer whose encoding of the joined text is longer than the sum of the parts
    (each "A" re-encodes as two tokens), as merges / splits at the joins can do."""

    def __init__(self, tok):
        self.tok, self.all_special_ids = tok, tok.all_special_ids

    def encode(self, text, add_special_tokens=False):
        ids = self.tok.encode(text, add_special_tokens=False)
        return ids + [ids[0]] * text.count("A") if ids else ids

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __call__(self, texts, **kwargs):  # the solution cut (`cut_solutions`) reads the parts
        return self.tok(texts, **kwargs)


def test_car_prompt_ids_checks_the_final_length(tok):
    prompt = ids(tok, PROMPT, eos=False)
    grow = GrowingTokenizer(tok)
    template = len(CAR_INTRO + CAR_MIDDLE + CAR_OUTRO)
    max_len = len(prompt) + template + 8 + 2 * 20
    s1, s2 = ids(tok, "A" * 30), ids(tok, "B" * 30)
    out, cut = al.car_prompt_ids(grow, prompt, s1, s2, 0, max_len=max_len, max_new_tokens=8)
    assert len(out) + 8 <= max_len and cut == (True, True)
    text = tok.decode(out[len(prompt) :])
    n = text.count("A")  # cut further than the 20 tokens the first estimate allowed
    assert 0 < n < 20 and "B" * n in text and "B" * (n + 1) not in text


class FakeServers:
    """The policy's rollout servers: a CAR prompt is answered with solution 2's answer."""

    def __init__(self, tok):
        self.tok, self.calls, self.request_ids = tok, [], []

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.calls.append(sampling_params)
        self.request_ids.append((request_id, prompt_ids))
        text = self.tok.decode(prompt_ids)
        second = text[text.rindex(CAR_MIDDLE) : text.rindex(CAR_OUTRO)]
        answer = second[second.rindex("{") + 1 : second.rindex("}")] if "{" in second else "7"
        return TokenOutput(token_ids=self.tok.encode(answer + "} done", add_special_tokens=False))


def make_worker(tok, monkeypatch, car: bool = True, max_solution_tokens: int = 0):
    """The omgrpo agent-loop worker without Ray; verl's post-processing records its inputs."""
    section = OmegaConf.structured(OmgrpoVerlConfig)
    section.car.enable = car
    section.car.max_solution_tokens = max_solution_tokens
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": 3}}})
    config.omgrpo = section
    worker = al.OmgrpoAgentLoopWorker.__new__(al.OmgrpoAgentLoopWorker)
    worker.config, worker.tokenizer, worker.omgrpo, worker._groups = config, tok, section, {}
    worker._warned_no_index = False
    # max_model_len null: verl's vLLM servers use the model's max_position_embeddings
    worker.model_config = SimpleNamespace(hf_config=SimpleNamespace(max_position_embeddings=4096))
    worker.llm_client = FakeServers(tok)
    worker.rollout_config = SimpleNamespace(
        max_model_len=None, prompt_length=512, response_length=512
    )
    handed = {}

    async def verl_postprocess(self, output, validate, **kwargs):
        handed[kwargs["session_id"]] = (output, kwargs)
        return output

    monkeypatch.setattr(al._WorkerBase, "_agent_loop_postprocess", verl_postprocess)
    return worker, handed


def rollout(tok, text: str) -> AgentLoopOutput:
    response = ids(tok, text)
    return AgentLoopOutput(
        prompt_ids=ids(tok, PROMPT, eos=False),
        response_ids=response,
        response_mask=[1] * len(response),
        metrics=AgentLoopMetrics(),
    )


async def run_group(worker, tok, texts, uid="u0", index: int | None = 7, question: str = "2+2?"):
    worker._groups[uid] = al._Group(len(texts))
    common = {"uid": uid, "reward_model": {"ground_truth": "4"}, "data_source": "toy"}
    common["raw_prompt"] = build_messages(question)  # the row's chat prompt, as verl passes it
    # verl's dataset copies extra_info.index to `index`, 0 when the row has none
    common["index"] = 0 if index is None else index
    common["extra_info"] = {} if index is None else {"index": index}
    outs = [rollout(tok, t) for t in texts]
    await asyncio.gather(
        *(
            worker._agent_loop_postprocess(o, False, session_id=i, global_steps=1, **common)
            for i, o in enumerate(outs)
        )
    )
    return outs


def test_agent_loop_group_rewards_with_car(tok, monkeypatch):
    worker, handed = make_worker(tok, monkeypatch)
    outs = asyncio.run(run_group(worker, tok, RESPONSES))
    # 3 x 2 ordered pairs; each answered with solution 2's answer: 4 5 4 5 4 4
    assert len(worker.llm_client.calls) == 6
    # one request id per anchor (sticky routing to the server holding the anchor's prefix)
    prefix = {}
    for request_id, prompt_ids in worker.llm_client.request_ids:
        anchor = int(request_id.removeprefix("u0-car-"))
        head = len(ids(tok, PROMPT, eos=False)) + len(CAR_INTRO) + len(RESPONSES[anchor]) - 1
        prefix.setdefault(request_id, prompt_ids[:head])
        assert prompt_ids[:head] == prefix[request_id]
    assert sorted(prefix) == ["u0-car-0", "u0-car-1", "u0-car-2"]
    assert worker.llm_client.calls[0]["max_tokens"] == 8
    # pool: 3 rollouts (4, 4, 5) + pair answers (4 x "4", 2 x "5") -> "4": 6/9, "5": 3/9
    soft = [6 / 9, 6 / 9, 3 / 9]
    assert [o.reward_score for o in outs] == pytest.approx([s + 1.0 for s in soft])
    for i, (out, text) in enumerate(zip(outs, RESPONSES)):
        info = out.extra_fields["reward_extra_info"]
        assert info["soft_vote"] == pytest.approx(soft[i]) and info["format"] == 1.0
        assert info["acc"] == float(i < 2) and info["pred"] == ("4" if i < 2 else "5")
        record = out.extra_fields[RECORD_KEY]
        assert record["answer"] == ("4" if i < 2 else "5") and record["prompt_id"] == "toy/7"
        assert record["question"] == "2+2?"  # the rollout table's `question` column
        assert [tuple(p) for p in record["car"]["pairs"]] == [(i, j) for j in range(3) if j != i]
        # verl's post-processing got the rollout plus the two fields it stores per rollout
        handed_out, kwargs = handed[i]
        assert handed_out is out
        mask = kwargs[ANSWER_MASK_KEY]
        assert mask.shape == (len(out.response_ids),)
        assert mask.nonzero().flatten().tolist() == [text.rindex("{") + 1]
        assert kwargs[FORMAT_SCORE_KEY].item() == 1.0


def test_agent_loop_without_car_and_metrics(tok, monkeypatch):
    worker, _ = make_worker(tok, monkeypatch, car=False)
    outs = asyncio.run(run_group(worker, tok, RESPONSES))
    assert not worker.llm_client.calls
    assert [o.reward_score for o in outs] == pytest.approx([2 / 3 + 1, 2 / 3 + 1, 1 / 3 + 1])
    m = records_metrics(
        ["u0"] * 3,
        [o.extra_fields[RECORD_KEY] for o in outs],
        [o.reward_score for o in outs],
        confident_share=0.75,
        state=LoopState(),
    )
    assert m["answers/unique_per_prompt"] == 2 and m["acc/train"] == pytest.approx(2 / 3)
    assert m["reward/soft_vote"] == pytest.approx(5 / 9) and m["reward/format"] == 1.0
    assert m["answers/top_vote_acc"] == 1.0 and not any(k.startswith("car/") for k in m)


def test_records_metrics_with_car_records(tok, monkeypatch):
    worker, _ = make_worker(tok, monkeypatch)
    outs = asyncio.run(run_group(worker, tok, RESPONSES))
    outs += asyncio.run(run_group(worker, tok, ["\\boxed{9}", "\\boxed{9}", "x"], uid="u1"))
    state = LoopState()
    m = records_metrics(
        ["u0"] * 3 + ["u1"] * 3,
        [o.extra_fields[RECORD_KEY] for o in outs],
        [o.reward_score for o in outs],
        confident_share=0.6,
        state=state,
    )
    assert m["car/num_pairs"] == 12 and m["car/pool_size"] == pytest.approx(9.0)
    assert m["car/position_bias"] == 0.0  # the fake always picks solution 2
    assert m["car/top_vote_acc"] == 0.5 and m["answers/top_vote_acc"] == 0.5
    assert m["answers/confidently_wrong"] == 0.5  # group u1: "9" holds 2/3 >= 0.6, wrong
    assert m["car/seconds"] >= 0 and m["car/span_s"] >= 0
    # Both groups carry prompt id toy/7: the second visit flips the majority from 4 to 9.
    assert m["answers/label_flip_rate"] == 1.0 and state.last_majority == {"toy/7": "9"}


def test_a_failed_session_releases_its_group():
    async def scenario():
        group = al._Group(3)
        assert not group.add(0, object(), {})
        waiter = asyncio.create_task(group.wait())
        await asyncio.sleep(0)
        group.fail(RuntimeError("vLLM died"))
        with pytest.raises(RuntimeError, match="another rollout of this prompt failed"):
            await waiter

    asyncio.run(scenario())


def test_validation_rollouts_take_verls_path(tok, monkeypatch):
    worker, handed = make_worker(tok, monkeypatch)
    out = rollout(tok, RESPONSES[0])
    asyncio.run(worker._agent_loop_postprocess(out, True, uid="v", session_id=0))
    assert out.reward_score is None and RECORD_KEY not in out.extra_fields
    assert ANSWER_MASK_KEY not in handed[0][1]


def test_car_truncated_counts_each_cut_solution_once(tok, monkeypatch):
    worker, _ = make_worker(tok, monkeypatch, max_solution_tokens=12)
    texts = ["x" * 20 + "\\boxed{4}", "\\boxed{4}", "y" * 30 + "\\boxed{5}"]
    outs = asyncio.run(run_group(worker, tok, texts))
    assert outs[0].extra_fields[RECORD_KEY]["car"]["truncated"] == 2  # rollouts 0 and 2


def test_car_budget_without_max_model_len_uses_the_models_context(tok, monkeypatch):
    worker, _ = make_worker(tok, monkeypatch)
    worker.model_config.hf_config.max_position_embeddings = 60
    with pytest.raises(
        (ValueError, RuntimeError), match=r"max_position_embeddings.*lower omgrpo\.car"
    ):
        asyncio.run(run_group(worker, tok, RESPONSES))
    worker.rollout_config.max_model_len = 60
    with pytest.raises(
        (ValueError, RuntimeError), match=r"raise actor_rollout_ref\.rollout\.max_m"
    ):
        asyncio.run(run_group(worker, tok, RESPONSES, uid="u1"))


def test_missing_extra_info_index_warns_once_and_hashes_the_prompt(tok, monkeypatch, caplog):
    worker, _ = make_worker(tok, monkeypatch, car=False)
    with caplog.at_level(logging.WARNING, logger=al.__name__):
        outs = asyncio.run(run_group(worker, tok, RESPONSES, index=None))
        asyncio.run(run_group(worker, tok, RESPONSES, uid="u1", index=None))
    assert sum("extra_info.index" in r.getMessage() for r in caplog.records) == 1
    pid = outs[0].extra_fields[RECORD_KEY]["prompt_id"]
    assert pid.startswith("toy/prompt-") and pid != "toy/0"


GROUPS = {"u0": RESPONSES, "u1": ["\\boxed{9}", "so \\boxed{4}", "x"]}


@pytest.mark.parametrize(("car", "format_only"), [(False, False), (True, True)])
def test_verl_and_native_score_the_same_groups_identically(tok, monkeypatch, car, format_only):
    """The same rollouts through verl's agent loop, GRPO estimator, answer weighting and driver
    metrics, and through the native trainer's score_step / losses / step_metrics."""
    w = 0.25
    worker, handed = make_worker(tok, monkeypatch, car=car)
    worker.omgrpo.algorithm.answer_weight, worker.omgrpo.algorithm.format_only = w, format_only
    outs, masks, fmts, uids = [], [], [], []
    for index, (uid, texts) in enumerate(GROUPS.items()):
        outs += asyncio.run(run_group(worker, tok, texts, uid=uid, index=index))
        masks += [handed[k][1][ANSWER_MASK_KEY] for k in range(len(texts))]
        fmts += [handed[k][1][FORMAT_SCORE_KEY] for k in range(len(texts))]
        uids += [uid] * len(texts)

    # native: the whole step at once; CAR's pair answers are what the fake servers answer
    problems = [Problem(id=f"toy/{i}", question="", answer="4") for i in range(len(GROUPS))]
    responses = [torch.tensor(o.response_ids) for o in outs]
    ids = torch.nn.utils.rnn.pad_sequence(responses, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in responses], True)
    pool = None
    if car:
        pairs = [[(i, j) for i in range(3) for j in range(3) if j != i] for _ in GROUPS]
        pool = CarResult(
            pairs=pairs,
            answers=[
                [extract_answer(t[j]) or "7" for _, j in p] for t, p in zip(GROUPS.values(), pairs)
            ],
            num_pairs=sum(len(p) for p in pairs),
        )
    method = "om_grpo_format_only" if format_only else "om_grpo_no_car"
    cfg = compose([f"method={method}", f"algorithm.answer_weight={w}"])
    native = score_step(tok, ids, mask, problems, cfg, car=pool)

    # rewards, reward parts, answers, answer-token masks
    records = [o.extra_fields[RECORD_KEY] for o in outs]
    assert [o.reward_score for o in outs] == native.rewards.tolist()
    for part, values in native.reward_parts.items():
        assert [r["rewards"][part] for r in records] == values.tolist()
    assert [r["answer"] for r in records] == native.answers
    assert [r["correct"] for r in records] == native.correct
    for k, m in enumerate(masks):
        assert m.tolist() == native.responses.answer_mask[k, : len(m)].long().tolist()

    # advantages: verl's GRPO estimator (reward on the last token) + omgrpo's answer weighting
    lengths = torch.tensor([len(r) for r in responses])
    scores = torch.zeros(ids.shape)
    scores[torch.arange(len(outs)), lengths - 1] = torch.tensor([o.reward_score for o in outs])
    adv, _ = compute_grpo_outcome_advantage(scores, mask, np.array(uids, dtype=object))
    data = DataProto.from_dict(
        {
            "advantages": adv,
            "response_mask": mask,
            ANSWER_MASK_KEY: torch.nn.utils.rnn.pad_sequence(masks, batch_first=True),
            FORMAT_SCORE_KEY: torch.stack(fmts),
        },
        non_tensors={"uid": np.array(uids, dtype=object)},
    )
    verl_tokens = apply_answer_weighting(data, w, format_only).batch["advantages"]
    native_tokens = (
        answer_token_advantages(
            native.advantages.unsqueeze(-1),
            native.responses.answer_mask,
            w,
            native.format_advantages,
        )
        * mask
    )
    torch.testing.assert_close(verl_tokens, native_tokens)
    assert native_tokens.abs().sum() > 0

    # metrics: the driver's from the records, the native trainer's from its batch
    verl_m = records_metrics(
        uids, records, [o.reward_score for o in outs], confident_share=0.6, state=LoopState()
    )
    native_m = native_step_metrics(native, LoopState(), 0.6)
    assert set(native_m) - set(verl_m) == {"answers/batch_mode", "response/length_mean"}
    # verl-only: CAR's wall clock, and grading timeouts summed over per-group budgets (the
    # native trainer adds its per-step budget's count in train_step)
    verl_only = {"answers/grading_timeouts"} | ({"car/seconds", "car/span_s"} if car else set())
    assert set(verl_m) - set(native_m) == verl_only
    assert verl_m["answers/grading_timeouts"] == 0
    for key in set(verl_m) & set(native_m):
        a, b = verl_m[key], native_m[key]
        assert a == b or (math.isnan(a) and math.isnan(b)), key
    assert any(k.startswith("car/") for k in native_m) == car


def test_car_unclosed_counts_open_braces_only_and_the_record_round_trips(tok, monkeypatch):
    """`car/unclosed` means what it means natively (`read_pair_answer`): an empty `\\boxed{}`
    is closed (counted as empty), a brace left open is unclosed; both cast no vote."""
    worker, _ = make_worker(tok, monkeypatch)
    replies = iter(["} empty", "12 and more"] * 3)

    async def generate(request_id, prompt_ids, sampling_params):
        return TokenOutput(token_ids=tok.encode(next(replies), add_special_tokens=False))

    worker.llm_client.generate = generate
    outs = asyncio.run(run_group(worker, tok, RESPONSES))
    raw = outs[0].extra_fields[RECORD_KEY]
    assert raw["car"]["unclosed"] == 3 and raw["car"]["empty"] == 3
    record = RolloutRecord.from_dict(raw)
    assert record.to_dict() == raw and record.car.pairs == [(0, 1), (0, 2)]
    assert record.car.answers == [None, None]
    m = records_metrics(
        ["u0"] * 3,
        [o.extra_fields[RECORD_KEY] for o in outs],
        [o.reward_score for o in outs],
        confident_share=0.6,
        state=LoopState(),
    )
    assert m["car/unclosed"] == pytest.approx(3 / 6) and m["car/pool_size"] == 3.0


def test_car_prompt_ids_are_the_native_prompt_after_the_rollout_prompt(tok):
    """One CAR prompt in both backends: verl's ids decode to the rollout prompt followed by the
    native `car_text` of the native `cut_solutions`."""
    prompt = ids(tok, PROMPT, eos=False)
    s1, s2 = "2+2=4 so \\boxed{4} " * 3, "I think \\boxed{5}"
    out, cut = al.car_prompt_ids(tok, prompt, ids(tok, s1), ids(tok, s2), 10, 4096, 8)
    texts, flags = cut_solutions(tok, [s1, s2], 10)
    assert tok.decode(out) == PROMPT + car_text("", *texts) and cut == tuple(flags) == (True, True)


def test_agent_loop_answer_masks_follow_the_answer_span(tok, monkeypatch):
    """`omgrpo.algorithm.answer_span=closing`: the masks the worker hands verl are the native
    trainer's (`decode_responses` on the same responses), the brace and eos included."""
    worker, handed = make_worker(tok, monkeypatch, car=False)
    worker.omgrpo.algorithm.answer_span = "closing"
    texts = [*RESPONSES, "no answer"]
    outs = asyncio.run(run_group(worker, tok, texts))
    rows = [torch.tensor(o.response_ids) for o in outs]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    native = decode_responses(tok, ids, (ids != 0).long(), span="closing").answer_mask
    for k, (text, out) in enumerate(zip(texts, outs)):
        mask = handed[k][1][ANSWER_MASK_KEY]
        assert torch.equal(mask.bool(), native[k, : len(out.response_ids)])
        # one token per character: the answer digit, the closing brace and the eos after it
        digit = text.rindex("{") + 1 if "{" in text else None
        expected = [] if digit is None else [digit, digit + 1, len(text)]
        assert mask.nonzero().flatten().tolist() == expected


def test_agent_loop_hands_the_spans_the_generic_masks_read(tok, monkeypatch):
    """With a generic mask the worker also hands `omgrpo_span_<span>` (the native trainer's
    `Responses.span_masks`: `boxed` and the random mask's span), for the driver's step-wide
    draw; without one, no such field."""
    worker, handed = make_worker(tok, monkeypatch, car=False)
    asyncio.run(run_group(worker, tok, RESPONSES))
    assert not any(k.startswith(SPAN_MASK_PREFIX) for k in handed[0][1])
    worker, handed = make_worker(tok, monkeypatch, car=False)
    worker.omgrpo.algorithm.answer_span = "closing_only"
    worker.omgrpo.algorithm.random_mask = "closing"
    texts = [*RESPONSES, "no answer"]
    outs = asyncio.run(run_group(worker, tok, texts))
    rows = [torch.tensor(o.response_ids) for o in outs]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    native = decode_responses(
        tok, ids, (ids != 0).long(), span="closing_only", spans=("boxed", "closing")
    )
    for k, out in enumerate(outs):
        n, fields = len(out.response_ids), handed[k][1]
        assert torch.equal(fields[ANSWER_MASK_KEY].bool(), native.answer_mask[k, :n])
        for span in ("boxed", "closing"):
            assert torch.equal(fields[span_mask_key(span)].bool(), native.span_masks[span][k, :n])


# -- the process reward (PRM) ------------------------------------------------------------------
PRM_GROUPS = {
    "u0": ["7+5=12\n12*3=36\nSo \\boxed{36}.", "4-1=3\n\nSo \\boxed{3}.", "\\boxed{4}"],
    "u1": ["", "9*2=18\n18+40=58\n58-7=51\nSo \\boxed{51}.", "2+2=4\nthe answer: \\boxed{4}"],
}
PRM_QUESTIONS = {"u0": "Evaluate left to right: 7+5*3", "u1": "Evaluate left to right: 9*2+40-7"}


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    """A tiny random token-classification PRM with the toy world's BPE tokenizer, saved as a
    user's checkpoint would be (as tests/models/test_prm.py builds it)."""
    from toy_models import tiny_qwen3_config
    from transformers import Qwen3ForTokenClassification

    from omgrpo.models.tokenizer import build_bpe_tokenizer
    from omgrpo.models.toy import toy_corpus
    from omgrpo.tasks.toy import ToyWorldSpec, generate_sft_problems

    root = tmp_path_factory.mktemp("prm")
    torch.manual_seed(0)
    prm_tok = build_bpe_tokenizer(toy_corpus(generate_sft_problems(200, 0, ToyWorldSpec())))
    config = tiny_qwen3_config(prm_tok, num_labels=2)
    Qwen3ForTokenClassification(config).save_pretrained(root)
    prm_tok.save_pretrained(root)
    return root


def prm_overrides(path, prefix: str = "") -> list[str]:
    """method=prm with the tiny PRM; batches of 2 responses, so that batches cross groups."""
    return [
        "method=prm",
        f"{prefix}reward.prm.path={path}",
        f"{prefix}reward.prm.format=token_classification",
        f"{prefix}reward.prm.batch_size=2",
    ]


@pytest.mark.slow
def test_verl_and_native_give_the_same_process_rewards(tok, monkeypatch, prm_dir):
    """The same rollouts through verl's agent loop (two groups scored concurrently by one PRM
    server, its batches mixing the groups) and through the native score_step with the same
    checkpoint: the same step scores, aggregates, rewards and `prm/*` metrics, exactly."""
    from omgrpo.backends.verl.config import compose_verl
    from omgrpo.backends.verl.prm import PrmClient, PrmServer
    from omgrpo.models.prm import load_prm

    worker, _ = make_worker(tok, monkeypatch, car=False)
    section = compose_verl("paper_qwen3_1p7b", prm_overrides(prm_dir, "omgrpo.")).omgrpo
    worker.omgrpo = worker.config.omgrpo = section
    server = PrmServer(
        prm=load_prm(prm_dir, section.reward.prm, torch.device("cpu"), torch.float32)
    )
    batches, score_batch = [], server.prm.score_batch

    def recorded(items):  # the first batch waits (in its thread) until the second group queued
        wait_for(lambda: batches or len(server._pending) == 2)
        batches.append([q for q, _ in items])
        return score_batch(items)

    server.prm.score_batch = recorded

    def wait_for(condition):
        for _ in range(6000):
            if condition():
                return
            time.sleep(0.01)
        raise AssertionError("the second group was not queued within 60 s")

    async def both_groups():
        loop = asyncio.get_running_loop()

        def submit(questions, responses, deadline):
            if questions[0] == PRM_QUESTIONS["u1"]:  # u1 asks once u0 is queued
                wait_for(lambda: server._pending or batches)
            job = server.score(questions, responses, deadline)
            return asyncio.run_coroutine_threadsafe(job, loop).result()

        worker._prm = PrmClient(submit, section.reward.prm.budget_s)
        groups = [
            run_group(worker, tok, texts, uid=uid, index=i, question=PRM_QUESTIONS[uid])
            for i, (uid, texts) in enumerate(PRM_GROUPS.items())
        ]
        return [o for outs in await asyncio.gather(*groups) for o in outs]

    outs = asyncio.run(both_groups())
    # batches of 2 (reward.prm.batch_size), the second holding a response of each group: the
    # native trainer's batches of the step's six responses. (The same batches: a batched matmul
    # may round a row differently at another position or padded width, ~1e-8.)
    q0, q1 = PRM_QUESTIONS.values()
    assert batches == [[q0, q0], [q0, q1], [q1, q1]]

    problems = [
        Problem(id=f"toy/{i}", question=PRM_QUESTIONS[uid], answer="4")
        for i, uid in enumerate(PRM_GROUPS)
    ]
    responses = [torch.tensor(o.response_ids) for o in outs]
    ids = torch.nn.utils.rnn.pad_sequence(responses, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in responses], True)
    cfg = compose(prm_overrides(prm_dir))
    native_prm = load_prm(prm_dir, cfg.reward.prm, torch.device("cpu"), torch.float32)
    native = score_step(tok, ids, mask, problems, cfg, process=native_prm)

    records = [o.extra_fields[RECORD_KEY] for o in outs]
    assert [r["step_scores"] for r in records] == native.step_scores
    assert [len(s) for s in native.step_scores] == [3, 2, 1, 0, 4, 2]
    assert [r["process"] for r in records] == native.process
    assert [r["rewards"]["process"] for r in records] == native.reward_parts["process"].tolist()
    assert [o.reward_score for o in outs] == native.rewards.tolist()
    verl_m = records_metrics(
        [u for u, t in PRM_GROUPS.items() for _ in t],
        records,
        [o.reward_score for o in outs],
        confident_share=0.6,
        state=LoopState(),
    )
    native_m = native_step_metrics(native, LoopState(), 0.6)
    prm_keys = {k for k in native_m if k.startswith("prm/")}
    assert len(prm_keys) == 9 and prm_keys <= set(verl_m)
    for key in prm_keys:
        a, b = verl_m[key], native_m[key]
        assert a == b or (math.isnan(a) and math.isnan(b)), key


class CountingPrm:
    """A stand-in PRM: steps are lines, a step's score is its length / 10, batches recorded."""

    batch_size = 2

    def __init__(self):
        self.batches = []

    def steps(self, response):
        return response.split("\n")

    def score_batch(self, items):
        self.batches.append([steps for _, steps in items])
        return [[len(s) / 10 for s in steps] for _, steps in items]


def test_the_prm_server_batches_across_groups_within_their_deadlines():
    """Three groups queued while the server is busy are scored two responses per batch, oldest
    first; a group whose deadline passed before its turn gets None for what was not started."""
    from omgrpo.backends.verl.prm import PrmServer

    prm, now = CountingPrm(), [0.0]
    server = PrmServer(prm=prm, clock=lambda: now[0])

    async def scenario():
        a = asyncio.create_task(server.score(["q"] * 3, ["a", "bb", "ccc"], deadline=10))
        b = asyncio.create_task(server.score(["q"] * 2, ["d", "ee"], deadline=10))
        late = asyncio.create_task(server.score(["q"], ["f"], deadline=0.5))
        await asyncio.sleep(0)  # all three are queued before the first batch starts
        now[0] = 1.0  # by then the third group's deadline has passed
        return await asyncio.gather(a, b, late)

    a, b, late = asyncio.run(scenario())
    assert prm.batches == [[["a"], ["bb"]], [["ccc"], ["d"]], [["ee"]]]
    assert a == [[0.1], [0.2], [0.3]] and b == [[0.1], [0.2]] and late == [None]


def test_a_spent_prm_budget_leaves_the_group_unscored(tok, monkeypatch, prm_dir):
    """Budget 0: nothing is scored; every rollout gets the group's mean process score (0 when
    none was scored), as natively, and `prm/unscored_share` says so."""
    from omgrpo.backends.verl.prm import PrmClient, PrmServer

    worker, _ = make_worker(tok, monkeypatch, car=False)
    worker.omgrpo.reward.parts = ["process", "format"]
    prm = CountingPrm()
    server = PrmServer(prm=prm)

    async def one_group():
        loop = asyncio.get_running_loop()
        worker._prm = PrmClient(
            lambda q, r, d: asyncio.run_coroutine_threadsafe(server.score(q, r, d), loop).result(),
            budget_s=0.0,
        )
        return await run_group(worker, tok, PRM_GROUPS["u0"])

    outs = asyncio.run(one_group())
    records = [o.extra_fields[RECORD_KEY] for o in outs]
    assert prm.batches == [] and [r["step_scores"] for r in records] == [None] * 3
    assert [r["rewards"]["process"] for r in records] == [0.0] * 3
    m = records_metrics(
        ["u0"] * 3, records, [o.reward_score for o in outs], confident_share=0.6, state=LoopState()
    )
    assert m["prm/unscored_share"] == 1.0
