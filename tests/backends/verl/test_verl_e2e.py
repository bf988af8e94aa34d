"""Real verl 0.9.1 training steps of omgrpo's plugin, on the CPU (the pieces' tests cannot see a
mask or metric lost between verl's processes).

`omgrpo train backend=verl` runs in a fresh process with verl's own trainer, Ray, FSDP2 workers,
TransferQueue and agent loop; the test-only harness (`tests/verl_cpu/`) adds only what verl lacks
on a CPU (a cpu platform, an "hf" rollout server) and a reward part that differs within every
group (`omgrpo_cpu_reward`: advantages of both signs in every step by construction). The plugin
is loaded through its real `verl.plugins` entry point. Everything asserted comes from what the
processes wrote: verl's file logger (the driver's metrics, checked by the GPU smoke test's
`check_run`) and the rollout server's request log.

Each verl process costs ~2 min of startup on 2 cores (a dozen processes that each import verl),
so the tests share one run, started once for the module (a module fixture; `make test` hands
each test file to one pytest-xdist worker, `--dist loadfile`): OM-GRPO with CAR at w = 0 (a
validation before training, 2 steps, collapse stop forced, a checkpoint at step 2) whose reward also holds the parts of the
other methods tested here, majority voting, GT and the PRM's process reward (a tiny random PRM
in its Ray actor). Each part is logged on its own, so each method's reward is checked as in a
run of that method alone; that `method=mv` / `method=gt` / `method=prm` select exactly their
part at w = 1 without CAR is checked on their composed configs (a second verl run at w = 1 cost
~3 min of the suite; the loss at w = 1 is checked against the native one in
`test_verl_dapo.py`). The run's omgrpo run store is then read as a native run's:
`omgrpo report` (collapse verdict, figures), `omgrpo export` (verl's model merger) ->
`transformers` (the actor's log-probs) -> `omgrpo eval`.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parent / "verl_cpu"))
import harness
from toy_models import tiny_qwen3_config

from omgrpo.backends.verl.smoke import COLLAPSE_AT_STEP_2, check_run, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TIMEOUT_S = 900  # per verl process (a guard against hangs; ~2 min each on 2 idle cores)
G = 8
PROMPTS = 2  # data.train_batch_size
SPREAD = "harness_spread"  # verl_cpu/omgrpo_cpu_reward.py: i * 1e-3 for rollout i of a group
PARTS = ("soft_vote", "format", "majority_vote", "gt", "process", SPREAD)


@pytest.fixture(scope="module")
def setup(base_cache, tmp_path_factory):
    base = harness.build_toy_base(Path(base_cache))
    train, val = harness.write_data(tmp_path_factory.mktemp("verl-data"))
    return base, train, val


RUN_NAME = "paper_qwen3_1p7b__om_grpo__s0"  # the preset's <experiment>__<variant>__s<seed>


def _parts(parts: tuple[str, ...]) -> str:
    return f"omgrpo.reward.parts=[{','.join(parts)}]"


@pytest.fixture(scope="module")
def om_grpo_run(setup, tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """3 OM-GRPO steps asked for (w = 0, CAR; reward: the soft vote, format, majority vote, GT
    and the process reward of a tiny random token-classification PRM in its Ray actor) with the
    collapse detector forced to fire at step 2 and `stop=true`; a validation before training
    (step 0: `problems.parquet`), a checkpoint at step 2 (the export below), the rollouts of
    both steps in the run store. (its folder, verl's logged training steps)"""
    out = tmp_path_factory.mktemp("om_grpo")
    prm = tiny_prm(setup[0], out / "prm")
    store_args = ["trainer.save_freq=2", "omgrpo.run.log_rollouts_every=1"]
    prm_args = [f"omgrpo.reward.prm.path={prm}", "omgrpo.reward.prm.format=token_classification"]
    extra = [*COLLAPSE_AT_STEP_2, *store_args, _parts(PARTS), *prm_args, VALIDATE_FIRST]
    logged = _run(out, setup, steps=3, extra=extra)
    return out, {step: m for step, m in logged.items() if step > 0}


VALIDATE_FIRST = "trainer.val_before_train=true"
VAL_SAMPLES = 4  # the preset's actor_rollout_ref.rollout.val_kwargs.n


def _run(out: Path, setup, steps: int, extra: list[str]) -> dict[int, dict]:
    base, train, val = setup
    replaced = {e.split("=", 1)[0] for e in extra}
    args = [
        a for a in harness.overrides(base, train, val, steps, G) if a.split("=")[0] not in replaced
    ]
    args += [f"run.root={out / 'runs'}", *extra]
    rc = harness.run_train(out, args, timeout=TIMEOUT_S)
    log = (out / "train.log").read_text()
    assert rc == 0, f"verl run failed (exit code {rc}):\n{log[-6000:]}"
    return read_metrics(out / "metrics.jsonl")


def _served_by_version(
    out: Path, tokenizer, val_file: Path, validation: bool = False
) -> dict[int, tuple[list[str], list[str]]]:
    """The hf server's generations (decoded), by the step of the weights that served them:
    (rollouts, CAR pair answers: their prompts hold two solutions); those of the training steps,
    or with `validation` those of the validation (prompts holding a validation question)."""
    prompts = pd.read_parquet(val_file)["prompt"]
    questions = [m["content"] for p in prompts for m in p if m["role"] == "user"]
    by_version = defaultdict(lambda: ([], []))
    for r in harness.read_jsonl(out / "server.jsonl"):
        prompt = tokenizer.decode(r["prompt_ids"])
        if any(q in prompt for q in questions) != validation:
            continue
        text = tokenizer.decode(r["token_ids"], skip_special_tokens=True)
        by_version[r["global_steps"]][int("[Solution 1]" in prompt)].append(text)
    return dict(by_version)


def test_om_grpo_car_two_steps_and_collapse_stop(om_grpo_run, setup, tmp_path, metric_table):
    """2 OM-GRPO steps (w = 0, CAR); the collapse detector is forced to fire at step 2 with
    `stop=true`, so a 3-step run ends after step 2."""
    from transformers import AutoTokenizer

    from omgrpo.core.answers import extract_boxed
    from omgrpo.core.car import read_pair_answer

    out, steps = om_grpo_run
    problems = check_run(
        steps,
        expect_steps=2,
        answer_weight=0.0,
        car=True,
        reward_parts=PARTS,
        collapse_step=2,
    )
    assert not problems, "\n".join(problems)
    # the harness's spread gives every step advantages of both signs, so the w = 0 check above
    # (answer tokens hold exactly 0 of the PG weight) ran on both steps
    assert all(m["critic/advantages/max"] > 0 > m["critic/advantages/min"] for m in steps.values())
    logged = {name for m in steps.values() for name in m}
    assert metric_table.undocumented(logged, "verl") == []  # docs/metrics.md
    log = (out / "train.log").read_text()
    assert "omgrpo: collapse detected at step 2" in log
    assert "ending training after step 2" in log
    assert steps[2]["kl/reasoning"] > 0  # the policy moved in step 1 (the KL is 0 in step 1)

    # The soft vote and CAR scored what the rollout server generated in that step.
    served = _served_by_version(out, AutoTokenizer.from_pretrained(setup[0]), setup[2])
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
    check_run_store(out / "runs" / RUN_NAME, steps, served)
    check_report_export_eval(out / "runs" / RUN_NAME, tmp_path, setup)


def test_mv_and_gt_parts_and_their_methods(om_grpo_run, setup):
    """Majority voting's and the GT reward's parts in verl steps: each is logged, and the GT
    reward is the correctness the diagnostics measure. `method=mv` and `method=gt` select
    exactly that: their part, w = 1, no CAR (and `method=prm` the process reward + format)."""
    from omgrpo.backends.verl.config import compose_verl

    out, steps = om_grpo_run
    for step, m in steps.items():
        assert m["reward/gt"] == pytest.approx(m["acc/train"]), step
        assert 0 <= m["reward/majority_vote"] <= 1, step

    base, train, val = setup
    args = [a for a in harness.overrides(base, train, val, 1, G) if not a.startswith("experiment=")]
    prm = f"omgrpo.reward.prm.path={out / 'prm'}"  # method=prm refuses a null path on verl
    for method, part in {"mv": "majority_vote", "gt": "gt", "prm": "process"}.items():
        om = compose_verl("paper_qwen3_1p7b", [*args, f"method={method}", prm]).omgrpo
        assert list(om.reward.parts) == ([part, "format"] if part == "process" else [part])
        assert om.algorithm.answer_weight == 1.0 and om.car.enable is False, method


def tiny_prm(base: Path, out: Path) -> Path:
    """A tiny random token-classification PRM reading the toy base's tokenizer, saved as a
    user's checkpoint would be (its scores are noise: enough to make rewards differ)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForTokenClassification

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    config = tiny_qwen3_config(tokenizer, num_layers=1, num_labels=2)
    Qwen3ForTokenClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_prm_process_reward(om_grpo_run, metric_table):
    """The PRM's process reward in verl steps (the appendix's PRM baselines): the PRM actor
    loads the checkpoint on the CPU, the agent loop's groups get the process reward, and the
    PRM's diagnostics reach verl's log under the native names."""
    out, steps = om_grpo_run
    for step, m in steps.items():
        assert metric_table.undocumented(set(m), "verl") == []  # docs/metrics.md
        assert m["prm/unscored_share"] == 0.0 and m["prm/steps_per_response"] > 0, step
        assert 0 < m["prm/step_score_mean"] < 1, step
        # no rollout was left unscored, so the process reward is the aggregate itself
        assert m["reward/process"] == pytest.approx(m["prm/aggregate_mean"]), step
    check_prm_rollouts(out / "runs" / RUN_NAME)


def test_validation_writes_each_problems_row(om_grpo_run, setup):
    """verl's validation before training (step 0, 4 samples of each validation problem) wrote
    `problems.parquet` as a native validation does: one row per validation problem, whose
    accuracies average to the `val/acc` verl logged, each modal answer's share in (0, 1]."""
    from transformers import AutoTokenizer

    from omgrpo.tracking.store import RunStore

    out, _ = om_grpo_run
    served = _served_by_version(out, AutoTokenizer.from_pretrained(setup[0]), setup[2], True)
    samples = [text for rollouts, _ in served.values() for text in rollouts]
    assert len(samples) == harness.N_VAL * VAL_SAMPLES
    validation = read_metrics(out / "metrics.jsonl")[0]
    table = RunStore(out / "runs" / RUN_NAME).read_problems()
    assert (table["step"] == 0).all() and len(table) == harness.N_VAL
    assert table["problem_id"].is_unique
    assert table["accuracy"].mean() == pytest.approx(validation["val/acc"])
    answered = table["modal_answer"].notna()
    assert answered.any() and table.loc[answered, "modal_share"].between(0, 1).all()
    assert (table.loc[answered, "modal_share"] > 0).all()


