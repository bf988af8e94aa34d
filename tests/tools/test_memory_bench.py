"""`omgrpo bench memory`'s JSON on a tiny case (the figures are a benchmark, not asserted
against the 25 % target here: short sequences leave only noise-sized transients)."""

import json

from omgrpo.tools.memory_bench import CONFIGS, bench_memory, shrunk_config

STAGES = {"generation", "scoring", "update", "update_no_checkpointing"}


def test_shrunk_config_keeps_layers_and_heads_and_divides_the_widths():
    config = shrunk_config(CONFIGS / "qwen2.5-7b", 16)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (28, 28)
    assert (config["num_key_value_heads"], config["head_dim"]) == (4, 8)
    assert (config["hidden_size"], config["intermediate_size"]) == (224, 1184)
    assert config["vocab_size"] == 152064 // 16


def test_bench_memory_json_shape(tmp_path):
    out = tmp_path / "partial.json"
    result = bench_memory(
        configs=["qwen3-1.7b-base"],
        partial=out,
        prompts=1,
        n=2,
        prompt_len=8,
        new_tokens=8,
        gen_tokens=4,
    )
    json.dumps(result)  # JSON-serialisable
    assert result["benchmark"] == "memory" and "decodes 4 new tokens" in result["shortened"]
    config = result["configs"]["qwen3-1.7b-base"]
    assert config["shrunk_config"]["num_hidden_layers"] == 28
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
