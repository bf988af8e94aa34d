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
    assert config["rows_generated"] == 2 and config["update_rows"] == 1
    assert set(config["stages"]) == STAGES
    for stage in config["stages"].values():
        assert stage["planned_peak_gib"] > 0 and stage["measured_peak_gib"] > 0
        ratio = stage["measured_peak_gib"] / stage["planned_peak_gib"]
        assert abs(stage["peak_ratio"] - ratio) < 0.01
    assert config["measured_resident_gib"] > 0
    assert "car" in result["not_measured"]  # the paper preset has CAR; the benchmark skips it
    assert isinstance(result["meets_target"], bool)
    assert json.loads(out.read_text())["partial"] is True
