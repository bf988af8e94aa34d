"""`omgrpo bench memory`'s JSON on a tiny case (the figures are a benchmark, not asserted
against the 25 % target here: short sequences leave only noise-sized transients)."""

import json

import pytest

from omgrpo.tools.memory_bench import CONFIGS, bench_memory, shrunk_config

STAGES = {"generation", "scoring", "update", "update_no_checkpointing"}


def test_shrunk_config_keeps_layers_and_heads_and_divides_the_widths():
    config = shrunk_config(CONFIGS / "qwen2.5-7b", 16)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (28, 28)
    assert (config["num_key_value_heads"], config["head_dim"]) == (4, 8)
    assert (config["hidden_size"], config["intermediate_size"]) == (224, 1184)
    assert config["vocab_size"] == 152064 // 16


@pytest.mark.slow
def test_bench_memory_json_shape(tmp_path):
    # Qwen3-1.7B's config with 2 layers: the JSON's shape, at a fraction of the cost
    config = json.loads((CONFIGS / "qwen3-1.7b-base" / "config.json").read_text())
    model_dir = tmp_path / "qwen3-2-layers"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    out = tmp_path / "partial.json"
    result = bench_memory(
        configs=[str(model_dir)],
        partial=out,
        prompts=1,
        n=2,
        prompt_len=8,
        new_tokens=8,
        gen_tokens=4,
    )
    json.dumps(result)  # JSON-serialisable
    assert result["benchmark"] == "memory" and "decodes 4 new tokens" in result["shortened"]
    config = result["configs"]["qwen3-2-layers"]
    assert config["shrunk_config"]["num_hidden_layers"] == 2
    assert config["rows_generated"] == 2 and config["update_micro_batch_rows"] == 1
    assert config["update_rows"] == 2  # two micro-batches: the second beside the first's grads
    assert config["generation_chunk_rows"] == 2  # a CPU's RAM holds both rows
    assert set(config["stages"]) == STAGES
    for stage in config["stages"].values():
        assert stage["planned_peak_gib"] > 0 and stage["measured_peak_gib"] > 0
        ratio = stage["measured_peak_gib"] / stage["planned_peak_gib"]
        assert abs(stage["peak_ratio"] - ratio) < 0.01
    assert config["measured_resident_gib"] > 0
    assert "car" in result["not_measured"]  # the paper preset has CAR; the benchmark skips it
    assert isinstance(result["meets_target"], bool)
    assert json.loads(out.read_text())["partial"] is True


def test_bench_memory_refuses_cuda_without_a_gpu(monkeypatch):
    import omgrpo.tools.memory_bench as memory_bench

    monkeypatch.setattr(memory_bench, "_cuda_available", lambda: False)
    from omgrpo.errors import InputError

    with pytest.raises(InputError, match="sees no CUDA device"):
        bench_memory(device="cuda")
    with pytest.raises(InputError, match=r"--device \(found 'mps'; expected cpu or cuda\)"):
        bench_memory(device="mps")


def test_bench_memory_cli_options_reach_the_benchmark():
    from omgrpo.tools.bench import _kwargs, _parser

    ns = _parser().parse_intermixed_args(
        [
            "memory",
            "--device",
            "cuda",
            "--shrink",
            "1",
            "--prompts",
            "20",
            "--rollouts",
            "8",
            "--micro",
            "4",
            "--gen-tokens",
            "64",
        ]
    )
    assert _kwargs(ns) == {
        "configs": None,
        "gen_tokens": 64,
        "device": "cuda",
        "shrink": 1,
        "prompts": 20,
        "n": 8,
        "micro": 4,
    }
    defaults = _kwargs(_parser().parse_intermixed_args(["memory"]))
    assert (defaults["device"], defaults["shrink"], defaults["prompts"]) == ("cpu", 16, 2)


def _qwen3_cuda_spec(tmp_path) -> dict:
    """A benchmark spec for Qwen3-1.7B's config on CUDA: 8 rows, 1-row micro-batches."""
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        (CONFIGS / "qwen3-1.7b-base" / "config.json").read_text()
    )
    return {
        "model_dir": str(model_dir),
        "device": "cuda",
        "prompts": 2,
        "n": 4,
        "micro": 1,
        "prompt_len": 512,
        "new_tokens": 3072,
        "gen_tokens": 1024,
    }


def test_the_gpu_plan_uses_the_gpu_dtype(tmp_path):
    # the figures compared on a GPU are the plan for bf16 (resolve_dtype's choice on CUDA)
    from omgrpo.tools.memory_bench import compare

    spec = _qwen3_cuda_spec(tmp_path)
    measured = {
        "resident": 16 * 2**30,
        "update_rows": 2,
        "stages": {s: {"transient": 2**30, "seconds": 2.0} for s in STAGES},
    }
    out = compare(spec, measured)
    assert out["dtype"] == "bfloat16" and out["rows_generated"] == 8
    assert out["generation_chunk_rows"] == 8  # not recorded: all rows at once
    assert out["stages"]["generation"]["rollout_tokens_per_s"] == 8 * 1024 / 2.0
    # a card with less free memory decodes fewer rows at once: the plan is that chunk's
    halved = compare(spec, {**measured, "generation_chunk_rows": 4})
    assert halved["generation_chunk_rows"] == 4
    whole = out["stages"]["generation"]["planned_transient_gib"]
    assert 0 < halved["stages"]["generation"]["planned_transient_gib"] < whole
    assert halved["stages"]["scoring"] == out["stages"]["scoring"]


def test_a_stage_out_of_cuda_memory_is_recorded_without_a_ratio(tmp_path):
    # e.g. the paper preset's update without checkpointing (planned 84.8 GiB) on an 80 GiB card
    from omgrpo.tools.memory_bench import compare

    spec = _qwen3_cuda_spec(tmp_path)
    stages = {s: {"transient": 2**30, "seconds": 2.0} for s in STAGES}
    stages["update_no_checkpointing"]["out_of_memory"] = True
    out = compare(spec, {"resident": 16 * 2**30, "update_rows": 2, "stages": stages})
    failed = out["stages"]["update_no_checkpointing"]
    assert failed["out_of_memory"] and failed["peak_ratio"] is None
    assert out["out_of_memory"] == ["update_no_checkpointing"]
    measured = [s["peak_ratio"] for k, s in out["stages"].items() if k != "update_no_checkpointing"]
    assert out["peak_ratio_max_dev"] == round(max(abs(r - 1) for r in measured), 3)
