"""Bad input, tried as a new user would (issue 37): every row runs `omgrpo.cli.main` in-process
in a fresh folder and asserts exit status 2, a message on stderr naming the thing (file, row,
key), no traceback, and that no file in the folder changed or appeared (hashed before and
after). Fast: no row trains or loads a model."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from omgrpo import cli
from omgrpo.config import compose, to_container
from omgrpo.errors import InputError, check_int, check_number, inside


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root: path -> sha256 (folders: 'dir')."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
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


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_of_an_expected_error(tmp_path, capsys, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMGRPO_DEBUG", raising=False)
    args = ["plan", "model.path=m", "--device-gb", "nan"]
    if how == "flag":
        args = ["--debug", *args]
    else:
        monkeypatch.setenv("OMGRPO_DEBUG", "1")
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "omgrpo plan: error: --device-gb" in err


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
