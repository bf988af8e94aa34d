"""scripts/lora_step_check.py (one LoRA update of Qwen2.5-7B's shape, the planner's peak beside
the measured one; run on a GPU by hand) runs on the CPU with the widths / 16 and reports
what a GPU run will: the figures are a check, not asserted against a target here (short
sequences on the CPU leave transients the size of the process's own overhead)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lora_step_check.py"


def test_the_script_imports_without_a_gpu():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lora_step_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse([])
    assert (args.device, args.shrink, args.prompt_len, args.response_len) == ("cuda", 1, 512, 1024)
    assert args.config.name == "qwen2.5-7b" and (args.config / "config.json").is_file()


@pytest.mark.slow
def test_a_shrunk_lora_step_on_the_cpu():
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--shrink", "16"]
    command += ["--rows", "2", "--micro", "1", "--prompt-len", "16", "--response-len", "32"]
    command += ["--rank", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["check"] == "lora_step" and result["dtype"] == "float32"
    # Qwen2.5-7B / 16: h 224, I 1184, K/V 4 x 8; rank 8 on q, k, v, o, gate, up, down, 28 layers
    per_layer = 8 * (2 * (224 + 224) + 2 * (224 + 32) + 3 * (224 + 1184))
    assert result["lora"]["adapter_parameters"] == 28 * per_layer == 1_261_568
    assert set(result["stages"]) == {"scoring", "update"}
    for stage in result["stages"].values():
        assert stage["planned_peak_gib"] > 0 and stage["measured_peak_gib"] > 0
        assert stage["peak_ratio"] == pytest.approx(
            stage["measured_peak_gib"] / stage["planned_peak_gib"], rel=1e-2
        )
    # one real update through the trainer's code: the adapters moved, the base did not
    assert not result["skipped"] and result["grad_norm"] > 0
    assert result["adapters_moved"] and result["base_unchanged"]
    assert result["versions"]["peft"] and result["gradient_checkpointing"]
