"""Bad input, tried as a new user would (issue 37): every row runs `omgrpo.cli.main` in-process
in a fresh folder and asserts exit status 2, a message on stderr naming the thing (file, row,
key), no traceback, and that no file in the folder changed or appeared (hashed before and
after). Fast: no row trains or loads a model."""

from __future__ import annotations

import functools
import hashlib
import json
import lzma
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from omgrpo import cli
from omgrpo.config import compose, to_container
from omgrpo.errors import InputError, check_int, check_number, inside


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root: path -> sha256 (folders: 'dir', symbolic links: where
    they point)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = f"-> {path.readlink()}"
        else:
            out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def refuse(args, tmp_path, capsys, monkeypatch, setup: Callable | None = None) -> str:
    """Run `omgrpo ARGS` in tmp_path after `setup(tmp_path)`; assert it is refused (exit 2, no
    traceback, nothing written or changed); return stderr."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMGRPO_DEBUG", raising=False)
    if setup is not None:
        setup(tmp_path)
    capsys.readouterr()
    before = snapshot(tmp_path)
    code = cli.main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    assert "error:" in err, err
    assert snapshot(tmp_path) == before, "a refused command changed the folder"
    return err


# -- the error type -------------------------------------------------------------------------------
def test_input_error_names_file_row_key_found_and_expected():
    e = InputError("bad cell", file="a.jsonl", row=3, key="answer", found=[1], expected="a string")
    assert str(e) == "a.jsonl, row 3: answer: bad cell (found [1]; expected a string)"
    assert isinstance(e, ValueError)  # callers catching ValueError keep working
    assert str(InputError(key="k", found=None, expected="x")) == "k (found None; expected x)"


@pytest.mark.parametrize(
    ("value", "kwargs"),
    [
        (0, {"minimum": 1}),
        (True, {}),
        (1.5, {}),
        ("3", {}),
        (None, {}),
        (11, {"maximum": 10}),
    ],
)
def test_check_int_refuses(value, kwargs):
    with pytest.raises(InputError, match=r"the\.key"):
        check_int(value, "the.key", **kwargs)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0, "1", True, None])
def test_check_number_refuses(value):
    with pytest.raises(InputError, match=r"the\.key"):
        check_number(value, "the.key", minimum=0, exclusive_minimum=True)


@pytest.mark.parametrize("name", ["", "..", ".", "../x", "a/b", "/abs", "a\\b"])
def test_names_from_input_files_never_leave_the_folder(tmp_path, name):
    with pytest.raises(InputError, match=r"plain name|non-empty"):
        inside(tmp_path, name, "benchmarks.<name>")
    assert inside(tmp_path, "math500", "x") == tmp_path / "math500"


# -- the CLI surface ------------------------------------------------------------------------------
def test_an_unexpected_exception_keeps_its_traceback_and_says_it_is_a_bug(capsys, monkeypatch):
    def boom(argv):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli, "_dispatch", boom)
    assert cli.main(["tables", "x"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err
    assert "omgrpo tables: internal error (ZeroDivisionError): this is a bug in omgrpo" in err


@pytest.mark.parametrize("how", ["flag-before-verb", "flag-after-verb", "flag-last", "env"])
@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["plan", "model.path=m", "--device-gb", "nan"], "omgrpo plan: error: --device-gb"),
        (["eval", "m", "--suite", "nothere.yaml"], "omgrpo eval: error: nothere.yaml"),
        (["data", "convert", "no.jsonl", "--out", "o.jsonl"], "omgrpo data convert: error: no"),
        (["tables", "nothere", "--out", "t"], "omgrpo tables: error: nothere"),
    ],
    ids=["plan", "eval", "data-convert", "tables"],
)
def test_debug_shows_the_traceback_of_an_expected_error(
    tmp_path, capsys, monkeypatch, how, args, names
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMGRPO_DEBUG", raising=False)
    plain = list(args)
    if how == "flag-before-verb":
        args = ["--debug", *args]
    elif how == "flag-after-verb":
        args = [*args[:1], "--debug", *args[1:]]
    elif how == "flag-last":
        args = [*args, "--debug"]
    else:
        monkeypatch.setenv("OMGRPO_DEBUG", "1")
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and names in err
    if how != "env":  # the flag lasts for its command only
        assert "OMGRPO_DEBUG" not in os.environ
        assert cli.main(plain) == 2
        assert "Traceback" not in capsys.readouterr().err


def test_take_debug_leaves_what_follows_a_double_dash():
    assert cli.take_debug(["eval", "--debug", "m"]) == (["eval", "m"], True)
    assert cli.take_debug(["eval", "m"]) == (["eval", "m"], False)
    assert cli.take_debug(["x", "--", "--debug"]) == (["x", "--", "--debug"], False)


# -- plan -------------------------------------------------------------------------------------------
def _model(fields: dict | None = None, drop: str | None = None, text: str | None = None):
    def setup(root: Path) -> None:
        (root / "m").mkdir()
        config = {
            "model_type": "qwen2",
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 100,
            **(fields or {}),
        }
        config.pop(drop, None)
        (root / "m" / "config.json").write_text(text if text is not None else json.dumps(config))

    return setup


PLAN = [
    ("device-gb-nan", ["--device-gb", "nan"], _model(), "--device-gb (found nan"),
    ("device-gb-inf", ["--device-gb", "inf"], _model(), "--device-gb (found inf"),
    ("device-gb-negative", ["--device-gb", "-1"], _model(), "--device-gb (found -1.0"),
    ("device-gb-zero", ["--device-gb", "0"], _model(), "--device-gb (found 0.0"),
    ("no-model-path", ["--device-gb", "10"], None, "model.path"),
    ("no-such-dir", ["model.path=/nonexistent/x", "--device-gb", "10"], None, "/nonexistent/x"),
    ("relative-missing", ["model.path=./nope", "--device-gb", "10"], None, "./nope"),
    ("not-a-dir", ["model.path=f", "--device-gb", "10"], lambda r: (r / "f").write_text("x"), "f"),
    ("no-config-json", ["model.path=m", "--device-gb", "10"], lambda r: (r / "m").mkdir(), "m"),
    ("config-not-json", [], _model(text="{broken"), "m/config.json: not valid JSON"),
    ("config-a-list", [], _model(text="[1, 2]"), "m/config.json: not a JSON object"),
    ("no-model-type", [], _model(drop="model_type"), "m/config.json: model_type"),
    ("unknown-model-type", [], _model({"model_type": "zzz"}), "model_type: unknown"),
    ("no-layer-count", [], _model(drop="num_hidden_layers"), "num_hidden_layers: missing"),
    ("no-hidden-size", [], _model(drop="hidden_size"), "hidden_size: missing"),
    ("no-heads", [], _model(drop="num_attention_heads"), "num_attention_heads: missing"),
    ("no-intermediate", [], _model(drop="intermediate_size"), "intermediate_size: missing"),
    ("no-vocab", [], _model(drop="vocab_size"), "vocab_size: missing"),
    ("zero-layers", [], _model({"num_hidden_layers": 0}), "num_hidden_layers (found 0"),
    ("string-width", [], _model({"hidden_size": "64"}), "hidden_size (found '64'"),
    (  # found by tests/test_bad_input_properties.py: a StrictDataclassFieldValidationError
        "kv-heads-a-list",
        [],
        _model({"num_key_value_heads": []}),
        "m/config.json: transformers cannot build the model from it",
    ),
    ("rollout-n-zero", ["rollout.n=0"], _model(), "rollout.n (found 0"),
    ("prompts-zero", ["trainer.prompts_per_step=0"], _model(), "trainer.prompts_per_step"),
    ("eval-k-zero", ["eval.k=0"], _model(), "eval.k (found 0"),
    ("eval-batch-negative", ["eval.batch_size=-4"], _model(), "eval.batch_size (found -4"),
    ("new-tokens-negative", ["rollout.max_new_tokens=-5"], _model(), "rollout.max_new_tokens"),
    ("top-p-zero", ["rollout.top_p=0"], _model(), "rollout.top_p (found 0.0"),
    ("top-p-above-one", ["rollout.top_p=1.5"], _model(), "rollout.top_p (found 1.5"),
    ("bad-type", ["trainer.steps=abc"], _model(), "trainer.steps=abc"),
    ("unknown-key", ["nokey=1"], _model(), "nokey"),
    ("unknown-preset", ["method=nope"], _model(), "method/nope"),
]


@pytest.mark.parametrize(
    ("args", "setup", "names"), [r[1:] for r in PLAN], ids=[r[0] for r in PLAN]
)
def test_plan_refuses(tmp_path, capsys, monkeypatch, args, setup, names):
    if not any(a.startswith("model.path=") for a in args) and setup is not None:
        args = ["model.path=m", *args]
    if "--device-gb" not in args:
        args = [*args, "--device-gb", "10"]
    err = refuse(["plan", *args], tmp_path, capsys, monkeypatch, setup)
    assert names in err


# -- train: refused before Hydra writes anything ---------------------------------------------------
def _finished_run(root: Path) -> None:
    """runs/r: a finished run of the default config with trainer.steps=3."""
    run = root / "runs" / "r"
    run.mkdir(parents=True)
    config = to_container(compose(["run.root=runs", "run.name=r", "trainer.steps=3"]))
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (run / "metrics.jsonl").write_text(json.dumps({"train/step": 3, "train/loss": 0.1}) + "\n")
    (run / "status.json").write_text(json.dumps({"state": "finished", "step": 3}))
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("- trainer.steps=3\n")


TRAIN = [
    ("steps-zero", ["trainer.steps=0"], None, "trainer.steps (found 0"),
    ("steps-negative", ["trainer.steps=-1"], None, "trainer.steps (found -1"),
    ("rollout-n-zero", ["rollout.n=0"], None, "rollout.n"),
    ("rollout-n-one", ["rollout.n=1"], None, "rollout.n"),
    ("lr-negative", ["optim.lr=-1"], None, "optim.lr (found -1.0"),
    ("lr-nan", ["optim.lr=nan"], None, "optim.lr (found nan"),
    ("warmup-above-one", ["optim.warmup_ratio=2"], None, "optim.warmup_ratio"),
    ("eval-k-zero", ["eval.k=0"], None, "eval.k"),
    ("n-train-negative", ["task.n_train=-5"], None, "task.n_train"),
    ("seed-negative", ["seed=-1"], None, "seed (found -1"),
    ("keep-zero", ["trainer.keep_checkpoints=0"], None, "trainer.keep_checkpoints"),
    ("log-rollouts-zero", ["trainer.log_rollouts_every=0"], None, "log_rollouts_every"),
    ("patience-zero", ["collapse.patience=0"], None, "collapse.patience"),
    ("temperature-negative", ["rollout.temperature=-0.5"], None, "rollout.temperature"),
    ("bad-type", ["trainer.steps=abc"], None, "trainer.steps=abc"),
    ("unknown-key", ["nokey=1"], None, "nokey"),
    ("unknown-method", ["method=nope"], None, "method/nope"),
    ("unknown-backend", ["backend=nope"], None, "unknown backend 'nope'"),
    ("unknown-reward", ["reward.parts=[votes]"], None, "unknown reward 'votes'"),
    ("bad-resume", ["run.resume=maybe"], None, "run.resume"),
    (
        "finished-run-of-another-config",  # before: Hydra rewrote the run's .hydra/ files
        ["run.name=r", "trainer.steps=4"],
        _finished_run,
        "holds a finished run of another config",
    ),
    (
        "existing-run-resume-false",
        ["run.name=r", "trainer.steps=3", "run.resume=false"],
        _finished_run,
        "already holds a run",
    ),
]


@pytest.mark.parametrize(
    ("args", "setup", "names"), [r[1:] for r in TRAIN], ids=[r[0] for r in TRAIN]
)
def test_train_refuses_before_writing(tmp_path, capsys, monkeypatch, args, setup, names):
    err = refuse(["train", "run.root=runs", *args], tmp_path, capsys, monkeypatch, setup)
    assert names in err


# -- eval and its suite files: validated as a whole before any model loads or file is written ------
OK_ROW = {"id": "1", "question": "1+1?", "answer": "2"}


def _eval_setup(suite: str | bytes | None = None, extra: dict[str, str] | None = None):
    """A model directory m/ (config.json only: nothing may load it), ok.jsonl, and the suite
    file s.yaml; an earlier summary in m/eval/s/ that a refusal must leave alone."""

    def setup(root: Path) -> None:
        (root / "m" / "eval" / "s").mkdir(parents=True)
        (root / "m" / "config.json").write_text('{"model_type": "qwen2"}')
        (root / "m" / "eval" / "s" / "summary.json").write_text('{"suite": "s"}\n')
        (root / "ok.jsonl").write_text(json.dumps(OK_ROW) + "\n")
        rows = [{**OK_ROW, "id": "a"}, {**OK_ROW, "id": "a"}, {**OK_ROW, "id": "b"}]
        (root / "dup.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for name, text in (extra or {}).items():
            (root / name).write_text(text)
        if suite is not None:
            data = suite if isinstance(suite, bytes) else suite.encode()
            (root / "s.yaml").write_bytes(data)

    return setup


def _bench(**fields) -> str:
    spec = {"path": "ok.jsonl", "k": 1, **fields}
    return yaml.safe_dump({"name": "s", "benchmarks": {"b": spec}})


EVAL = [
    ("empty-suite", "name: s\nbenchmarks: {}\n", "s.yaml: benchmarks: no benchmarks"),
    ("empty-file", "", "s.yaml: not a suite"),
    ("broken-yaml", "name: s\nbenchmarks: [\n", "s.yaml, line 3, column 1: not valid YAML"),
    ("not-utf8", b"\xff\xfe", "s.yaml: not UTF-8"),
    ("a-list", "- a\n- b\n", "s.yaml: not a suite"),
    ("benchmarks-a-list", "benchmarks: [a, b]\n", "s.yaml: benchmarks: no benchmarks"),
    ("misspelt-top-key", "benchmark:\n  b: {path: ok.jsonl, k: 1}\n", "['benchmark']"),
    ("dotdot-benchmark", "benchmarks:\n  ../evil: {path: ok.jsonl, k: 1}\n", "../evil"),
    ("slash-benchmark", "benchmarks:\n  a/b: {path: ok.jsonl, k: 1}\n", "benchmarks.a/b"),
    ("dotdot-suite-name", "name: ../evil\nbenchmarks:\n  b: {path: ok.jsonl, k: 1}\n", "name"),
    ("numeric-suite-name", "name: 3\nbenchmarks:\n  b: {path: ok.jsonl, k: 1}\n", "name"),
    ("spec-a-number", "benchmarks:\n  b: 5\n", "s.yaml: benchmarks.b (found 5"),
    ("defaults-a-number", "defaults: 3\nbenchmarks:\n  b: {path: ok.jsonl, k: 1}\n", "defaults"),
    ("missing-path", "benchmarks:\n  b: {k: 1}\n", "benchmarks.b.path: missing"),
    ("missing-k", "benchmarks:\n  b: {path: ok.jsonl}\n", "benchmarks.b.k: missing"),
    ("k-zero", _bench(k=0), "benchmarks.b.k (found 0"),
    ("k-float", _bench(k=2.5), "benchmarks.b.k (found 2.5"),
    ("k-string", _bench(k="4"), "benchmarks.b.k (found '4'"),
    ("k-bool", _bench(k=True), "benchmarks.b.k (found True"),
    ("temperature-negative", _bench(temperature=-1), "benchmarks.b.temperature"),
    ("temperature-nan", "benchmarks:\n  b: {path: ok.jsonl, k: 1, temperature: .nan}\n", "nan"),
    ("top-p-zero", _bench(top_p=0), "benchmarks.b.top_p"),
    ("top-p-above-one", _bench(top_p=2), "benchmarks.b.top_p"),
    ("tokens-zero", _bench(max_new_tokens=0), "benchmarks.b.max_new_tokens"),
    ("limit-negative", _bench(limit=-1), "benchmarks.b.limit (found -1"),
    ("limit-zero", _bench(limit=0), "benchmarks.b.limit (found 0"),
    ("seed-negative", _bench(seed=-3), "benchmarks.b.seed"),
    ("unknown-format", _bench(answer_format="latex"), "benchmarks.b.answer_format"),
    ("unknown-field", _bench(temp=1), "unknown key(s) ['temp']"),
    ("empty-path", _bench(path=""), "benchmarks.b.path"),
    ("path-a-number", _bench(path=3), "benchmarks.b.path"),
    ("no-such-data", _bench(path="nothere.jsonl"), "benchmarks.b.path"),
    ("data-a-folder", _bench(path="m"), "m: a directory"),
    ("duplicate-ids", _bench(path="dup.jsonl"), "duplicate id 'a' (first at dup.jsonl, line 1)"),
    (
        "second-benchmark-bad",  # the first is fine: still nothing is loaded or written
        yaml.safe_dump(
            {"benchmarks": {"a": {"path": "ok.jsonl", "k": 1}, "b": {"path": "no.jsonl", "k": 1}}}
        ),
        "benchmarks.b.path",
    ),
]


@pytest.mark.parametrize(("suite", "names"), [r[1:] for r in EVAL], ids=[r[0] for r in EVAL])
def test_eval_refuses_a_bad_suite_before_loading_anything(
    tmp_path, capsys, monkeypatch, suite, names
):
    err = refuse(
        ["eval", "m", "--suite", "s.yaml"], tmp_path, capsys, monkeypatch, _eval_setup(suite)
    )
    assert names in err


EVAL_ARGS = [
    ("suite-not-found", ["--suite", "nothere.yaml"], "nothere.yaml: suite file not found"),
    ("suite-a-folder", ["--suite", "m.yaml"], "m.yaml"),
    ("unknown-suite", ["--suite", "nosuch"], "--suite: unknown suite"),
    ("no-such-target", ["--suite", "s.yaml", "--", "nothere"], "nothere"),
    ("batch-size-zero", ["--batch-size", "0"], "--batch-size (found 0"),
    ("threads-negative", ["--threads", "-1"], "--threads (found -1"),
    ("tp-zero", ["--backend", "vllm", "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (
        "gpu-share-above-one",
        ["--backend", "vllm", "--gpu-memory-utilization", "1.5"],
        "utilization",
    ),
    ("gpu-share-nan", ["--backend", "vllm", "--gpu-memory-utilization", "nan"], "utilization"),
    ("vllm-flag-native", ["--gpu-memory-utilization", "0.5"], "need --backend vllm"),
    ("best-of-a-model-dir", ["--checkpoint", "best"], "--checkpoint must be 'last'"),
    ("out-two-targets", ["m", "--out", "x"], "--out takes one target"),
]


@pytest.mark.parametrize(
    ("args", "names"), [r[1:] for r in EVAL_ARGS], ids=[r[0] for r in EVAL_ARGS]
)
def test_eval_refuses_bad_arguments(tmp_path, capsys, monkeypatch, args, names):
    setup = _eval_setup(_bench())

    def with_folder(root: Path) -> None:
        setup(root)
        (root / "m.yaml").mkdir()

    if "--" in args:
        cut = args.index("--")
        argv = ["eval", *args[cut + 1 :], *args[:cut]]
    else:
        argv = ["eval", "m", *args]
    err = refuse(argv, tmp_path, capsys, monkeypatch, with_folder)
    assert names in err


# -- data convert: never overwrites --out unasked, never touches a file it did not create ----------
def _convert_setup(root: Path) -> None:
    (root / "ok.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    (root / "no_answer.jsonl").write_text(json.dumps({"question": "1+1?"}) + "\n")
    rows = [
        {"id": "a", "question": "q", "answer": "1"},
        {"id": "a", "question": "r", "answer": "2"},
    ]
    (root / "dup.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "broken.parquet").write_bytes(b"x")
    (root / "out.jsonl").write_text("an earlier conversion\n")
    (root / "folder.jsonl").mkdir()


CONVERT = [
    ("out-exists", ["ok.jsonl", "--out", "out.jsonl"], "--out: exists; pass --force"),
    ("out-is-source", ["ok.jsonl", "--out", "ok.jsonl"], "--out"),
    ("out-a-folder", ["ok.jsonl", "--out", "folder.jsonl", "--force"], "folder.jsonl"),
    ("out-csv", ["ok.jsonl", "--out", "new.csv"], "--out (found 'new.csv'"),
    ("limit-negative", ["ok.jsonl", "--out", "new.jsonl", "--limit", "-1"], "--limit (found -1"),
    ("limit-zero", ["ok.jsonl", "--out", "new.jsonl", "--limit", "0"], "--limit (found 0"),
    ("no-such-file", ["nothere.jsonl", "--out", "new.jsonl"], "nothere.jsonl"),
    ("no-such-relative", ["./nothere", "--out", "new.jsonl"], "./nothere"),
    ("not-cached-dataset", ["nobody/nothing", "--out", "new.jsonl"], "nobody/nothing"),
    ("no-answer-column", ["no_answer.jsonl", "--out", "new.jsonl"], "no_answer.jsonl, line 1"),
    ("unknown-question-key", ["ok.jsonl", "--out", "n.jsonl", "--question-key", "x"], "'x'"),
    ("duplicate-ids", ["dup.jsonl", "--out", "new.jsonl"], "duplicate id 'a'"),
    ("broken-parquet", ["broken.parquet", "--out", "new.jsonl"], "broken.parquet"),
]


@pytest.mark.parametrize(("args", "names"), [r[1:] for r in CONVERT], ids=[r[0] for r in CONVERT])
def test_data_convert_refuses(tmp_path, capsys, monkeypatch, args, names):
    err = refuse(["data", "convert", *args], tmp_path, capsys, monkeypatch, _convert_setup)
    assert names in err


def test_data_convert_replaces_out_only_with_force_and_keeps_its_neighbours(
    tmp_path, capsys, monkeypatch
):
    """Before: --out was overwritten unasked, and a dataset source went through a file next to
    --out (`<out>.rows.jsonl`), overwritten and then deleted whatever it was."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    _convert_setup(tmp_path)
    datasets.Dataset.from_list([{"question": "2+2?", "answer": "4"}]).save_to_disk("saved")
    (tmp_path / "out.rows.jsonl").write_text("someone else's file\n")
    assert cli.main(["data", "convert", "saved", "--out", "out.jsonl", "--force"]) == 0
    assert json.loads((tmp_path / "out.jsonl").read_text())["answer"] == "4"
    assert (tmp_path / "out.rows.jsonl").read_text() == "someone else's file\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# -- tables: a corrupt or partial summary is named, never skipped ----------------------------------
