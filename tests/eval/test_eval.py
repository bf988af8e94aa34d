"""Benchmark evaluation: metrics by hand and by brute force, loaders on fixture files, suites,
checkpoint choice, and `omgrpo eval` end to end on a tiny toy run with a real MLflow store."""

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from omgrpo.core.accuracy import pass_at_k
from omgrpo.eval.checkpoints import CheckpointError, choose_checkpoint
from omgrpo.eval.data import BenchmarkDataError, convert, final_answer, load_benchmark
from omgrpo.eval.metrics import bootstrap_ci, majority_correct, summarize
from omgrpo.eval.suite import load_suite

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"


# -- metrics ------------------------------------------------------------------------------
def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong samples: always a correct one
    assert pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_pass_at_k_matches_the_closed_form_and_brute_force_over_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                closed = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
                assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)


def test_summary_metrics_on_a_hand_computed_table():
    # problem 1: answers classes 1,0,2,0, correct class 0; problem 2: all wrong, one unboxed
    correct = [[False, True, False, True], [False, False, False, False]]
    classes = [[1, 0, 2, 0], [0, 0, 1, None]]
    m = summarize(correct, classes, n_boot=200)["metrics"]
    assert m["avg@4"] == pytest.approx((0.5 + 0) / 2)
    assert m["pass@1"] == pytest.approx(0.25)
    assert m["pass@2"] == pytest.approx((5 / 6 + 0) / 2)
    assert m["pass@4"] == pytest.approx(0.5)
    assert m["maj@1"] == 0.0  # first sample of problem 1 is wrong
    assert m["maj@2"] == 0.0  # a 1-1 tie goes to the class seen first (wrong)
    assert m["maj@4"] == 0.5  # class 0 has two votes and is right
    assert m["extract_rate"] == pytest.approx((1 + 0.75) / 2)
    assert set(m) == {
        "avg@4",
        "pass@1",
        "pass@2",
        "pass@3",
        "pass@4",
        "maj@1",
        "maj@2",
        "maj@4",
        "extract_rate",
    }


def test_majority_without_any_answer_is_wrong():
    assert majority_correct([None, None], [False, False]) is False


def test_bootstrap_ci_contains_the_mean_and_collapses_on_constant_scores():
    rng = np.random.default_rng(0)
    scores = {"a": rng.random(50), "b": np.full(50, 0.3)}
    ci = bootstrap_ci(scores, n_boot=500, seed=1)
    assert ci["a"][0] < scores["a"].mean() < ci["a"][1]
    assert ci["b"] == pytest.approx((0.3, 0.3))
    assert bootstrap_ci(scores, n_boot=500, seed=1) == ci  # deterministic by seed
    # the classical normal-approximation interval of the mean, as a sanity bound
    half = 1.96 * scores["a"].std(ddof=1) / np.sqrt(50)
    assert ci["a"] == pytest.approx(
        (scores["a"].mean() - half, scores["a"].mean() + half), abs=0.02
    )
    assert bootstrap_ci({"a": np.array([0.7])}) == {"a": (0.7, 0.7)}  # one problem


