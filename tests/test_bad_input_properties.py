"""Free-form inputs, drawn at random (issue 37): a suite YAML (`omgrpo eval`), a model's
config.json (`omgrpo plan`) and a pre-registration's predictions block (`omgrpo study-report`,
through `read_preregistration`) either load or raise InputError (named, exit 2), never another
exception (a traceback). Each draws few examples: fast tier."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from omgrpo.errors import InputError

# scalars a user or a damaged file puts anywhere: numbers of every kind, text, nothing
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "..", "../x", "a/b", "toy:test", "ok.jsonl", "ü😀", "1e400"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _mutations(text: str) -> st.SearchStrategy[str]:
    """A valid file cut short, with a stretch deleted, or with a character changed."""
    n = len(text)
    cut = st.integers(0, n).map(lambda i: text[:i])
    hole = st.tuples(st.integers(0, n), st.integers(0, 40)).map(
        lambda t: text[: t[0]] + text[t[0] + t[1] :]
    )
    flip = st.tuples(st.integers(0, max(n - 1, 0)), st.characters()).map(
        lambda t: text[: t[0]] + t[1] + text[t[0] + 1 :]
    )
    return st.one_of(cut, hole, flip)


def _dump(data) -> str:
    try:
        return yaml.safe_dump(data, allow_unicode=True)
    except yaml.YAMLError:  # a value PyYAML cannot represent: say so in the file
        return "!!python/object:x {}\n"


# -- suite YAML --------------------------------------------------------------------------------
FIELDS = [
    "path", "k", "temperature", "top_p", "max_new_tokens", "limit", "seed", "answer_format",
    "question_key", "answer_key", "system_prompt", "nope",
]  # fmt: skip
SPEC = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6)
FULL_SPEC = st.fixed_dictionaries(
    {"path": st.one_of(st.just("ok.jsonl"), VALUES), "k": st.one_of(st.integers(-2, 4), VALUES)},
    optional={f: VALUES for f in FIELDS if f not in ("path", "k")},
)
BENCHMARKS = st.dictionaries(
    st.one_of(st.text(max_size=8), st.sampled_from(["..", "a/b", "ok"])),
    st.one_of(FULL_SPEC, SPEC, VALUES),
    max_size=3,
)
SUITE = st.fixed_dictionaries(
    {"benchmarks": st.one_of(BENCHMARKS, VALUES)},
    optional={"name": VALUES, "defaults": st.one_of(SPEC, VALUES), "extra": VALUES},
)
GOOD_SUITE = _dump(
    {"name": "s", "defaults": {"k": 2}, "benchmarks": {"b": {"path": "ok.jsonl", "top_p": 0.9}}}
)


def _load_suite_text(text: str) -> None:
    from omgrpo.eval.suite import load_suite

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "s.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        with contextlib.suppress(InputError):
            load_suite(str(path))


@settings(max_examples=60)
@given(st.one_of(SUITE.map(_dump), _mutations(GOOD_SUITE), st.text(max_size=40)))
def test_a_suite_file_loads_or_is_refused_by_name(text):
    _load_suite_text(text)


# -- a model's config.json for `omgrpo plan` -------------------------------------------------------
GOOD_MODEL = {
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}
MODEL_KEYS = [*GOOD_MODEL, "head_dim", "tie_word_embeddings", "n_layer", "torch_dtype"]


@functools.cache
def _plan_config():
    from omgrpo.config import compose

    return compose(["experiment=paper", "model.path=m"])


def _plan(text: str) -> None:
    from omgrpo.models.memory import GIB, check_model_config, format_plan, plan_memory

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(text, encoding="utf-8", errors="surrogatepass")
        with contextlib.suppress(InputError):
            check_model_config(folder)
            format_plan(plan_memory(_plan_config(), folder, 24 * GIB, "cuda"))


@settings(max_examples=40)
@given(
    st.one_of(
        st.dictionaries(st.sampled_from(MODEL_KEYS), VALUES, max_size=9).map(
            lambda d: json.dumps({**GOOD_MODEL, **d}, allow_nan=True)
        ),
        st.dictionaries(st.sampled_from(MODEL_KEYS), VALUES, max_size=9).map(
            lambda d: json.dumps(d, allow_nan=True)
        ),
        _mutations(json.dumps(GOOD_MODEL)),
    )
)
def test_a_config_json_is_planned_or_refused_by_name(text):
    _plan(text)


# -- a pre-registration's predictions block --------------------------------------------------------
PREDICTION_FIELDS = [
    "id", "world", "metric", "measure", "expect", "a", "b", "at_every_validation", "by_step",
    "event", "seeds", "nope",
]  # fmt: skip
PREDICTION = st.dictionaries(
    st.sampled_from(PREDICTION_FIELDS),
    st.one_of(
        VALUES,
        st.sampled_from(["change", "diff", "spearman", "opened", "val/acc", ">", "<", "abs<"]),
        st.lists(st.one_of(st.sampled_from([">", "<", "abs<"]), SCALARS), max_size=3),
    ),
    max_size=8,
)
STEPS = st.one_of(st.integers(-3, 300), VALUES)
PREREG = st.fixed_dictionaries(
    {  # the keys it requires, so the draws reach the checks behind them
        "predictions": st.lists(st.one_of(PREDICTION, VALUES), max_size=3),
        "final_steps": STEPS,
        "start_step": STEPS,
    },
    optional={
        "event_predictions": st.lists(st.one_of(PREDICTION, VALUES), max_size=2),
        "events": st.one_of(
            st.fixed_dictionaries({"censor_at": STEPS}, optional={"arms": VALUES}), VALUES
        ),
        "stop_unless_confirmed": VALUES,
        "holm_family": VALUES,
        "holm_alpha_one_sided": VALUES,
        "sensitivity": VALUES,
        "nope": VALUES,
    },
)


def _read_prereg(text: str) -> None:
    from omgrpo.analysis.study import read_preregistration

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "PREREGISTRATION.md"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        with contextlib.suppress(InputError):
            read_preregistration(path)


def _committed_prereg() -> str:
    found = sorted(Path(__file__).parents[1].glob("reports/*/PREREGISTRATION*.md"))
    return found[-1].read_text() if found else "```yaml\npredictions: []\n```\n"


@settings(max_examples=60)
@given(
    st.one_of(
        PREREG.map(lambda d: "# Study\n\n```yaml\n" + _dump(d) + "```\n"),
        _mutations(_committed_prereg()),
    )
)
def test_a_preregistration_reads_or_is_refused_by_name(text):
    _read_prereg(text)


# -- a checkpoint's manifest.json (export, eval, resume) and an export's checksums (eval) ----------
DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of b""
GOOD_MANIFEST = json.dumps({"step": 1, "sha256": {"state.pt": DIGEST}})
NAMES = st.one_of(
    st.sampled_from(["state.pt", "", ".", "..", "../state.pt", "/x", "a/b"]), st.text(max_size=8)
)


def _verify(text: str) -> None:
    """verify_checkpoint on a checkpoint (an empty state.pt) with this manifest, and
    verify_export on a model directory whose omgrpo_export.json lists the same checksums."""
    from omgrpo.backends.native.checkpoint import verify_checkpoint
    from omgrpo.backends.native.export import verify_export

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "state.pt").write_bytes(b"")
        (folder / "manifest.json").write_text(text, encoding="utf-8", errors="surrogatepass")
        with contextlib.suppress(InputError):
            verify_checkpoint(folder)
        try:
            sums = json.loads(text)["sha256"]
        except (ValueError, TypeError, KeyError, IndexError):
            return
        (folder / "omgrpo_export.json").write_text(json.dumps({"sha256": sums}))
        with contextlib.suppress(InputError):
            verify_export(folder)


@settings(max_examples=60)
@given(
    st.one_of(
        st.dictionaries(NAMES, st.one_of(st.just(DIGEST), VALUES), max_size=3).map(
            lambda d: json.dumps({"sha256": d}, allow_nan=True)
        ),
        VALUES.map(lambda v: json.dumps({"sha256": v}, allow_nan=True)),
        VALUES.map(lambda v: json.dumps(v, allow_nan=True)),
        _mutations(GOOD_MANIFEST),
    )
)
def test_a_manifest_is_verified_or_refused_by_name(text):
    _verify(text)


# -- a run's metrics (report, figures, study-report) ----------------------------------------------
METRIC_NAMES = st.sampled_from(
    ["val/acc", "val/acc_hard", "val/pass@4", "acc/train", "answers/label_flip_rate",
     "answers/batch_mode", "loss/pg", "kl/answer", "nope/x"]
)  # fmt: skip


def _load_metrics(text: str) -> None:
    from omgrpo.analysis.load import load_runs

    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "r"
        run.mkdir()
        (run / "config.yaml").write_text("run: {name: r}\n")
        (run / "metrics.jsonl").write_text(text, encoding="utf-8", errors="surrogatepass")
        with contextlib.suppress(InputError):
            load_runs(run)


@settings(max_examples=60)
@given(
    st.lists(st.dictionaries(METRIC_NAMES, VALUES, max_size=4), min_size=1, max_size=3).map(
        lambda rows: "".join(
            json.dumps({"train/step": i, **r}, allow_nan=True) + "\n" for i, r in enumerate(rows)
        )
    )
)
def test_logged_metrics_load_or_are_refused_by_name(text):
    _load_metrics(text)


def test_the_strategies_reach_the_files_that_load():
    """The valid starting points load: the tests above exercise refusals and successes."""
    _load_suite_text(GOOD_SUITE)
    _plan(json.dumps(GOOD_MODEL))
    assert not math.isnan(len(_committed_prereg()))
    _read_prereg(_committed_prereg())
    from omgrpo.backends.native.checkpoint import verify_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "state.pt").write_bytes(b"")
        (Path(folder) / "manifest.json").write_text(GOOD_MANIFEST)
        verify_checkpoint(folder)  # the good manifest passes


@pytest.mark.parametrize("key", ["predictions", "event_predictions"])
def test_predictions_that_are_not_a_list_are_refused_by_name(key):
    block = {"predictions": [], "final_steps": 10, "start_step": 0, "events": {"censor_at": 5}}
    block[key] = 5
    with pytest.raises(InputError, match=key):
        from omgrpo.analysis.study import read_preregistration

        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "PREREGISTRATION.md"
            path.write_text("```yaml\n" + yaml.safe_dump(block) + "```\n")
            read_preregistration(path)