def _eval_summary(root: Path, seed: int, text: str | None = None, entry: dict | None = None):
    run = root / "runs" / f"main_table__om_grpo__s{seed}"
    (run / "eval" / "toy").mkdir(parents=True)
    summary = {
        "suite": "toy",
        "target": str(run),
        "run": {"name": run.name, "experiment": "main_table", "variant": "om_grpo", "seed": seed},
        "checkpoint": {"name": "last", "step": 40},
        "benchmarks": {
            "toy_test": entry
            or {
                "k": 4,
                "metrics": {"avg@4": 0.5, "pass@4": 0.8},
                "ci95": {"avg@4": [0.4, 0.6], "pass@4": [0.7, 0.9]},
            }
        },
    }
    full = json.dumps(summary)
    data = full if text is None else text(full)
    path = run / "eval" / "toy" / "summary.json"
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def _two_seeds(text=None, entry=None):
    def setup(root: Path) -> None:
        _eval_summary(root, 0)
        _eval_summary(root, 1, text=text, entry=entry)
        (root / "other.json").write_text('{"a": 1}')

    return setup


def _entry(avg=0.5, pass_=0.8, ci_avg=(0.4, 0.6)) -> dict:
    """A benchmark entry of a summary, k = 4, with these avg@4, pass@4 and avg@4's interval."""
    return {
        "k": 4,
        "metrics": {"avg@4": avg, "pass@4": pass_},
        "ci95": {"avg@4": ci_avg, "pass@4": [0.7, 0.9]},
    }