# -- loaders ------------------------------------------------------------------------------
def test_loaders_read_each_common_format(tmp_path):
    math500 = load_benchmark(FIXTURES / "math500.jsonl")
    assert math500[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert math500[1].id == "test/prealgebra/1.json"
    gsm = load_benchmark(FIXTURES / "gsm8k.jsonl", answer_format="gsm8k")
    assert [p.answer for p in gsm] == ["72", "2000"]  # after '####', commas dropped
    assert gsm[0].question.startswith("Natalia")
    parquet = tmp_path / "gsm8k.parquet"
    pd.read_json(FIXTURES / "gsm8k.jsonl", lines=True).to_parquet(parquet)
    assert [p.answer for p in load_benchmark(parquet)] == ["72", "2000"]  # '####' detected
    aime = load_benchmark(FIXTURES / "aime24.jsonl")
    assert [(p.id, p.answer) for p in aime] == [("60", "204"), ("61", "25")]
    aime_parquet = tmp_path / "aime.parquet"  # integer answers read back as numpy integers
    pd.DataFrame({"problem": ["p", "q"], "answer": [204, 25]}).to_parquet(aime_parquet)
    assert [p.answer for p in load_benchmark(aime_parquet)] == ["204", "25"]
    amc = load_benchmark(FIXTURES / "amc.json")  # TTRL's `prompt` key, float answers
    assert [p.answer for p in amc] == ["2", "0.5"]


def test_bad_rows_are_reported_by_file_and_row():
    path = FIXTURES / "bad.jsonl"
    with pytest.raises(BenchmarkDataError) as err:
        load_benchmark(path)
    msg = str(err.value)
    assert "2 bad row(s) of 4" in msg
    assert f"{path}, line 2: no answer column" in msg  # JSONL rows are named by line
    assert f"{path}, line 3: empty or non-text 'question'" in msg
    with pytest.raises(BenchmarkDataError, match=r"line 4: GSM8K answer without a final"):
        load_benchmark(path, answer_format="gsm8k")
    with pytest.raises(BenchmarkDataError, match=r"line 1: no 'query' column"):
        load_benchmark(FIXTURES / "gsm8k.jsonl", question_key="query")


def test_final_answer_forms():
    assert final_answer(27.0) == "27"
    assert final_answer("  x^2 ") == "x^2"
    assert final_answer("work\n#### 1,234") == "1234"
    with pytest.raises(ValueError):
        final_answer(float("nan"))


def test_convert_from_a_file_and_a_saved_dataset(tmp_path):
    out, n = convert(FIXTURES / "gsm8k.jsonl", tmp_path / "gsm8k.jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == 2 and rows[0]["answer"] == "72" and set(rows[0]) == {"id", "question", "answer"}
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "aime_2024"
    datasets.Dataset.from_list(
        [{"id": 1, "problem": "p", "answer": "7"}, {"id": 2, "problem": "q", "answer": "8"}]
    ).save_to_disk(str(saved))
    out, n = convert(saved, tmp_path / "aime.parquet")
    assert n == 2 and pd.read_parquet(out)["answer"].tolist() == ["7", "8"]


# -- suites and checkpoint choice ---------------------------------------------------------
def test_builtin_and_yaml_suites(tmp_path):
    paper = load_suite("paper")
    assert {b.name: b.k for b in paper.benchmarks} == {
        "aime24": 16,
        "aime25": 16,
        "math500": 4,
        "gsm8k": 4,
        "amc": 8,
    }
    assert {(b.temperature, b.top_p) for b in paper.benchmarks} == {(0.8, 0.95)}
    spec = tmp_path / "mine.yaml"
    spec.write_text(
        "name: mine\ndefaults: {temperature: 0.6, max_new_tokens: 32}\n"
        "benchmarks:\n  gsm: {path: g.jsonl, k: 2, answer_format: gsm8k}\n"
    )
    suite = load_suite(str(spec))
    (b,) = suite.benchmarks
    assert (suite.name, b.name, b.k, b.temperature, b.max_new_tokens) == ("mine", "gsm", 2, 0.6, 32)
    spec.write_text("benchmarks:\n  gsm: {path: g.jsonl, k: 2, temp: 1}\n")
    with pytest.raises(ValueError, match=r"benchmarks.gsm: unknown key\(s\) \['temp'\]"):
        load_suite(str(spec))


def test_best_checkpoint_never_selects_on_test_data(tmp_path):
    with pytest.raises(CheckpointError, match="test-time-training run"):
        choose_checkpoint(tmp_path, "best", {"task": {"ttt": True}})
    files = {"task": {"name": "files", "val_path": "data/math500.jsonl"}}
    with pytest.raises(CheckpointError, match="is a benchmark of this suite"):
        choose_checkpoint(tmp_path, "best", files, test_paths=("data/math500.jsonl",))
    with pytest.raises(CheckpointError, match="split 'val'"):
        choose_checkpoint(tmp_path, "best", {"task": {}}, split="test")


def _fake_run(root, val_acc_by_step):
    """A run directory with complete checkpoints at the given steps and their val/acc."""
    from omgrpo.tracking.store import RunStore

    store = RunStore(root / "run")
    for step, acc in val_acc_by_step.items():
        store.checkpoint_dir(step).mkdir(parents=True)
        (store.checkpoint_dir(step) / "COMPLETE").write_text(str(step))
        store.log_metrics(step, {"val/acc": acc})
    return store


def test_checkpoint_choice_and_keep_best(tmp_path):
    store = _fake_run(tmp_path, {10: 0.4, 20: 0.7, 30: 0.5, 40: 0.6})
    config = {"task": {"name": "toy"}}
    best = choose_checkpoint(store.dir, "best", config)
    assert (best.step, best.selected_by["value"]) == (20, 0.7)
    assert best.selected_by["candidates"] == {10: 0.4, 20: 0.7, 30: 0.5, 40: 0.6}
    assert choose_checkpoint(store.dir, "last", config).step == 40
    assert choose_checkpoint(store.dir, "step_30", config).path.endswith("step_000030")
    assert choose_checkpoint(store.dir, "base", config).path is None
    with pytest.raises(CheckpointError, match="available: step_10, step_20, step_30, step_40"):
        choose_checkpoint(store.dir, "step_5", config)
    store.prune_checkpoints(1, keep_best="val/acc")  # the newest and the best survive
    assert sorted(store.checkpoints_by_step()) == [20, 40]
    store.prune_checkpoints(1)
    assert sorted(store.checkpoints_by_step()) == [40]


def test_vllm_backend_maps_the_settings_and_returns_the_native_format(monkeypatch):
    """The vLLM adapter against a stand-in `vllm` module (vLLM itself needs a GPU)."""
    import sys
    import types

    from omgrpo.core.task import Problem
    from omgrpo.eval.sampler import VLLMSampler
    from omgrpo.eval.suite import BenchmarkSpec
    from omgrpo.models.tokenizer import build_char_tokenizer

    calls = {}

    class LLM:
        def __init__(self, model, dtype, **kwargs):
            calls["model"] = model

        def generate(self, prompts, params, use_tqdm):
            calls["prompts"], calls["params"] = prompts, params
            out = types.SimpleNamespace
            return [
                out(outputs=[out(text=f"{i}-{j}") for j in range(params.n)])
                for i in range(len(prompts))
            ]

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = LLM, lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    sampler = VLLMSampler("/models/x", build_char_tokenizer())
    spec = BenchmarkSpec("b", "b.jsonl", k=3, temperature=0.7, top_p=0.9, max_new_tokens=11)
    texts = sampler.generate([Problem("p0", "1+1", "2"), Problem("p1", "2+2", "4")], spec)
    assert texts == [["0-0", "0-1", "0-2"], ["1-0", "1-1", "1-2"]]
    p = calls["params"]
    assert (p.n, p.temperature, p.top_p, p.max_tokens) == (3, 0.7, 0.9, 11)
    assert calls["prompts"][0]["prompt_token_ids"]  # the trainer's rendered prompt


def test_sweep_eval_step_runs_omgrpo_eval_on_finished_runs(tmp_path, monkeypatch):
    import subprocess

    from omgrpo import sweep

    runs = []
    for name, state in (("a", "finished"), ("b", "failed")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "status.json").write_text(json.dumps({"state": state}))
        runs.append(sweep.PlannedRun(name, tmp_path, [], "skip"))
    seen = []
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda cmd, **kw: seen.append(cmd[3:]) or subprocess.CompletedProcess(cmd, 0),
    )
    assert sweep._evaluate(runs, "toy", ["base", "last"], jobs=1) == 0
    assert sorted(seen) == [
        ["eval", str(tmp_path / "a"), "--suite", "toy", "--checkpoint", c] for c in ("base", "last")
    ]


# -- end to end ---------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """One torch thread for the tiny model (far faster on a shared 2-core machine), restored
    afterwards so later tests keep torch's default."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_eval_cli_on_a_tiny_toy_run_writes_parquet_summary_and_mlflow(
    tiny_overrides, tmp_path, one_thread
):
    from omgrpo.backends.native.trainer import train
    from omgrpo.cli import main
    from omgrpo.config import compose
    from omgrpo.tracking import mlflow_client, sanitize_metric_name
    from omgrpo.tracking.store import RunStore

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = train(
        compose(
            [
                *tiny_overrides,
                "trainer.steps=4",
                "trainer.save_every=2",
                "trainer.keep_checkpoints=1",
                "tracking.mlflow=true",
                f"tracking.mlflow_uri={uri}",
                "task.n_test=5",
                "trainer.threads=1",
            ]
        )
    )
    assert sorted(RunStore(run).checkpoints_by_step()) in ([2, 4], [4])  # best kept, or it is 4

    best_args = ["eval", str(run), "--suite", "toy", "--checkpoint", "best", "--threads", "1"]
    assert main(best_args) == 0
    out = run / "eval" / "toy-best"
    table = pd.read_parquet(out / "toy_test.parquet")
    assert len(table) == 5 * 8
    assert {"prompt_id", "sample", "text", "answer", "gold", "correct"} <= set(table.columns)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpoint"]["name"] == "best"
    assert summary["checkpoint"]["selected_by"]["metric"] == "val/acc"
    best = RunStore(run).best_checkpoint("val/acc")
    assert summary["checkpoint"]["step"] == best[0]
    bench = summary["benchmarks"]["toy_test"]
    assert bench["settings"]["temperature"] == 0.8 and bench["settings"]["top_p"] == 0.95
    assert bench["metrics"]["avg@8"] == pytest.approx(table["correct"].mean())
    assert {f"pass@{k}" for k in range(1, 9)} <= set(bench["metrics"])
    assert set(bench["ci95"]) == set(bench["metrics"])
    assert summary["grader"]["source_sha256"]

    client = mlflow_client(uri)
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    key = sanitize_metric_name("eval/toy-best/toy_test/avg@8")
    assert mlrun.data.metrics[key] == pytest.approx(bench["metrics"]["avg@8"])
    assert sanitize_metric_name("val/acc") in mlrun.data.metrics  # the training history stays

    # resumable: a finished benchmark is kept, not sampled again
    mtime = (out / "toy_test.parquet").stat().st_mtime_ns
    assert main([*best_args, "--no-track"]) == 0
    assert (out / "toy_test.parquet").stat().st_mtime_ns == mtime

    assert main(["eval", str(run), "--suite", "toy", "--checkpoint", "step_99"]) == 2