def check_prm_rollouts(run_dir: Path) -> None:
    """The run store's rollouts of step 1 hold each rollout's step scores, and its process
    reward is their minimum (`reward.prm.aggregate=min`; the table rounds to 4 decimals)."""
    table = pd.read_parquet(run_dir / "rollouts" / "step_000001.parquet")
    assert len(table) == PROMPTS * G
    for scores, reward in zip(table["prm_step_scores"], table["reward_process"]):
        steps = [float(x) for x in scores.split()]
        assert steps and reward == pytest.approx(min(steps), abs=1e-4)


def check_run_store(run_dir: Path, steps: dict[int, dict], served: dict) -> None:
    """The verl run wrote the native run store: config, identity, provenance, status, every
    logged metric (as verl's file logger got them) and each step's rollouts."""
    from omgrpo.tracking.store import RunStore

    store = RunStore(run_dir)
    config = store.read_config()
    assert config["backend"] == "verl" and config["run"]["name"] == RUN_NAME
    assert config["seed"] == 0 and config["algorithm"]["answer_weight"] == 0.0
    assert config["verl"]["trainer"]["default_local_dir"] == str(run_dir / "checkpoints")
    assert len(store.peek_uuid()) == 32 and store.read_provenance()["versions"]["verl"]
    status = store.read_status()
    assert (status["state"], status["step"], status["collapse_step"]) == ("collapsed", 2, 2)
    rows = dict(store.metric_rows())
    assert sorted(rows) == [0, *sorted(steps)] and sorted(steps) == [1, 2]  # 0: validation
    for step, logged in steps.items():  # same names and values as verl's file logger
        assert rows[step].keys() == logged.keys(), step
        assert rows[step] == pytest.approx(logged, nan_ok=True), step
    for (step, path), version in zip(store.rollout_files(), sorted(served)):
        table = pd.read_parquet(path)
        assert len(table) == PROMPTS * G and (table["step"] == step).all()
        assert table.groupby("prompt_id").size().tolist() == [G] * PROMPTS
        assert sorted(table["text"]) == sorted(served[version][0])  # what the server generated
        # each prompt's question (its chat prompt's user message), the same on its G rows
        assert (table["question"] != "").all()
        assert (table.groupby("prompt_id")["question"].nunique() == 1).all()
        m = steps[step]
        assert table["reward"].mean() == pytest.approx(m["reward/total"])
        assert table["answer"].notna().mean() == pytest.approx(m["answers/extract_rate"])
        assert table["correct"].astype(float).mean() == pytest.approx(m["acc/train"])
        # A_i as verl's GRPO step computed it (per prompt: mean 0; the batch's extremes). A_i =
        # (r_i - mean) / (std + 1e-6) in float32, so the group's sum carries the reward's round-off
        # divided by its spread: mean 0 is checked in reward units, where that round-off is ~1e-7
        group = table.groupby("prompt_id")
        spread = group["reward"].std() + 1e-6
        assert (group["advantage"].sum() * spread).abs().max() < 1e-5
        assert table["advantage"].max() == pytest.approx(m["critic/advantages/max"], abs=1e-5)
        assert table["advantage"].min() == pytest.approx(m["critic/advantages/min"], abs=1e-5)