# avg@k, pass@k and their intervals are fractions: out of [0, 1] they were averaged into the
# tables as numbers (a seed's avg@4 of 1e308 made the method's mean 5e307)
BAD_EVAL_FRACTIONS = [
    ("avg-1e308", {"avg": 1e308}, "benchmarks.toy_test.metrics.avg@4 (found 1e+308; expected "
     "a fraction in [0, 1])"),
    ("avg-negative", {"avg": -0.5}, "s1/eval/toy/summary.json: benchmarks.toy_test.metrics.avg@4"),
    ("avg-nan", {"avg": float("nan")}, "benchmarks.toy_test.metrics.avg@4 (found nan"),
    ("avg-null", {"avg": None}, "benchmarks.toy_test.metrics.avg@4 (found None"),
    ("avg-text", {"avg": "0.5"}, "benchmarks.toy_test.metrics.avg@4 (found '0.5'"),
    ("pass-above-one", {"pass_": 1.5}, "benchmarks.toy_test.metrics.pass@4 (found 1.5"),
    ("pass-infinity", {"pass_": float("inf")}, "benchmarks.toy_test.metrics.pass@4 (found inf"),
    ("ci-a-number", {"ci_avg": 0.5}, "benchmarks.toy_test.ci95.avg@4 (found 0.5"),
    ("ci-three-bounds", {"ci_avg": [0, 0.5, 1]}, "benchmarks.toy_test.ci95.avg@4 (found [0, 0.5, 1]"),
    ("ci-bound-1e308", {"ci_avg": [0.4, 1e308]}, "benchmarks.toy_test.ci95.avg@4 (found 1e+308"),
]  # fmt: skip

