"""Inputs are checked at load, before the first step (a bad row must not fail a run minutes in):
dataset cell types, encoding, empty files, every prompt's token length, and a `model.path` that
is not a model."""

import json

import pandas as pd
import pytest
from omegaconf import OmegaConf

from omgrpo.backends.native.trainer import train
from omgrpo.config import compose
from omgrpo.models.tokenizer import build_char_tokenizer
from omgrpo.models.toy import build_toy_model
from omgrpo.tasks import PromptEncoder, TaskSplits, check_prompt_lengths, load_task
from omgrpo.tasks.files import load_problems


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _files_task(train_path, *extra):
    return compose(["task.name=files", f"task.train_path={train_path}", *extra]).task


# -- cell types ----------------------------------------------------------------------------------
def test_parquet_list_answers_are_refused_with_file_and_row(tmp_path):
    path = tmp_path / "lists.parquet"
    pd.DataFrame({"question": ["1+1?", "2+1?"], "answer": [[2], [3]]}).to_parquet(path)
    # before: accepted, labels became "[2]" and every rollout was graded wrong
    with pytest.raises(ValueError, match=r"lists\.parquet, row 0: 'answer' must be a single"):
        load_problems(path)
    with pytest.raises(ValueError, match=r"got a list \[2\]"):
        load_problems(path)


def test_jsonl_list_and_boolean_cells_are_refused(tmp_path):
    lists = _jsonl(
        tmp_path / "l.jsonl",
        [{"question": "q", "answer": "1"}, {"question": "q", "answer": [1, 2]}],
    )
    with pytest.raises(ValueError, match=r"l\.jsonl, line 2: 'answer' must be a single value"):
        load_problems(lists)
    question_list = _jsonl(tmp_path / "ql.jsonl", [{"question": ["a", "b"], "answer": "1"}])
    with pytest.raises(ValueError, match=r"ql\.jsonl, line 1: 'question' must be a single"):
        load_problems(question_list)
    boolean = _jsonl(tmp_path / "b.jsonl", [{"question": "q", "answer": True}])
    with pytest.raises(ValueError, match=r"b\.jsonl, line 1: 'answer' .* the boolean True"):
        load_problems(boolean)


def test_numeric_questions_and_answers_are_taken_as_text(tmp_path):
    """Decision (documented in `load_problems`): numbers are single values, read as their text;
    a whole float (pandas' integer column with gaps) loses its '.0'."""
    path = tmp_path / "ints.parquet"
    pd.DataFrame({"question": [12, 13], "answer": [2.0, 2.5]}).to_parquet(path)
    # before: "missing or empty 'question'" for a present integer question
    problems = load_problems(path)
    assert [p.question for p in problems] == ["12", "13"]
    assert [p.answer for p in problems] == ["2", "2.5"]
    assert problems[1].meta["source"] == f"{path}, row 1"


