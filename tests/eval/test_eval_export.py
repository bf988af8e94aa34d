"""`omgrpo eval` on exported directories, a run's own suite by default, and the vLLM path's
loading order (against a stand-in `vllm` module: vLLM itself needs a GPU)."""

from __future__ import annotations

import json
import sys
import types
import weakref
from pathlib import Path

import pandas as pd
import pytest
from toy_runs import train_tiny_run  # tests/ is on sys.path (pytest's rootdir conftest)

from omgrpo.cli import main


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, base_cache):
    return train_tiny_run(tmp_path_factory.mktemp("eval-export-runs"), base_cache)


@pytest.fixture(scope="module")
def exported(toy_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "step3"
    assert main(["export", str(toy_run), str(out)]) == 0
    return out


@pytest.mark.slow
def test_a_toy_run_is_evaluated_on_the_toy_suite_and_its_export_samples_the_same(
    toy_run, exported, tmp_path
):
    # no --suite: the run's own (today's default would have asked for AIME files)
    assert main(["eval", str(toy_run), "--no-track", "--threads", "1"]) == 0
    summary = json.loads((toy_run / "eval" / "toy" / "summary.json").read_text())
    assert summary["suite"] == "toy" and list(summary["benchmarks"]) == ["toy_test"]

    out = tmp_path / "eval-export"
    assert main(["eval", str(exported), "--out", str(out), "--threads", "1"]) == 0
    from_export = json.loads((out / "summary.json").read_text())
    assert from_export["suite"] == "toy"  # the export's metadata names the run's task
    assert from_export["checkpoint"]["name"] == "model"
    assert from_export["run"]["exported_from"]["step"] == 3
    # the same weights, tokenizer, test problems and sampling seed: the same samples
    ours = pd.read_parquet(toy_run / "eval" / "toy" / "toy_test.parquet")
    theirs = pd.read_parquet(out / "toy_test.parquet")
    assert len(ours) == 8 * 8
    pd.testing.assert_frame_equal(ours, theirs)


class _Loads:
    """Every `AutoModelForCausalLM.from_pretrained` (the native loader `load_model` and the
    exporter go through it), with a weak reference to the model it returned."""

    def __init__(self, monkeypatch, events: list):
        from transformers import AutoModelForCausalLM

        self.refs: list[weakref.ref] = []
        real = AutoModelForCausalLM.from_pretrained

        def recording(*args, **kwargs):
            model = real(*args, **kwargs)
            events.append(("load", str(args[0])))
            self.refs.append(weakref.ref(model))
            return model

        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A `vllm` module whose LLM records, when it is built, its kwargs, the directory's files
    and how many torch models loaded in this process are still alive."""
    events: list = []
    loads = _Loads(monkeypatch, events)

    class LLM:
        def __init__(self, model, dtype, **kwargs):
            files = sorted(p.name for p in Path(model).iterdir()) if Path(model).is_dir() else []
            meta = Path(model) / "omgrpo_export.json"
            events.append(
                (
                    "LLM",
                    {
                        "model": model,
                        "kwargs": kwargs,
                        "files": files,
                        "alive": loads.alive(),
                        "meta": json.loads(meta.read_text()) if meta.exists() else None,
                    },
                )
            )

        def generate(self, prompts, params, use_tqdm):
            out = types.SimpleNamespace
            texts = [out(text="so \\boxed{3}") for _ in range(params.n)]
            return [out(outputs=texts) for _ in prompts]

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = LLM, lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    return events


@pytest.mark.slow
def test_vllm_is_built_from_an_exported_directory_without_loading_it_first(
    exported, fake_vllm, tmp_path
):
    args = ["eval", str(exported), "--backend", "vllm", "--out", str(tmp_path / "e")]
    flags = ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5"]
    assert main([*args, *flags]) == 0
    # vLLM came first and nothing loaded a torch copy of the weights at all
    assert [kind for kind, _ in fake_vllm] == ["LLM"]
    built = fake_vllm[0][1]
    assert built["model"] == str(exported)
    assert built["kwargs"] == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5}
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert summary["benchmarks"]["toy_test"]["backend"] == "vllm"


@pytest.mark.slow
def test_vllm_on_a_run_checkpoint_exports_it_and_frees_the_torch_copy_first(
    toy_run, fake_vllm, tmp_path
):
    out = tmp_path / "e"
    args = ["eval", str(toy_run), "--backend", "vllm", "--checkpoint", "step_2", "--out", str(out)]
    assert main([*args, "--no-track"]) == 0
    kinds = [kind for kind, _ in fake_vllm]
    assert kinds[-1] == "LLM" and kinds.count("LLM") == 1
    built = fake_vllm[-1][1]
    assert built["alive"] == 0  # the exporter's CPU copy was gone when vLLM was built
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(built["files"])
    assert built["meta"]["step"] == 2 and built["kwargs"] == {}  # vLLM's own defaults
    assert not Path(built["model"]).exists()  # the temporary export is removed afterwards
    assert sorted(p.name for p in out.iterdir()) == [
        "summary.json",
        "toy_test.json",
        "toy_test.parquet",
    ]

    # the base needs no export and no load either
    fake_vllm.clear()
    base_args = ["eval", str(toy_run), "--backend", "vllm", "--checkpoint", "base"]
    assert main([*base_args, "--out", str(tmp_path / "b"), "--no-track"]) == 0
    assert [kind for kind, _ in fake_vllm] == ["LLM"]


def test_vllm_flags_need_the_vllm_backend(tmp_path, capsys):
    args = ["eval", str(tmp_path), "--tensor-parallel-size", "2", "--out", str(tmp_path / "x")]
    assert main(args) == 2
    assert "need --backend vllm" in capsys.readouterr().err


def test_a_runs_own_suite():
    from omgrpo.eval.suite import default_suite_name

    assert default_suite_name({"task": {"name": "toy"}}) == "toy"
    assert default_suite_name({"task": {"name": "files", "test_path": "x.jsonl"}}) == "paper"
    assert default_suite_name(None) == "paper"  # a model directory omgrpo did not export


@pytest.mark.slow
def test_an_exports_files_carry_checksums_that_eval_verifies(exported, tmp_path, capsys):
    """omgrpo_export.json lists the sha256 of every file of the export; `omgrpo eval` checks
    them before anything loads and refuses a flipped byte, naming the file (before: evaluated
    without complaint)."""
    from omgrpo.backends.native.checkpoint import file_sha256

    meta = json.loads((exported / "omgrpo_export.json").read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(meta["sha256"])
    for name, digest in meta["sha256"].items():
        assert file_sha256(exported / name) == digest
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temporary

    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(exported, damaged)
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["eval", str(damaged), "--out", str(tmp_path / "e"), "--no-track"]) == 2
    err = capsys.readouterr().err
    assert f"{weights}: sha256 does not match" in err and "Traceback" not in err
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_eval_outputs_are_whole_and_a_damaged_table_is_evaluated_again(toy_run, tmp_path, capsys):
    """Every file of an evaluation is written to a temporary of its own and renamed (a kill
    leaves the earlier file or none, never half); an entry records its table's sha256, so a
    table damaged later is evaluated again instead of "done before, kept"."""
    out = tmp_path / "e"
    args = ["eval", str(toy_run), "--out", str(out), "--no-track", "--threads", "1"]
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "summary.json",
        "toy_test.json",
        "toy_test.parquet",
    ]  # no temporary left beside them
    entry = json.loads((out / "toy_test.json").read_text())
    from omgrpo.backends.native.checkpoint import file_sha256

    assert entry["table_sha256"] == file_sha256(out / "toy_test.parquet")
    first = pd.read_parquet(out / "toy_test.parquet")
    capsys.readouterr()
    assert main(args) == 0
    assert "done before, kept" in capsys.readouterr().out
    (out / "toy_test.parquet").write_bytes(b"PAR1" + b"\x00" * 16)  # damaged after the fact
    assert main(args) == 0
    assert "does not match its entry" in capsys.readouterr().out
    pd.testing.assert_frame_equal(pd.read_parquet(out / "toy_test.parquet"), first)
