"""`omgrpo data prepare --backend verl`: the benchmark fixtures (MATH500, GSM8K, AIME, AMC) and
toy splits become verl's RL rows through `omgrpo eval`'s loaders; a bad row is named and
nothing is written; verl's own RLHFDataset reads the result."""

from pathlib import Path

import pandas as pd
import pytest

from omgrpo.cli import main
from omgrpo.config import compose
from omgrpo.core.prompt import build_messages
from omgrpo.eval.data import load_benchmark
from omgrpo.tasks.registry import TASKS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
TOY = ["task.n_train=6", "task.n_val=3", "task.n_test=4"]


def _rows(path: Path) -> list[dict]:
    return pd.read_parquet(path).to_dict(orient="records")


def test_each_benchmark_format_becomes_verl_rows(tmp_path, capsys):
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        "benchmarks:\n"
        f"  gsm8k: {{path: {FIXTURES / 'gsm8k.jsonl'}, k: 4, answer_format: gsm8k}}\n"
        f"  aime24: {{path: {FIXTURES / 'aime24.jsonl'}, k: 16}}\n"
    )
    out = tmp_path / "verl"
    args = ["data", "prepare", "--backend", "verl", "--out", str(out), "--suite", str(suite)]
    assert main([*args, str(FIXTURES / "math500.jsonl"), str(FIXTURES / "amc.json")]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "aime24.parquet", "amc.parquet", "gsm8k.parquet", "math500.parquet",
    ]  # fmt: skip
    assert f"wrote 2 problems to {out / 'gsm8k.parquet'}" in capsys.readouterr().out
    gsm = _rows(out / "gsm8k.parquet")
    assert [r["reward_model"]["ground_truth"] for r in gsm] == ["72", "2000"]  # after '####'
    assert [r["reward_model"]["ground_truth"] for r in _rows(out / "amc.parquet")] == ["2", "0.5"]
    assert [r["extra_info"]["id"] for r in _rows(out / "aime24.parquet")] == ["60", "61"]
    math = _rows(out / "math500.parquet")
    expected = load_benchmark(FIXTURES / "math500.jsonl")
    for i, (row, problem) in enumerate(zip(math, expected, strict=True)):
        assert row["data_source"] == "math500"
        assert [dict(m) for m in row["prompt"]] == build_messages(problem.question)
        assert row["reward_model"] == {"style": "rule", "ground_truth": problem.answer}
        assert row["extra_info"] == {"index": i, "id": problem.id}


def test_a_bad_row_is_named_and_nothing_is_written(tmp_path, capsys):
    bad = tmp_path / "gsm8k_bad.jsonl"
    bad.write_text(
        '{"question": "Q1", "answer": "1 + 1 = 2\\n#### 2"}\n'
        '{"question": "Q2", "answer": "the solution lost its last line"}\n'
        '{"question": "Q3"}\n'
    )
    out = tmp_path / "verl"
    args = ["data", "prepare", "--backend", "verl", "--out", str(out), "--answer-format", "gsm8k"]
    missing = tmp_path / "missing.jsonl"
    assert main([*args, str(FIXTURES / "gsm8k.jsonl"), str(bad), str(missing), "toy:dev"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: 2 bad row(s) of 3" in err
    assert f"{bad}, line 2: GSM8K answer without a final '#### N' line" in err
    assert f"{bad}, line 3: no answer column: expected one of ['answer'" in err
    assert f"benchmark file not found: {missing}" in err  # every source's problems at once
    assert "'toy:dev': unknown toy split; use toy:train|toy:val|toy:test" in err
    assert not out.exists()  # the good file before them was not written either


def test_toy_splits_are_the_eval_loaders_problems(tmp_path):
    out = tmp_path / "verl"
    args = ["data", "prepare", "--backend", "verl", "--out", str(out), "toy:train", "toy:test"]
    assert main([*args, *TOY, "task.seed=3"]) == 0
    splits = TASKS["toy"](compose([*TOY, "task.seed=3"]).task)
    for name, problems in (("train", splits.train), ("test", splits.test)):
        rows = _rows(out / f"toy_{name}.parquet")
        assert [r["reward_model"]["ground_truth"] for r in rows] == [p.answer for p in problems]
        assert [r["prompt"][1]["content"] for r in rows] == [p.question for p in problems]
        assert {r["data_source"] for r in rows} == {f"toy_{name}"}


@pytest.mark.slow
def test_verls_dataset_reads_the_prepared_files(tmp_path):
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from omgrpo.models.bases import SHIPPED_DIR

    out = tmp_path / "verl"
    args = ["data", "prepare", "--backend", "verl", "--out", str(out), "toy:val", *TOY]
    assert main([*args, str(FIXTURES / "gsm8k.jsonl")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(next(SHIPPED_DIR.glob("*/tokenizer.json")).parent)
    config = OmegaConf.create(
        {"cache_dir": str(tmp_path / "cache"), "max_prompt_length": 4096,
         "filter_overlong_prompts_workers": 1}
    )  # fmt: skip
    files = [str(out / "gsm8k.parquet"), str(out / "toy_val.parquet")]
    data = RLHFDataset(files, tokenizer, config)
    assert len(data) == 2 + 3
    first, last = data[0], data[4]
    assert first["data_source"] == "gsm8k" and first["index"] == 0
    assert first["raw_prompt"][1]["content"].startswith("Natalia")
    assert first["reward_model"]["ground_truth"] == "72"
    assert last["data_source"] == "toy_val" and last["index"] == 2