def test_missing_answers_in_parquet_gaps(tmp_path):
    path = tmp_path / "gaps.parquet"
    pd.DataFrame({"question": ["a", "b"], "answer": [1.0, None]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"gaps\.parquet, row 1: missing 'answer'"):
        load_problems(path)
    assert [p.answer for p in load_problems(path, require_answer=False)] == ["1", None]


# -- encoding and empty files -------------------------------------------------------------------
def test_non_utf8_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    # before: a bare UnicodeDecodeError with no file or line
    with pytest.raises(ValueError, match=r"latin1\.jsonl, line 2: not valid UTF-8 \(byte 0xe9"):
        load_problems(path)


def test_non_utf8_json_file_is_named(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'[{"question": "caf\xe9", "answer": "2"}]')
    with pytest.raises(ValueError, match=r"latin1\.json: not valid UTF-8"):
        load_problems(path)


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_jsonl_is_named(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    # before: "task 'files' has an empty train split", no file named
    with pytest.raises(ValueError, match=r"empty\.jsonl: the train file has no rows"):
        load_task(_files_task(path))
    val = _jsonl(tmp_path / "ok.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(ValueError, match=r"empty\.jsonl: the val file has no rows"):
        load_task(_files_task(val, f"task.val_path={path}"))


# -- prompt lengths -----------------------------------------------------------------------------
def test_check_prompt_lengths_lists_every_offending_row(tmp_path):
    rows = [{"question": "x" * (300 if i in (3, 6) else 5), "answer": "1"} for i in range(8)]
    train = load_problems(_jsonl(tmp_path / "train.jsonl", rows), split="train")
    encode = PromptEncoder(build_char_tokenizer(), max_len=200)
    short = len(encode.tokens("x" * 5))
    with pytest.raises(ValueError) as err:
        check_prompt_lengths(TaskSplits(train=train, val=train[:2], test=[]), encode)
    text = str(err.value)
    assert text.startswith("2 of 10 prompts are longer than rollout.max_prompt_len=200")
    template = short - 5  # the char tokenizer: one token per character
    assert f"train.jsonl, line 4 (id train-3): {300 + template} tokens" in text
    assert "train.jsonl, line 7 (id train-6)" in text and "line 1 " not in text
    ok = PromptEncoder(build_char_tokenizer(), max_len=300 + template)
    check_prompt_lengths(TaskSplits(train=train, val=[], test=[]), ok)  # fits: no error


def test_check_prompt_lengths_caps_the_list_and_checks_paraphrases(tmp_path):
    rows = [{"question": "x" * 50, "answer": "1", "paraphrase": "y" * 500} for _ in range(15)]
    train = load_problems(_jsonl(tmp_path / "t.jsonl", rows), split="train")
    encode = PromptEncoder(build_char_tokenizer(), max_len=200)
    splits = TaskSplits(train=train, val=[], test=[])
    check_prompt_lengths(splits, encode)  # questions fit; paraphrases unused
    with pytest.raises(ValueError, match=r"(?s)15 of 30 prompts.*\.\.\. and 5 more"):
        check_prompt_lengths(splits, encode, paraphrases=True)


def _tiny_model_dir(path):
    tok = build_char_tokenizer()
    arch = OmegaConf.create(dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1))
    build_toy_model(arch, tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_over_long_prompt_fails_at_setup_before_any_step(tmp_path, tiny_overrides):
    rows = [{"question": "x" * (400 if i == 5 else 10), "answer": "1"} for i in range(8)]
    data = _jsonl(tmp_path / "train.jsonl", rows)
    cfg = compose(
        [
            *tiny_overrides,
            f"model.path={_tiny_model_dir(tmp_path / 'model')}",
            "task.name=files",
            f"task.train_path={data}",
            "rollout.max_prompt_len=300",
            "trainer.steps=1",
            "run.name=long",
        ]
    )
    # before: the error came only when row 5 was drawn (here: never in step 1, so the run
    # went on) and status.json said "running" after the crash
    with pytest.raises(ValueError, match=r"train\.jsonl, line 6 \(id train-5\): \d+ tokens"):
        train(cfg)
    assert not (tmp_path / "runs" / "long" / "status.json").exists()


# -- model.path ----------------------------------------------------------------------------------
def test_non_model_dir_says_which_files_it_expected(tmp_path, tiny_overrides):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "notes.txt").write_text("weights are elsewhere")
    cfg = compose([*tiny_overrides, f"model.path={folder}", "trainer.steps=1"])
    # before: transformers' "Couldn't instantiate the backend tokenizer ... sentencepiece"
    with pytest.raises(ValueError) as err:
        train(cfg)
    text = str(err.value)
    assert "is not a Hugging Face model directory" in text and "config.json" in text
    assert "tokenizer.json" in text and "model.safetensors" in text and "notes.txt" in text


def test_model_dir_without_tokenizer_names_only_that(tmp_path):
    from omgrpo.models.loading import check_model_dir

    model = _tiny_model_dir(tmp_path / "m")
    check_model_dir(model)  # a complete directory passes
    (model / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"missing tokenizer \(tokenizer\.json or") as err:
        check_model_dir(model)
    assert "config (" not in str(err.value)