TABLES = [
    (
        "truncated-summary",
        ["runs"],
        _two_seeds(text=lambda t: t[: len(t) // 2]),
        "s1/eval/toy/summary.json: unreadable",
    ),
    (
        "empty-summary",
        ["runs"],
        _two_seeds(text=lambda t: ""),
        "s1/eval/toy/summary.json: unreadable",
    ),
    ("not-utf8-summary", ["runs"], _two_seeds(text=lambda t: b"\xff\xfe{"), "summary.json"),
    (
        "entry-without-k",
        ["runs"],
        _two_seeds(entry={"metrics": {}, "ci95": {}}),
        "benchmarks.toy_test",
    ),
    (
        "entry-k-text",
        ["runs"],
        _two_seeds(entry={"k": "four", "metrics": {}, "ci95": {}}),
        "benchmarks.toy_test",
    ),
    (
        "entry-wrong-k",
        ["runs"],
        _two_seeds(entry={"k": 8, "metrics": {"avg@4": 1}, "ci95": {}}),
        "benchmarks.toy_test",
    ),
    (
        "a-file-that-is-not-a-summary",
        ["other.json"],
        _two_seeds(),
        "other.json: not an `omgrpo eval` summary",
    ),
    *(
        (f"{name}", ["runs"], _two_seeds(entry=_entry(**change)), names)
        for name, change, names in BAD_EVAL_FRACTIONS
    ),
    ("no-such-source", ["nothere"], _two_seeds(), "nothere"),
    (
        "no-summary-at-all",
        ["."],
        lambda root: (root / "x.txt").write_text("x"),
        "no `omgrpo eval` summary",
    ),
]


@pytest.mark.parametrize(
    ("args", "setup", "names"), [r[1:] for r in TABLES], ids=[r[0] for r in TABLES]
)
def test_tables_refuses(tmp_path, capsys, monkeypatch, args, setup, names):
    err = refuse(["tables", *args, "--out", "tables"], tmp_path, capsys, monkeypatch, setup)
    assert names in err


# -- export: a damaged run or checkpoint is named; nothing is written -----------------------------
MANIFEST_OK = json.dumps({"step": 1, "sha256": {"state.pt": "0" * 64}})


@functools.cache
def _default_run_config() -> str:
    return yaml.safe_dump(to_container(compose(["run.root=.", "run.name=r"])))


def _export_setup(
    config: str | bytes | None = "default",
    checkpoints: dict[str, dict[str, str | bytes]] | None = None,
    metrics: str | None = None,
):
    """run r/ (config.yaml: the default config unless given; metrics.jsonl if given), its
    checkpoints (folder -> files), a folder full/ with a file in it, and a file afile."""

    def setup(root: Path) -> None:
        run = root / "r"
        run.mkdir()
        text = _default_run_config() if config == "default" else config
        if text is not None:
            (run / "config.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
        if metrics is not None:
            (run / "metrics.jsonl").write_text(metrics)
        for name, files in (checkpoints or {}).items():
            folder = run / "checkpoints" / name
            folder.mkdir(parents=True)
            for file, data in files.items():
                (folder / file).write_bytes(data if isinstance(data, bytes) else data.encode())
        (root / "full").mkdir()
        (root / "full" / "x").write_text("x")
        (root / "afile").write_text("x")

    return setup


def _ckpt(**files) -> dict[str, dict[str, str | bytes]]:
    base = {"COMPLETE": "1", "state.pt": b"junk", "manifest.json": MANIFEST_OK}
    return {"step_000001": {k: v for k, v in {**base, **files}.items() if v is not None}}


EXPORT = [
    ("no-such-run", ["nope", "out"], _export_setup(), "nope: not a run directory"),
    ("run-a-file", ["afile", "out"], _export_setup(), "afile: not a run directory"),
    ("no-config", ["r", "out"], _export_setup(config=None), "r: not a run directory"),
    ("config-empty", ["r", "out"], _export_setup(config=""), "r/config.yaml: not a mapping"),
    ("config-a-list", ["r", "out"], _export_setup(config="- 1\n"), "r/config.yaml: not a mapping"),
    ("config-broken", ["r", "out"], _export_setup(config="a: [\n"), "r/config.yaml, line 2"),
    (
        "config-not-utf8",
        ["r", "out"],
        _export_setup(config=b"\xff\xfe"),
        "r/config.yaml: not UTF-8",
    ),
    ("no-checkpoint", ["r", "out"], _export_setup(), "r: no complete checkpoint"),
    ("out-not-empty", ["r", "full"], _export_setup(checkpoints=_ckpt()), "full exists and is not"),
    ("out-a-file", ["r", "afile"], _export_setup(checkpoints=_ckpt()), "afile exists"),
    ("out-the-run", ["r", "r"], _export_setup(checkpoints=_ckpt()), "r exists and is not empty"),
    ("out-here", ["r", "."], _export_setup(checkpoints=_ckpt()), ". exists and is not empty"),
    ("checkpoint-base", ["r", "o", "--checkpoint", "base"], _export_setup(), "--checkpoint base"),
    ("checkpoint-step-x", ["r", "o", "--checkpoint", "step_x"], _export_setup(), "step_x"),
    ("checkpoint-latest", ["r", "o", "--checkpoint", "latest"], _export_setup(), "latest"),
    (
        "checkpoint-not-kept",
        ["r", "o", "--checkpoint", "step_99"],
        _export_setup(checkpoints=_ckpt()),
        "no complete checkpoint for step 99; available: step_1",
    ),
    (
        "best-never-logged",
        ["r", "o", "--checkpoint", "best"],
        _export_setup(checkpoints=_ckpt()),
        "no complete checkpoint at a step that logged val/acc",
    ),
    (
        "best-by-train-metric",
        ["r", "o", "--checkpoint", "best", "--select-metric", "train/loss"],
        _export_setup(checkpoints=_ckpt()),
        "metric 'train/loss'",
    ),
    (
        "best-by-a-damaged-val-acc",  # 1e308 would be the "best" checkpoint
        ["r", "o", "--checkpoint", "best"],
        _export_setup(checkpoints=_ckpt(), metrics='{"train/step": 1, "val/acc": 1e308}\n'),
        "r/metrics.jsonl",
    ),
    ("flipped-byte", ["r", "o"], _export_setup(checkpoints=_ckpt()), "state.pt: sha256 does not"),
    (
        "state-missing",
        ["r", "o"],
        _export_setup(checkpoints=_ckpt(**{"state.pt": None, "manifest.json": '{"sha256": {}}'})),
        "state.pt: missing",
    ),
    (
        "state-not-torch",  # no manifest (older checkpoints): torch.load fails, named
        ["r", "o"],
        _export_setup(checkpoints=_ckpt(**{"manifest.json": None})),
        "state.pt: not a readable checkpoint",
    ),
    (
        "state-empty",
        ["r", "o"],
        _export_setup(checkpoints=_ckpt(**{"manifest.json": None, "state.pt": b""})),
        "state.pt: not a readable checkpoint",
    ),
    (
        "folder-being-written",  # step_N.tmp (a save in progress) is not a checkpoint
        ["r", "o"],
        _export_setup(checkpoints={"step_000001.tmp": {"COMPLETE": "1"}}),
        "r: no complete checkpoint",
    ),
    (
        "folder-misnamed",
        ["r", "o"],
        _export_setup(checkpoints={"step_x": {"COMPLETE": "1"}}),
        "r: no complete checkpoint",
    ),
    ("missing-out", ["r"], _export_setup(), "required: out"),
]


@pytest.mark.parametrize(
    ("args", "setup", "names"), [r[1:] for r in EXPORT], ids=[r[0] for r in EXPORT]
)
def test_export_refuses(tmp_path, capsys, monkeypatch, args, setup, names):
    err = refuse(["export", *args], tmp_path, capsys, monkeypatch, setup)
    assert names in err


def test_export_refuses_a_state_that_is_not_an_omgrpo_checkpoint(tmp_path, capsys, monkeypatch):
    import torch

    def setup(root: Path) -> None:
        _export_setup(checkpoints={"step_000001": {"COMPLETE": "1"}})(root)
        torch.save({"weights": 1}, root / "r" / "checkpoints" / "step_000001" / "state.pt")

    err = refuse(["export", "r", "o"], tmp_path, capsys, monkeypatch, setup)
    assert "state.pt: not an omgrpo checkpoint" in err


# A checkpoint whose manifest.json is malformed: refused by name (CheckpointError, exit 2) by
# every verb that reads a checkpoint (`verify_checkpoint` -> `check_sha256s`, the one check of
# checkpoints and exports), never a TypeError / AttributeError; nothing written.
DIGEST = "0" * 64
MANIFESTS = [
    ("not-json", "{", "manifest.json, line 1, column 2: unreadable checkpoint manifest"),
    ("empty", "", "manifest.json, line 1, column 1: unreadable checkpoint manifest"),
    ("not-utf8", b"\xff\xfe{", "manifest.json: unreadable checkpoint manifest: not UTF-8"),
    ("a-list", "[1]", "manifest.json: not a checkpoint manifest (found 'list'"),
    ("a-number", "5", "manifest.json: not a checkpoint manifest (found 'int'"),
    ("null", "null", "manifest.json: not a checkpoint manifest (found 'NoneType'"),
    ("no-sums", '{"step": 1}', "manifest.json: not a checkpoint manifest (found ['step']"),
    ("sums-a-string", '{"sha256": "x"}', "manifest.json: sha256: not a mapping of file to sha256"),
    ("sums-a-list", '{"sha256": ["state.pt"]}', "manifest.json: sha256: not a mapping"),
    ("sums-null", '{"sha256": null}', "manifest.json: sha256: not a mapping"),
    ("digest-a-number", '{"sha256": {"state.pt": 5}}', "manifest.json: sha256.state.pt (found 5"),
    ("digest-null", '{"sha256": {"state.pt": null}}', "sha256.state.pt (found None"),
    ("digest-a-list", '{"sha256": {"state.pt": [1]}}', "sha256.state.pt (found [1]"),
    ("digest-not-hex", '{"sha256": {"state.pt": "zz"}}', "sha256.state.pt (found 'zz'"),
    ("digest-short", '{"sha256": {"state.pt": "00"}}', "expected a sha256 digest (64 hex"),
    ("name-dotdot", json.dumps({"sha256": {"../x": DIGEST}}), "sha256 (found '../x'"),
    ("name-dotdot-inside", json.dumps({"sha256": {"a/../../x": DIGEST}}), "(found 'a/../../x'"),
    ("name-absolute", json.dumps({"sha256": {"/etc/hostname": DIGEST}}), "'/etc/hostname'"),
    ("name-empty", json.dumps({"sha256": {"": DIGEST}}), "manifest.json: sha256 (found ''"),
    ("name-dot", json.dumps({"sha256": {".": DIGEST}}), "manifest.json: sha256 (found '.'"),
    ("listed-file-missing", json.dumps({"sha256": {"nope.pt": DIGEST}}), "nope.pt: missing"),
    ("listed-folder", json.dumps({"sha256": {"sub": DIGEST}}), "sub: missing (listed in"),
    (  # a bad name after a good one: the listing is checked whole before any file is hashed
        "second-name-outside",
        json.dumps({"sha256": {"state.pt": DIGEST, "../x": DIGEST}}),
        "sha256 (found '../x'",
    ),
]


def _bad_manifest(manifest: str | bytes):
    """r/ with one complete checkpoint whose manifest.json is `manifest` (plus a folder sub/ in
    the checkpoint), and what `omgrpo eval` needs: the suite s.yaml, ok.jsonl, m/."""

    def setup(root: Path) -> None:
        _eval_setup(_bench())(root)
        _export_setup(checkpoints=_ckpt(**{"manifest.json": manifest}))(root)
        (root / "r" / "checkpoints" / "step_000001" / "sub").mkdir()

    return setup


@pytest.mark.parametrize(
    "verb",
    [["export", "r", "o"], ["eval", "r", "--suite", "s.yaml"]],
    ids=["export", "eval-a-run"],
)
@pytest.mark.parametrize(
    ("manifest", "names"), [r[1:] for r in MANIFESTS], ids=[r[0] for r in MANIFESTS]
)
def test_a_malformed_checkpoint_manifest_is_refused_by_name(
    tmp_path, capsys, monkeypatch, verb, manifest, names
):
    """Before: a manifest that was JSON but not a manifest's shape raised TypeError or
    AttributeError inside verify_checkpoint; `omgrpo eval RUN` made RUN/eval/<suite>/ before it
    verified the checkpoint."""
    err = refuse(verb, tmp_path, capsys, monkeypatch, _bad_manifest(manifest))
    assert names in err and "r/checkpoints/step_000001/" in err


@pytest.mark.parametrize(
    ("manifest", "names"), [r[1:] for r in MANIFESTS], ids=[r[0] for r in MANIFESTS]
)
def test_verify_checkpoint_raises_checkpoint_errors_only(tmp_path, manifest, names):
    from omgrpo.backends.native.checkpoint import verify_checkpoint
    from omgrpo.errors import CheckpointError

    _bad_manifest(manifest)(tmp_path)
    folder = tmp_path / "r" / "checkpoints" / "step_000001"
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(folder)
    assert names in str(caught.value) and caught.value.file is not None


def _export_dir(change: Callable[[Path], None]):
    """m/: a model directory as `omgrpo export` writes it (stand-in bytes for the weights: a
    refusal must come before anything loads them), with the checksums in its metadata; then
    `change(m)` damages it."""
    from omgrpo.backends.native.export import write_export_meta

    def setup(root: Path) -> None:
        _eval_setup(_bench())(root)
        model = root / "m"
        (model / "model.safetensors").write_bytes(bytes(range(256)) * 4)
        (model / "tokenizer.json").write_text("{}")
        config = {"task": {"name": "toy"}}
        write_export_meta(
            model, run_dir=None, checkpoint_dir=root, label="step_1", why="", step=1,
            config=config, base=None, dtype="float32",
        )  # fmt: skip
        change(model)

    return setup


def _flip(name: str) -> Callable[[Path], None]:
    def change(model: Path) -> None:
        data = bytearray((model / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (model / name).write_bytes(bytes(data))

    return change


def _edit_meta(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def change(model: Path) -> None:
        meta = json.loads((model / "omgrpo_export.json").read_text())
        edit(meta)
        (model / "omgrpo_export.json").write_text(json.dumps(meta))

    return change


EVAL_EXPORT = [
    ("flipped-weight-byte", _flip("model.safetensors"), "m/model.safetensors: sha256 does not"),
    ("flipped-tokenizer-byte", _flip("tokenizer.json"), "m/tokenizer.json: sha256 does not"),
    ("truncated-weights", lambda m: (m / "model.safetensors").write_bytes(b"x"), "m/model.sa"),
    ("weights-deleted", lambda m: (m / "model.safetensors").unlink(), "model.safetensors: missing"),
    ("meta-truncated", lambda m: (m / "omgrpo_export.json").write_text('{"a"'), "not valid JSON"),
    ("meta-a-list", lambda m: (m / "omgrpo_export.json").write_text("[]"), "not a mapping"),
    ("sums-a-list", _edit_meta(lambda d: d.update(sha256=[1])), "omgrpo_export.json: sha256"),
    (
        "sums-name-outside",
        _edit_meta(lambda d: d["sha256"].update({"../ok.jsonl": "0"})),
        "../ok.jsonl",
    ),
]


@pytest.mark.parametrize(
    ("change", "names"), [r[1:] for r in EVAL_EXPORT], ids=[r[0] for r in EVAL_EXPORT]
)
def test_eval_refuses_a_damaged_export_before_loading_it(
    tmp_path, capsys, monkeypatch, change, names
):
    err = refuse(
        ["eval", "m", "--suite", "s.yaml"], tmp_path, capsys, monkeypatch, _export_dir(change)
    )
    assert names in err


LISTINGS = [r for r in MANIFESTS if isinstance(r[1], str) and r[1].startswith('{"sha256"')]


@pytest.mark.parametrize(
    ("sums", "names"),
    [(json.loads(r[1])["sha256"], r[2]) for r in LISTINGS],
    ids=[r[0] for r in LISTINGS],
)
def test_eval_refuses_a_malformed_export_listing_as_export_refuses_a_manifest(
    tmp_path, capsys, monkeypatch, sums, names
):
    """An export's omgrpo_export.json sha256 and a checkpoint's manifest.json are checked by one
    function (`check_sha256s`): the same malformed listing gets the same refusal."""

    def change(model: Path) -> None:
        (model / "sub").mkdir()
        _edit_meta(lambda d: d.update(sha256=sums))(model)

    argv = ["eval", "m", "--suite", "s.yaml"]
    err = refuse(argv, tmp_path, capsys, monkeypatch, _export_dir(change))
    assert names.replace("manifest.json", "omgrpo_export.json") in err


# -- data prepare: every source read before anything is written; no file replaced unasked ----------
def _prepare_setup(root: Path) -> None:
    ok = json.dumps(OK_ROW) + "\n"
    files = {
        "ok.jsonl": ok,
        "empty.jsonl": "",
        "blank.jsonl": "\n\n",
        "truncated.jsonl": ok[: len(ok) // 2],
        "nan.jsonl": '{"question": "q", "answer": NaN}\n',
        "inf.jsonl": '{"question": "q", "answer": -Infinity}\n',
        "list.jsonl": '{"question": "q", "answer": [1, 2]}\n',
        "number-question.jsonl": '{"question": 5, "answer": "1"}\n',
        "huge.jsonl": '{"question": "q", "answer": ' + "9" * 5000 + "}\n",
        "dup.jsonl": "".join(json.dumps({**OK_ROW, "id": "a"}) + "\n" for _ in range(2)),
        "object.json": '{"a": 1}',
        "broken.json": '[{"question": "q"',
        "rows.csv": "question,answer\nq,1\n",
        "bad.yaml": "benchmarks: [\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "not-utf8.jsonl").write_bytes(b'{"question": "\xff", "answer": "1"}\n')
    (root / "truncated.parquet").write_bytes(b"PAR1\x00\x00")
    (root / "sub").mkdir()
    (root / "sub" / "ok.jsonl").write_text(ok)
    (root / "folder.jsonl").mkdir()
    (root / "dangling.jsonl").symlink_to(root / "nowhere.jsonl")
    (root / "out").mkdir()
    (root / "out" / "ok.parquet").write_text("an earlier preparation\n")
    (root / "afile").write_text("x")


PREPARE = [
    ("nothing", [], "nothing to prepare"),
    ("no-such-file", ["nothere.jsonl"], "nothere.jsonl"),
    ("empty-file", ["empty.jsonl"], "empty.jsonl: no rows"),
    ("blank-lines-only", ["blank.jsonl"], "blank.jsonl: no rows"),
    ("truncated-jsonl", ["truncated.jsonl"], "truncated.jsonl, line 1: invalid JSON"),
    ("nan-answer", ["nan.jsonl"], "nan.jsonl, line 1: answer is nan"),
    ("inf-answer", ["inf.jsonl"], "inf.jsonl, line 1: answer is -inf"),
    ("list-answer", ["list.jsonl"], "list.jsonl, line 1"),
    ("number-question", ["number-question.jsonl"], "number-question.jsonl, line 1"),
    ("5000-digit-number", ["huge.jsonl"], "huge.jsonl, line 1: invalid JSON"),  # a traceback
    ("duplicate-ids", ["dup.jsonl"], "duplicate id 'a'"),
    ("json-not-a-list", ["object.json"], "object.json: expected a JSON list"),
    ("json-truncated", ["broken.json"], "broken.json: invalid JSON"),
    ("parquet-truncated", ["truncated.parquet"], "truncated.parquet: not a readable Parquet"),
    ("csv", ["rows.csv"], "rows.csv: unsupported dataset format"),
    ("not-utf8", ["not-utf8.jsonl"], "not-utf8.jsonl, line 1: not valid UTF-8"),
    ("a-folder", ["folder.jsonl"], "folder.jsonl: a directory"),
    ("dangling-symlink", ["dangling.jsonl"], "dangling.jsonl"),
    ("same-name-twice", ["ok.jsonl", "sub/ok.jsonl"], "two sources would write the same file"),
    ("out-file-exists", ["ok.jsonl", "--out", "out"], "out/ok.parquet"),  # replaced unasked
    ("out-a-file", ["ok.jsonl", "--out", "afile"], "afile: --out: not a folder"),
    ("limit-zero", ["ok.jsonl", "--limit", "0"], "--limit (found 0"),
    ("limit-negative", ["ok.jsonl", "--limit", "-2"], "--limit (found -2"),
    ("unknown-toy-split", ["toy:dev"], "'toy:dev': unknown toy split"),
    ("toy-split-dotdot", ["toy:../x"], "'toy:../x': unknown toy split"),
    ("override-without-toy", ["ok.jsonl", "seed=1"], "apply to toy:<split> sources only"),
    ("override-unknown-key", ["toy:train", "nokey=1"], "nokey"),
    ("override-bad-type", ["toy:train", "task.n_train=abc"], "task.n_train=abc"),
    ("override-out-of-range", ["toy:train", "task.n_train=0"], "task.n_train (found 0"),
    ("suite-not-found", ["--suite", "nothere.yaml"], "nothere.yaml: suite file not found"),
    ("suite-broken", ["--suite", "bad.yaml"], "bad.yaml, line 2, column 1: not valid YAML"),
    ("suite-unknown", ["--suite", "nosuch"], "--suite: unknown suite"),
    ("unknown-column", ["ok.jsonl", "--question-key", "nope"], "no 'nope' column"),
    ("gsm8k-without-hashes", ["ok.jsonl", "--answer-format", "gsm8k"], "without a final '####"),
]


@pytest.mark.parametrize(("args", "names"), [r[1:] for r in PREPARE], ids=[r[0] for r in PREPARE])
def test_data_prepare_refuses_before_writing(tmp_path, capsys, monkeypatch, args, names):
    if "--out" not in args:
        args = [*args, "--out", "new"]
    argv = ["data", "prepare", "--backend", "verl", *args]
    err = refuse(argv, tmp_path, capsys, monkeypatch, _prepare_setup)
    assert names in err


def test_data_prepare_replaces_its_files_only_with_force(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _prepare_setup(tmp_path)
    (tmp_path / "out" / "keep.txt").write_text("someone else's\n")
    argv = ["data", "prepare", "--backend", "verl", "ok.jsonl", "--out", "out", "--force"]
    assert cli.main(argv) == 0
    assert (tmp_path / "out" / "ok.parquet").read_bytes().startswith(b"PAR1")
    assert (tmp_path / "out" / "keep.txt").read_text() == "someone else's\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


# -- figures and report: a damaged run is named, never skipped; nothing is written -----------------
def _metrics(*rows: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


GOOD_METRICS = _metrics(*({"train/step": s, "train/loss": 0.1, "val/acc": 0.5} for s in (1, 2, 3)))


def _runs_setup(
    metrics: str | bytes = GOOD_METRICS,
    config: str | None = None,
    status: str | None = '{"state": "finished", "step": 3}',
    xz: bytes | None = None,
):
    """runs/good (a good run) and runs/r (a run with the given files), a file afile, an empty
    folder empty/ and an earlier report in out/ that a refusal must leave alone."""

    def setup(root: Path) -> None:
        for name in ("good", "r"):
            run = root / "runs" / name
            run.mkdir(parents=True)
            text = _default_run_config().replace("name: r\n", f"name: {name}\n")
            (run / "config.yaml").write_text(config if name == "r" and config else text)
            if name == "r" and xz is not None:
                (run / "metrics.jsonl.xz").write_bytes(xz)
            else:
                data = metrics if name == "r" else GOOD_METRICS
                (run / "metrics.jsonl").write_bytes(
                    data if isinstance(data, bytes) else data.encode()
                )
            if status is not None:
                (run / "status.json").write_text(status if name == "r" else "{}")
        (root / "afile").write_text("x")
        (root / "empty").mkdir()
        (root / "out").mkdir()
        (root / "out" / "report.md").write_text("an earlier report\n")

    return setup


def _bad_value(key: str, text: str) -> str:
    """GOOD_METRICS with `key` logged as `text` (raw JSON: NaN, 1e308, ...) at step 2."""
    rows = GOOD_METRICS.splitlines()
    row = json.loads(rows[1])
    row.pop(key, None)
    rows[1] = json.dumps(row)[:-1] + f', "{key}": {text}}}'
    return "\n".join(rows) + "\n"


# (row id, metric, its value as JSON, what the refusal must say): accuracies, shares and rates
# are fractions by definition (docs/metrics.md's unit "fraction"); an accuracy is never nan
BAD_FRACTIONS = [
    ("acc-1e308", "val/acc", "1e308", "runs/r/metrics.jsonl: val/acc: step 2 (found 1e+308; "
     "expected a fraction in [0, 1], never nan (an accuracy))"),
    ("acc-negative", "val/acc", "-0.5", "runs/r/metrics.jsonl: val/acc: step 2 (found -0.5"),
    ("acc-nan", "val/acc", "NaN", "runs/r/metrics.jsonl: val/acc: step 2 (found nan"),
    ("acc-null", "val/acc", "null", "val/acc: step 2 (found None"),
    ("acc-infinity", "val/acc", "Infinity", "val/acc: step 2 (found inf"),
    ("acc-percent", "val/acc", "50", "val/acc: step 2 (found 50;"),
    ("acc-huge-integer", "val/acc", "1" + "0" * 40, "val/acc: step 2 (found 1000000000"),
    ("acc-true", "val/acc", "true", "val/acc: step 2 (found True"),
    ("acc-by-difficulty-nan", "val/acc_hard", "NaN", "val/acc_hard: step 2 (found nan"),
    ("pass-at-k-above-one", "val/pass@4", "1.5", "val/pass@4: step 2 (found 1.5"),
    ("legacy-pass-at-k", "val/pass@k", "-1", "val/pass@k: step 2 (found -1"),
    ("train-acc-above-one", "acc/train", "2", "acc/train: step 2 (found 2;"),
    ("share-above-one", "answers/batch_mode_share", "1.25", "batch_mode_share: step 2 (found 1.25"),
    ("rate-negative", "answers/extract_rate", "-0.1", "answers/extract_rate: step 2 (found -0.1"),
    ("rate-infinity", "answers/label_flip_rate", "-Infinity", "label_flip_rate: step 2 (found -inf"),
    ("share-text", "answers/top_vote_acc", '"0.5"', "answers/top_vote_acc: step 2 (found '0.5'"),
    ("guess-kind-share", "answers/guess_prior_hard", "3", "guess_prior_hard: step 2 (found 3;"),
    ("car-share", "car/position_bias", "-2", "car/position_bias: step 2 (found -2;"),
    ("mask-share", "mask/frac", "1.5", "mask/frac: step 2 (found 1.5"),
    ("recovery-share", "recovery/cum_pass", "7", "recovery/cum_pass: step 2 (found 7;"),
]  # fmt: skip


def _with_file(setup: Callable[[Path], None], name: str, data: bytes):
    """`setup`, then the file `name` (its folders made) holding `data`."""

    def with_file(root: Path) -> None:
        setup(root)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)

    return with_file


RUNS = [
    (
        "metrics-line-broken",
        _runs_setup('{"train/step": 1}\n{"train/st\n{"train/step": 3}\n'),
        "runs/r/metrics.jsonl, line 2: invalid JSON",
    ),
    (
        "metrics-row-a-list",
        _runs_setup('[1, 2]\n{"train/step": 2}\n'),
        "runs/r/metrics.jsonl, line 1: not a metrics row",
    ),
    ("metrics-row-a-number", _runs_setup('5\n{"train/step": 2}\n'), "runs/r/metrics.jsonl, line 1"),
    (
        "step-text",
        _runs_setup(_metrics({"train/step": "abc"}, {"train/step": 2})),
        "line 1: not a metrics row",
    ),
    (
        "step-null",
        _runs_setup(_metrics({"train/step": None}, {"train/step": 2})),
        "line 1: not a metrics row",
    ),
    (
        "step-nan",
        _runs_setup('{"train/step": NaN}\n{"train/step": 2}\n'),
        "line 1: not a metrics row",
    ),
    (
        "step-fraction",
        _runs_setup(_metrics({"train/step": 1.5}, {"train/step": 2})),
        "line 1: not a metrics row",
    ),
    (
        "value-text",
        _runs_setup(
            _metrics({"train/step": 1, "val/acc": "high"}, {"train/step": 2, "val/acc": 0.4})
        ),
        "val/acc: step 1 (found 'high'",
    ),
    (
        "value-a-mapping",
        _runs_setup(_metrics({"train/step": 1, "val/acc": {"a": 1}}, {"train/step": 2})),
        "val/acc: step 1 (found {'a': 1}",
    ),
    (
        "5000-digit-number",
        _runs_setup('{"train/step": 1, "x": ' + "9" * 5000 + "}\n{}\n"),
        "line 1: invalid JSON",
    ),
    (
        "metrics-not-utf8",
        _runs_setup(b'{"train/step": 1, "a": "\xff"}\n'),
        "runs/r/metrics.jsonl: not UTF-8",
    ),
    (
        "xz-truncated",
        _runs_setup(xz=b"\xfd7zXZ\x00\x00"),
        "runs/r/metrics.jsonl.xz: not an xz file",
    ),
    ("config-empty", _runs_setup(config="\n"), "runs/r/config.yaml: not a mapping"),
    ("config-a-list", _runs_setup(config="- 1\n"), "runs/r/config.yaml: not a mapping"),
    ("config-broken", _runs_setup(config="a: [\n"), "runs/r/config.yaml, line 2, column 1"),
    ("config-run-a-list", _runs_setup(config="run: [1]\n"), "runs/r/config.yaml: run (found [1]"),
    ("status-truncated", _runs_setup(status="{"), "runs/r/status.json, line 1, column 2"),
    ("status-a-list", _runs_setup(status="[]"), "runs/r/status.json: not a mapping"),
    *(  # logged fractions out of [0, 1]: they went into the tables and figures as numbers
        (f"fraction-{name}", _runs_setup(_bad_value(key, text)), found)
        for name, key, text, found in BAD_FRACTIONS
    ),
    (
        "fraction-in-compact-metrics",  # metrics.jsonl.xz: the same check, naming that file
        _runs_setup(xz=lzma.compress(_bad_value("val/acc", "1e308").encode())),
        "runs/r/metrics.jsonl.xz: val/acc: step 2 (found 1e+308; expected a fraction in [0, 1]",
    ),
    (  # an ArrowInvalid traceback ("a bug") before
        "rollouts-not-parquet",
        _with_file(_runs_setup(), "runs/r/rollouts/step_000001.parquet", b"PAR1junk"),
        "runs/r/rollouts/step_000001.parquet: not a readable Parquet file",
    ),
    (
        "rollouts-empty-file",
        _with_file(_runs_setup(), "runs/r/rollouts/step_000002.parquet", b""),
        "runs/r/rollouts/step_000002.parquet: not a readable Parquet file",
    ),
]
RUN_ARGS = [
    ("no-such-source", ["nothere"], "nothere: no such file or directory"),
    ("source-a-file", ["afile"], "afile: not a directory"),
    ("no-run-in-source", ["empty"], "empty: no run found"),
    ("out-a-file", ["runs", "--out", "afile"], "afile: --out: not a folder"),
    ("folder-not-a-run", ["out", "--out", "o2"], "out: no run found"),  # a report folder
    ("second-source-missing", ["runs", "nothere"], "nothere: no such file or directory"),
]


@pytest.mark.parametrize("verb", ["figures", "report"])
@pytest.mark.parametrize(("setup", "names"), [r[1:] for r in RUNS], ids=[r[0] for r in RUNS])
def test_figures_and_report_refuse_a_damaged_run(tmp_path, capsys, monkeypatch, verb, setup, names):
    err = refuse([verb, "runs", "--out", "out"], tmp_path, capsys, monkeypatch, setup)
    assert names in err


@pytest.mark.parametrize("verb", ["figures", "report"])
@pytest.mark.parametrize(("args", "names"), [r[1:] for r in RUN_ARGS], ids=[r[0] for r in RUN_ARGS])
def test_figures_and_report_refuse_bad_arguments(tmp_path, capsys, monkeypatch, verb, args, names):
    if "--out" not in args:
        args = [*args, "--out", "out"]
    err = refuse([verb, *args], tmp_path, capsys, monkeypatch, _runs_setup())
    assert names in err


def test_report_refuses_a_config_that_does_not_fit_the_schema(tmp_path, capsys, monkeypatch):
    config = _default_run_config().replace("\nseed: 0\n", "\nseed: abc\n")
    assert config != _default_run_config()
    err = refuse(
        ["report", "runs", "--out", "out"],
        tmp_path,
        capsys,
        monkeypatch,
        _runs_setup(config=config),
    )
    assert "runs/r/config.yaml: seed: does not fit omgrpo's config" in err


FIGURES_SOURCES = [
    (
        "wandb-offline",  # a RuntimeError from omgrpo.analysis.load before
        ["--wandb-project", "someone/omgrpo"],
        "--wandb-project: loading the W&B project 'someone/omgrpo' needs the online W&B API",
    ),
    (
        "mlflow-uri-unsupported",  # an MLflow exception's traceback before
        ["--mlflow-experiment", "toy", "--mlflow-uri", "nonsense://x"],
        "--mlflow-uri: MLflow cannot read it",
    ),
    (
        "mlflow-db-missing",
        ["--mlflow-experiment", "toy", "--mlflow-uri", "sqlite:///nope.db"],
        "MLflow database nope.db not found",
    ),
    ("runs-and-wandb-offline", ["runs", "--wandb-project", "p"], "--wandb-project"),
]


@pytest.mark.parametrize(
    ("args", "names"), [r[1:] for r in FIGURES_SOURCES], ids=[r[0] for r in FIGURES_SOURCES]
)
def test_figures_refuse_a_tracker_source_it_cannot_read(tmp_path, capsys, monkeypatch, args, names):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    err = refuse(["figures", *args, "--out", "out"], tmp_path, capsys, monkeypatch, _runs_setup())
    assert names in err


def test_figures_refuse_no_runs_and_an_unknown_figure(tmp_path, capsys, monkeypatch):
    err = refuse(["figures", "--out", "out"], tmp_path, capsys, monkeypatch, _runs_setup())
    assert "give run directories" in err
    err = refuse(["figures", "runs", "--out", "o", "--only", "nope"], tmp_path, capsys, monkeypatch)
    assert "--only: invalid choice: 'nope'" in err


# -- study-report: what its command line checks (the pre-registration's own checks: test_study) ---
def _study_setup(prereg: str | bytes | None):
    def setup(root: Path) -> None:
        _runs_setup()(root)
        if prereg is not None:
            data = prereg if isinstance(prereg, bytes) else prereg.encode()
            (root / "pre.md").write_bytes(data)

    return setup


STUDY = [
    ("prereg-missing", None, "pre.md"),
    ("prereg-no-yaml-block", "# predictions\n\nnone\n", "pre.md: no ```yaml block"),
    (
        "prereg-block-a-list",
        "```yaml\n- 1\n```\n",
        "pre.md: the predictions block must be a mapping",
    ),
    (
        "prereg-block-broken",
        "```yaml\na: [\n```\n",
        "pre.md: the predictions block is not valid YAML",
    ),
    ("prereg-block-empty", "```yaml\n```\n", "pre.md"),
    ("prereg-unknown-key", "```yaml\nnope: 1\n```\n", "unknown key 'nope'"),
]


@pytest.mark.parametrize(("prereg", "names"), [r[1:] for r in STUDY], ids=[r[0] for r in STUDY])
def test_study_report_refuses_a_bad_preregistration(tmp_path, capsys, monkeypatch, prereg, names):
    argv = ["study-report", "runs", "--prereg", "pre.md", "--out", "st"]
    err = refuse(argv, tmp_path, capsys, monkeypatch, _study_setup(prereg))
    assert names in err


GOOD_PREREG = "```yaml\npredictions: []\nfinal_steps: [3]\nstart_step: 0\n```\n"
STUDY_RUN = [
    ("seconds-nan", ["runs", "--seconds", "nan"], "--seconds"),
    ("seconds-negative", ["runs", "--seconds", "-5"], "--seconds"),
    ("no-runs-there", ["empty"], "empty"),
]


@pytest.mark.parametrize(
    ("key", "text", "names"),
    [r[1:] for r in BAD_FRACTIONS],
    ids=[r[0] for r in BAD_FRACTIONS],
)
def test_study_report_refuses_a_fraction_out_of_range(
    tmp_path, capsys, monkeypatch, key, text, names
):
    """The runs a study reads go through the same check as report's and figures'
    (`omgrpo.analysis.load.check_fractions`): a val/acc of 1e308 went into its verdicts."""

    def setup(root: Path) -> None:
        _runs_setup(_bad_value(key, text))(root)
        (root / "pre.md").write_text(GOOD_PREREG)

    argv = ["study-report", "runs", "--prereg", "pre.md", "--out", "st"]
    err = refuse(argv, tmp_path, capsys, monkeypatch, setup)
    assert names in err and not (tmp_path / "st").exists()


@pytest.mark.parametrize(
    ("args", "names"), [r[1:] for r in STUDY_RUN], ids=[r[0] for r in STUDY_RUN]
)
def test_study_report_refusals_create_no_output_folder(tmp_path, capsys, monkeypatch, args, names):
    """A refused study-report writes nothing, not even an empty --out (it made --out/figures
    before reading the runs); --seconds, written into the report, must be a finite number >= 0."""
    argv = ["study-report", *args, "--prereg", "pre.md", "--out", "st"]
    err = refuse(argv, tmp_path, capsys, monkeypatch, _study_setup(GOOD_PREREG))
    assert names in err and not (tmp_path / "st").exists()


# -- bench memory: sizes and configs checked before the first (minutes-long) measurement ----------
def _model_dirs(root: Path) -> None:
    good = {
        "model_type": "qwen2",
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "vocab_size": 256,
    }
    configs = {
        "m": json.dumps(good),
        "broken": "{broken",
        "partial": json.dumps({"model_type": "qwen2", "hidden_size": 64}),
        "odd-head": json.dumps({**good, "hidden_size": 120}),  # head dim 30: not / 16
    }
    for name, text in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(text)
    (root / "empty").mkdir()
    (root / "afile").write_text("x")


BENCH_MEMORY = [
    ("shrink-zero", ["--shrink", "0"], "--shrink (found 0"),
    ("shrink-negative", ["--shrink", "-16"], "--shrink (found -16"),
    ("prompts-zero", ["--prompts", "0"], "--prompts (found 0"),
    ("rollouts-negative", ["--rollouts", "-1"], "--rollouts (found -1"),
    ("micro-zero", ["--micro", "0"], "--micro (found 0"),
    ("gen-tokens-zero", ["--gen-tokens", "0"], "--gen-tokens (found 0"),
    ("steps-zero", ["--steps", "0"], "--steps (found 0"),
    ("no-such-config", ["--configs", "nope"], "--configs: no config.json (found 'nope'"),
    ("config-a-file", ["--configs", "afile"], "found 'afile'"),
    ("config-folder-empty", ["--configs", "empty"], "found 'empty'"),
    ("config-json-broken", ["--configs", "broken"], "broken/config.json: not valid JSON"),
    ("config-fields-missing", ["--configs", "partial"], "partial/config.json: num_hidden_layers"),
    ("head-dim-not-shrinkable", ["--configs", "odd-head"], "odd-head/config.json: head dim 30"),
    ("second-config-bad", ["--configs", "m,broken"], "broken/config.json"),  # none measured
    ("empty-config-name", ["--configs", "m,"], "--configs (found 'm,'"),
    ("overrides", ["--configs", "m", "seed=1"], "takes no config overrides"),
    ("out-a-folder", ["--configs", "m", "--out", "empty"], "--out: a folder"),
    ("out-folder-missing", ["--configs", "m", "--out", "nope/x.json"], "its folder does not exist"),
    ("unknown-bench", None, "invalid choice: 'nope'"),
]


@pytest.mark.parametrize(
    ("args", "names"), [r[1:] for r in BENCH_MEMORY], ids=[r[0] for r in BENCH_MEMORY]
)
def test_bench_memory_refuses_before_measuring(tmp_path, capsys, monkeypatch, args, names):
    from omgrpo.tools import memory_bench

    def measured(*args, **kwargs):
        raise AssertionError("a refused bench started a measurement")

    monkeypatch.setattr(memory_bench, "_run_worker", measured)
    argv = ["bench", "nope"] if args is None else ["bench", "memory", *args]
    err = refuse(argv, tmp_path, capsys, monkeypatch, _model_dirs)
    assert names in err


# -- sweep: the whole grid checked before the first run starts ----------------------------------
SWEEP_FILES = {
    "ok.yaml": {"method": "grid", "parameters": {"seed": {"values": [0, 1]}}},
    "steps-zero.yaml": {"method": "grid", "parameters": {"trainer.steps": {"values": [5, 0]}}},
    "n-zero.yaml": {"method": "grid", "parameters": {"rollout.n": {"values": [0]}}},
    "lr-nan.yaml": {"method": "grid", "parameters": {"optim.lr": {"value": float("nan")}}},
    "dotdot.yaml": {"method": "grid", "parameters": {"run.name": {"values": ["../../evil"]}}},
    "bad-type.yaml": {"method": "grid", "parameters": {"trainer.steps": {"values": ["abc"]}}},
    "no-key.yaml": {"method": "grid", "parameters": {"nokey": {"values": [1]}}},
    "random.yaml": {"method": "random", "parameters": {"seed": {"values": [0]}}},
    "no-parameters.yaml": {"method": "grid"},
    "nested.yaml": {"method": "grid", "parameters": {"seed": {"values": [{"a": 1}]}}},
    "distribution.yaml": {"method": "grid", "parameters": {"optim.lr": {"min": 0.1, "max": 1}}},
    "values-empty.yaml": {"method": "grid", "parameters": {"seed": {"values": []}}},
    "same-dir.yaml": {"method": "grid", "parameters": {"optim.lr": {"values": [0.1, 0.2]}}},
}


def _sweep_setup(root: Path) -> None:
    for name, data in SWEEP_FILES.items():
        (root / name).write_text(yaml.safe_dump(data))
    (root / "broken.yaml").write_text("method: grid\nparameters: [\n")
    (root / "empty.yaml").write_text("")
    (root / "a-list.yaml").write_text("- 1\n")
    (root / "not-utf8.yaml").write_bytes(b"\xff\xfe")
    (root / "folder.yaml").mkdir()
    (root / "afile").write_text("x")


SWEEP = [
    ("value-out-of-range", ["steps-zero.yaml"], "run trainer.steps=0"),  # it failed mid-grid
    ("rollout-n-zero", ["n-zero.yaml"], "rollout.n (found 0"),
    ("lr-nan", ["lr-nan.yaml"], "optim.lr (found nan"),
    ("name-leaves-root", ["dotdot.yaml"], "run.name '../../evil' would leave run.root"),
    ("bad-type", ["bad-type.yaml"], "trainer.steps=abc"),
    ("unknown-key", ["no-key.yaml"], "nokey"),
    ("method-random", ["random.yaml"], "random.yaml: method: 'random' is not supported"),
    ("no-parameters", ["no-parameters.yaml"], "no-parameters.yaml: missing or empty"),
    ("nested-value", ["nested.yaml"], "nested.yaml: parameters.seed: value {'a': 1}"),
    ("distribution", ["distribution.yaml"], "parameters.optim.lr: needs 'values'"),
    ("values-empty", ["values-empty.yaml"], "parameters.seed.values: must be a non-empty list"),
    ("two-runs-one-dir", ["same-dir.yaml"], "two grid points get the same run directory"),
    ("broken-yaml", ["broken.yaml"], "broken.yaml, line 3, column 1: not valid YAML"),
    ("empty-file", ["empty.yaml"], "empty.yaml: a sweep file must be a mapping"),
    ("a-list", ["a-list.yaml"], "a-list.yaml: a sweep file must be a mapping"),
    ("not-utf8", ["not-utf8.yaml"], "not-utf8.yaml: not UTF-8"),  # a traceback before
    ("a-folder", ["folder.yaml"], "folder.yaml: not a file"),
    ("no-such-file", ["nothere.yaml"], "nothere.yaml: no such sweep file"),
    ("override-out-of-range", ["ok.yaml", "trainer.steps=-1"], "trainer.steps (found -1"),
    ("override-unknown", ["ok.yaml", "nokey=1"], "nokey"),
    ("jobs-zero", ["ok.yaml", "--jobs", "0"], "--jobs must be >= 1"),
    ("eval-suite-missing", ["ok.yaml", "--eval", "nope.yaml"], "--eval: nope.yaml: suite file"),
    ("eval-checkpoint", ["ok.yaml", "--eval", "toy", "--eval-checkpoint", "latest"], "latest"),
    ("tables-a-file", ["ok.yaml", "--eval", "toy", "--tables", "afile"], "--tables afile"),
    ("tables-without-eval", ["ok.yaml", "--tables", "t"], "--tables needs --eval"),
    ("agent-count-negative", ["--agent", "e/p/id", "--count", "-1"], "--count must be >= 1"),
]


@pytest.mark.parametrize(("args", "names"), [r[1:] for r in SWEEP], ids=[r[0] for r in SWEEP])
def test_sweep_refuses_before_any_run(tmp_path, capsys, monkeypatch, args, names):
    from omgrpo import sweep

    def execute(*args, **kwargs):
        raise AssertionError("a refused sweep started its runs")

    monkeypatch.setattr(sweep, "_execute", execute)
    monkeypatch.setattr(sweep, "_run_agents", execute)
    err = refuse(["sweep", *args, "run.root=runs"], tmp_path, capsys, monkeypatch, _sweep_setup)
    assert names in err


# -- sync: a damaged store refused before a tracker or the run directory is written ---------------
def _sync_setup(
    config: str = "run: {name: r}\n", metrics: str = '{"train/step": 1}\n', status=None
):
    def setup(root: Path) -> None:
        run = root / "runs" / "r"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(config)
        (run / "metrics.jsonl").write_text(metrics)
        if status is not None:
            (run / "status.json").write_text(status)
        (root / "afile").write_text("x")
        (root / "empty").mkdir()

    return setup


SYNC = [
    ("no-such-run", ["nothere"], _sync_setup(), "nothere/config.yaml not found"),
    ("run-a-file", ["afile"], _sync_setup(), "afile/config.yaml not found"),
    ("not-a-run", ["empty"], _sync_setup(), "empty/config.yaml not found"),
    ("config-broken", ["runs/r"], _sync_setup(config="a: [\n"), "runs/r/config.yaml, line 2"),
    ("tracking-a-list", ["runs/r"], _sync_setup(config="tracking: [1]\n"), "tracking (found [1]"),
    (
        "metrics-broken",  # before: the MLflow run was made, then the sync failed
        ["runs/r"],
        _sync_setup(metrics='{"train/st\n{"train/step": 2}\n'),
        "runs/r/metrics.jsonl, line 1: invalid JSON",
    ),
    (
        "status-broken",  # before: identity.json and trackers.json were written first
        ["runs/r"],
        _sync_setup(status="{"),
        "runs/r/status.json, line 1, column 2",
    ),
    ("unknown-tracker", ["runs/r", "--to", "tensorboard"], _sync_setup(), "invalid choice"),
    (
        "mlflow-uri-unsupported",  # an MlflowException traceback before
        ["runs/r", "--mlflow-uri", "nonsense://x"],
        _sync_setup(),
        "--mlflow-uri: mlflow refused the sync",
    ),
]


@pytest.mark.parametrize(
    ("args", "setup", "names"), [r[1:] for r in SYNC], ids=[r[0] for r in SYNC]
)
def test_sync_refuses_a_damaged_store_before_writing(
    tmp_path, capsys, monkeypatch, args, setup, names
):
    for var in ("MLFLOW_TRACKING_URI",):
        monkeypatch.delenv(var, raising=False)
    if "--to" not in args:
        args = [*args, "--to", "mlflow"]
    err = refuse(["sync", *args], tmp_path, capsys, monkeypatch, setup)
    assert names in err


# -- base and prm train: the config checked before a toy model is trained ------------------------
BASE_PRM = [
    ("not-a-toy-model", ["model.path=m"], "makes toy bases only"),
    ("not-the-toy-task", ["task=files"], "task=files"),
    ("unknown-key", ["nokey=1"], "nokey"),
    ("value-out-of-range", ["task.n_train=-1"], "task.n_train (found -1"),
    ("rollout-n-zero", ["rollout.n=0"], "rollout.n (found 0"),
    ("warm-start-lr-zero", ["model.warm_start.lr=0"], "model.warm_start.lr (found 0"),
    ("warm-start-batch-zero", ["model.warm_start.batch_size=0"], "warm_start.batch_size (found 0"),
    ("note-without-ship", ["--note", "x"], "--note is stored with --ship only"),
]


@pytest.mark.parametrize("verb", [["base"], ["prm", "train"]], ids=["base", "prm"])
@pytest.mark.parametrize(("args", "names"), [r[1:] for r in BASE_PRM], ids=[r[0] for r in BASE_PRM])
def test_base_and_prm_refuse_before_training(tmp_path, capsys, monkeypatch, verb, args, names):
    from omgrpo.models import loading

    def train(*args, **kwargs):
        raise AssertionError("a refused command started training a toy model")

    monkeypatch.setattr(loading, "base_model_dir", train)
    if verb[0] == "prm":
        names = names.replace("toy bases", "the toy PRM")
    err = refuse([*verb, *args], tmp_path, capsys, monkeypatch, lambda r: (r / "m").mkdir())
    assert names in err


PLAN_VERL = [
    ("no-preset", ["--device-gb", "10"], "experiment: name a verl preset"),
    # compose_verl's refusals: a ValueError traceback ("a bug") from `plan backend=verl` before
    (
        "answer-weight-negative",
        ["experiment=paper_qwen3_1p7b", "omgrpo.algorithm.answer_weight=-1", "--device-gb", "10"],
        "omgrpo.algorithm.answer_weight must be >= 0",
    ),
    (
        "group-of-one",
        ["experiment=paper_qwen3_1p7b", "actor_rollout_ref.rollout.n=1", "--device-gb", "10"],
        "actor_rollout_ref.rollout.n (G, rollouts per prompt)",
    ),
    (
        "seed-negative",
        ["experiment=paper_qwen3_1p7b", "seed=-1", "--device-gb", "10"],
        "omgrpo.seed (found -1",
    ),
    (
        "gpus-zero",
        ["experiment=paper_qwen3_1p7b", "trainer.n_gpus_per_node=0", "--device-gb", "10"],
        "trainer.n_gpus_per_node (found 0",
    ),
    ("device-gb-nan", ["experiment=paper_qwen3_1p7b", "--device-gb", "nan"], "--device-gb"),
    ("device-gb-zero", ["experiment=paper_qwen3_1p7b", "--device-gb", "0"], "--device-gb"),
    ("no-model-path", ["experiment=paper_qwen3_1p7b", "--device-gb", "10"], "model.path: set"),
    (
        "no-such-model",
        [
            "experiment=paper_qwen3_1p7b",
            "actor_rollout_ref.model.path=/nonexistent",
            "--device-gb",
            "10",
        ],
        "'/nonexistent'",
    ),
]


@pytest.mark.parametrize(
    ("args", "names"), [r[1:] for r in PLAN_VERL], ids=[r[0] for r in PLAN_VERL]
)
def test_plan_of_a_verl_preset_refuses(tmp_path, capsys, monkeypatch, args, names):
    err = refuse(["plan", "backend=verl", *args], tmp_path, capsys, monkeypatch)
    assert names in err


TRAIN_VERL = [
    ("no-preset", [], "omgrpo train backend=verl: error: experiment: name a preset"),
    ("unknown-preset", ["experiment=paper_qwen3"], "no verl preset 'paper_qwen3'"),
    (
        "model-path-missing",
        ["experiment=paper_qwen3_1p7b"],
        "set actor_rollout_ref.model.path",
    ),
]
VERL_LAUNCH = [
    "experiment=paper_qwen3_1p7b",
    "actor_rollout_ref.model.path=/nonexistent",
    "data.train_files=a.parquet",
    "data.val_files=b.parquet",
]
# a bad omgrpo.* (or verl) value of a launch otherwise complete: refused by compose_verl
# (omgrpo.backends.verl.config: InputError naming the key) or verl's own validate_config, with no
# traceback, before Ray; --dry-run is the same path without the launch
TRAIN_VERL_VALUES = [
    ("unknown-omgrpo-key", ["omgrpo.nokey=1"], "Key 'nokey' not in 'OmgrpoVerlConfig'"),
    ("bad-type", ["omgrpo.algorithm.answer_weight=abc"], "omgrpo.algorithm.answer_weight=abc"),
    ("answer-weight-negative", ["omgrpo.algorithm.answer_weight=-1"], "answer_weight must be >="),
    ("unsupported-reward", ["omgrpo.reward.parts=[entropy]"], "omgrpo.reward.parts: ['entropy']"),
    ("verl-owned-key", ["omgrpo.algorithm.kl_coef=0.1"], "set actor_rollout_ref.actor.kl_loss"),
    ("resume-maybe", ["run.resume=maybe"], "omgrpo.run.resume='maybe'"),
    ("group-of-one", ["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n (G,"),
    ("group-size-text", ["actor_rollout_ref.rollout.n=abc"], "got 'abc'"),  # int(): ValueError
    ("seed-negative", ["seed=-1"], "omgrpo.seed (found -1"),  # went to verl unchecked
    ("patience-zero", ["omgrpo.collapse.patience=0"], "omgrpo.collapse.patience (found 0"),
    ("log-rollouts-zero", ["omgrpo.run.log_rollouts_every=0"], "log_rollouts_every (found 0"),
    (
        "prm-gpus-nan",  # nan < 0 is false: it passed
        ["omgrpo.reward.parts=[process]", "omgrpo.reward.prm.path=p", "omgrpo.prm_server.num_gpus=nan"],
        "omgrpo.prm_server.num_gpus (found nan",
    ),
    (
        "prm-aggregate-unknown",
        ["omgrpo.reward.parts=[process]", "omgrpo.reward.prm.path=p", "omgrpo.reward.prm.aggregate=x"],
        "omgrpo.reward.prm.aggregate: unknown reward.prm.aggregate 'x'",
    ),
    ("batch-zero", ["data.train_batch_size=0"], "data.train_batch_size (found 0"),
    ("gpus-zero", ["trainer.n_gpus_per_node=0"], "trainer.n_gpus_per_node (found 0"),
    ("top-p-above-one", ["actor_rollout_ref.rollout.top_p=1.5"], "rollout.top_p (found 1.5"),
    ("entropy-bonus", ["actor_rollout_ref.actor.entropy_coeff=0.1"], "entropy_coeff must be 0"),
    (
        "refused-by-verls-check",  # verl's validate_config: a ValueError traceback before
        ["actor_rollout_ref.actor.use_dynamic_bsz=false",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
        "verl's config check refused it: [actor_rollout_ref.ref]",
    ),
    (
        "refused-by-verls-check-dry-run",  # --dry-run runs the same checks, without a launch
        ["actor_rollout_ref.actor.use_dynamic_bsz=false",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "--dry-run"],
        "verl's config check refused it: [actor_rollout_ref.ref]",
    ),
    ("seed-negative-dry-run", ["seed=-1", "--dry-run"], "omgrpo.seed (found -1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "names"), [r[1:] for r in TRAIN_VERL], ids=[r[0] for r in TRAIN_VERL]
)
def test_train_on_verl_refuses_before_ray(tmp_path, capsys, monkeypatch, args, names):
    err = refuse(["train", "backend=verl", *args], tmp_path, capsys, monkeypatch)
    assert names in err


@pytest.mark.parametrize(
    ("args", "names"),
    [r[1:] for r in TRAIN_VERL_VALUES],
    ids=[r[0] for r in TRAIN_VERL_VALUES],
)
def test_train_on_verl_refuses_a_bad_value_before_ray(tmp_path, capsys, monkeypatch, args, names):
    from omgrpo.backends.verl import launch

    def run_ppo(*args, **kwargs):
        raise AssertionError("a refused launch started verl's run_ppo")

    monkeypatch.setattr("verl.trainer.main_ppo.run_ppo", run_ppo)
    monkeypatch.setattr(launch, "check_checkpoint_folder", lambda cfg: None)
    argv = ["train", "backend=verl", *VERL_LAUNCH, *args]
    err = refuse(argv, tmp_path, capsys, monkeypatch)
    assert err.startswith("omgrpo train backend=verl: error: ") and names in err


def test_report_refuses_a_damaged_problems_table(tmp_path, capsys, monkeypatch):
    """A `problems.parquet` that cannot be read is named, never skipped: the fates of the other
    runs would otherwise be reported as all of them (it was a warning and exit 0)."""
    setup = _with_file(_runs_setup(), "runs/r/problems.parquet", b"PAR1junk")
    err = refuse(["report", "runs", "--out", "out"], tmp_path, capsys, monkeypatch, setup)
    assert "runs/r/problems.parquet: unreadable" in err