def check_report_export_eval(run_dir: Path, tmp_path: Path, setup) -> None:
    """`omgrpo report` reads the run (collapse verdict, figures); `omgrpo export` merges its
    step-2 checkpoint with verl's model merger into a directory that `transformers` loads with
    the actor's weights (same log-probs) and `omgrpo eval` evaluates; seed 1 composes to its
    own run directory and checkpoint folder."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omgrpo import cli
    from omgrpo.backends.verl.config import compose_verl

    assert cli.main(["report", str(run_dir), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "collapsed at step 2" in report
    assert list((tmp_path / "report" / "figures").glob("*.png")), report

    out = tmp_path / "export"
    assert cli.main(["export", str(run_dir), str(out)]) == 0
    meta = json.loads((out / "omgrpo_export.json").read_text())
    assert (meta["step"], meta["config"]["backend"]) == (2, "verl")
    # verl's merger writes bfloat16 (fsdp_model_merger.py casts each shard): the exported
    # weights are the actor's saved fp32 weights rounded to bf16, bit for bit, and give the
    # log-probs of the actor with those weights
    actor = run_dir / "checkpoints" / "global_step_2" / "actor"
    shard = torch.load(actor / "model_world_size_1_rank_0.pt", weights_only=False)
    weights = {k: v.to_local().to(torch.bfloat16) for k, v in shard.items()}
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, weights[name].float()), name
    actor_model = AutoModelForCausalLM.from_pretrained(setup[0], dtype=torch.float32).eval()
    actor_model.load_state_dict({k: v.float() for k, v in weights.items()})
    base = AutoModelForCausalLM.from_pretrained(setup[0], dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(out)("2 + 3 = \\boxed{5}", return_tensors="pt").input_ids
    with torch.no_grad():
        logp = [m(ids).logits.log_softmax(-1) for m in (exported, actor_model, base)]
    torch.testing.assert_close(logp[0], logp[1], rtol=0, atol=1e-6)
    assert not torch.allclose(logp[0], logp[2], atol=1e-3)  # the two updates moved it

    suite = tmp_path / "suite.yaml"
    problems = tmp_path / "toy4.jsonl"
    rows = pd.read_parquet(setup[2])
    problems.write_text(
        "".join(
            json.dumps({"question": p[0]["content"], "answer": r["ground_truth"]}) + "\n"
            for p, r in zip(rows["prompt"][:4], rows["reward_model"][:4])
        )
    )
    suite.write_text(
        f"benchmarks:\n  toy4: {{path: {problems}, k: 2, max_new_tokens: 64, limit: 4}}\n"
    )
    evals = tmp_path / "eval"
    assert (
        cli.main(["eval", str(out), "--suite", str(suite), "--out", str(evals), "--no-track"]) == 0
    )
    summary = json.loads((evals / "summary.json").read_text())
    assert "toy4" in json.dumps(summary)

    # two seeds, two run directories and checkpoint folders (composed with the run's own
    # overrides: a second verl process would cost ~2 min)
    base_dir, train, val = setup
    args = [*harness.overrides(base_dir, train, val, 3, G), f"run.root={run_dir.parent}"]
    seed1 = compose_verl(
        "paper_qwen3_1p7b", [a for a in args if not a.startswith("experiment=")] + ["seed=1"]
    )
    folder1 = Path(seed1.trainer.default_local_dir)
    assert folder1 == run_dir.parent / RUN_NAME.replace("__s0", "__s1") / "checkpoints"
    assert folder1 != run_dir / "checkpoints" and not folder1.exists()
    assert seed1.data.seed == 1
