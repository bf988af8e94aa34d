"""Real verl 0.9.1 training steps of omgrpo's plugin, on the CPU (issue 13).

`omgrpo train backend=verl` runs in a fresh process with verl's own trainer, Ray, FSDP2 workers,
TransferQueue and agent loop; the test-only harness (`tests/verl_cpu/`) adds only what verl lacks
on a CPU (a cpu platform, an "hf" rollout server). The plugin is loaded through its real
`verl.plugins` entry point. Everything asserted comes from what the processes wrote: verl's file
logger (the driver's metrics, checked by the GPU smoke test's `check_run`) and the rollout
server's request log.

Each verl process costs ~2 min of startup on 2 cores, so the checks share processes: one run of
OM-GRPO with CAR (2 steps, collapse stop forced), and one run each of `method=mv` and
`method=gt` (1 step), side by side.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "verl_cpu"))
import harness

from omgrpo.backends.verl.smoke import COLLAPSE_AT_STEP_2, check_run, read_metrics

pytestmark = pytest.mark.slow

TIMEOUT_S = 900  # per verl process (a guard against hangs; ~2 min each on 2 idle cores)
G = 8
PROMPTS = 2  # data.train_batch_size


@pytest.fixture(scope="module")
def setup(base_cache, tmp_path_factory):
    base = harness.build_toy_base(Path(base_cache))
    train, val = harness.write_data(tmp_path_factory.mktemp("verl-data"))
    return base, train, val


def _run(out: Path, setup, steps: int, extra: list[str]) -> dict[int, dict]:
    base, train, val = setup
    args = harness.overrides(base, train, val, steps, G) + extra
    rc = harness.run_train(out, args, timeout=TIMEOUT_S)
    log = (out / "train.log").read_text()
    assert rc == 0, f"verl run failed (exit code {rc}):\n{log[-6000:]}"
    return read_metrics(out / "metrics.jsonl")


def _served_by_version(out: Path, tokenizer) -> dict[int, tuple[list[str], list[str]]]:
    """The hf server's generations (decoded), by the step of the weights that served them:
    (rollouts, CAR pair answers: their prompts hold two solutions)."""
    by_version = defaultdict(lambda: ([], []))
    for r in harness.read_jsonl(out / "server.jsonl"):
        is_car = "[Solution 1]" in tokenizer.decode(r["prompt_ids"])
        text = tokenizer.decode(r["token_ids"], skip_special_tokens=True)
        by_version[r["global_steps"]][int(is_car)].append(text)
    return dict(by_version)


def test_om_grpo_car_two_steps_and_collapse_stop(setup, tmp_path, metric_table):
    """2 OM-GRPO steps (w = 0, soft vote + format, CAR); the collapse detector is forced to fire
    at step 2 with `stop=true`, so a 3-step run ends after step 2."""
    from transformers import AutoTokenizer

    from omgrpo.core.answers import extract_boxed
    from omgrpo.core.car import read_pair_answer

    steps = _run(tmp_path, setup, steps=3, extra=COLLAPSE_AT_STEP_2)
    problems = check_run(
        steps,
        expect_steps=2,
        answer_weight=0.0,
        car=True,
        reward_parts=("soft_vote", "format"),
        collapse_step=2,
    )
    assert not problems, "\n".join(problems)
    logged = {name for m in steps.values() for name in m}
    assert metric_table.undocumented(logged, "verl") == []  # docs/metrics.md
    log = (tmp_path / "train.log").read_text()
    assert "omgrpo: collapse detected at step 2" in log
    assert "ending training after step 2" in log
    assert steps[2]["kl/reasoning"] > 0  # the policy moved in step 1 (the KL is 0 in step 1)

    # The soft vote and CAR scored what the rollout server generated in that step.
    served = _served_by_version(tmp_path, AutoTokenizer.from_pretrained(setup[0]))
    assert len(served) == 2, f"weights of steps {sorted(served)} served, expected 2 versions"
    for (step, m), version in zip(sorted(steps.items()), sorted(served)):
        rollouts, pairs = served[version]
        assert len(rollouts) == PROMPTS * G and len(pairs) == PROMPTS * G * (G - 1), step
        boxed = sum(extract_boxed(t) is not None for t in rollouts)
        assert m["answers/extract_rate"] == pytest.approx(boxed / len(rollouts)), step
        read = [read_pair_answer(t) for t in pairs]
        unclosed = sum(not r.closed for r in read)  # an empty answer is closed
        assert m["car/unclosed"] == pytest.approx(unclosed / len(pairs)), step
        # the pool: G rollouts + the group's valid pair answers, averaged over the groups
        votes = sum(r.answer is not None for r in read)
        assert m["car/pool_size"] == pytest.approx(G + votes / PROMPTS), step


def test_mv_and_gt_one_step(setup, tmp_path):
    """One step each of majority voting and the GT reward (w = 1), run side by side (two verl
    processes at once: ~1 min less than one after the other on 2 cores): answer tokens keep
    their advantage, so their share of the PG weight is > 0 (exactly 0 with w = 0 above)."""
    parts = {"mv": "majority_vote", "gt": "gt"}
    # GT rewards are sparser (the toy base gets ~1 in 3 right): 4 prompts for gt
    extra = {"mv": ["method=mv"], "gt": ["method=gt", "data.train_batch_size=4"]}
    with ThreadPoolExecutor(len(parts)) as pool:
        runs = {m: pool.submit(_run, tmp_path / m, setup, 1, extra[m]) for m in parts}
        steps = {m: run.result() for m, run in runs.items()}
    for method, part in parts.items():
        problems = check_run(
            steps[method], expect_steps=1, answer_weight=1.0, car=False, reward_parts=(part,)
        )
        assert not problems, f"method={method}:\n" + "\n".join(problems)
        assert "reward/soft_vote" not in steps[method][1], method
    # the GT reward is the correctness the diagnostics measure
    assert steps["gt"][1]["reward/gt"] == pytest.approx(steps["gt"][1]["acc/train"])
