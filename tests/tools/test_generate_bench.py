"""`omgrpo bench generate`'s instruments: the kernel-op and host-read counters on hand-counted
programs, the bandwidth limit by hand, and one tiny end-to-end run against a baseline tree."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from omgrpo.tools.generate_bench import HostReads, bandwidth_limit, count_kernel_ops


def _ops(fn) -> int:
    with profile() as prof:
        fn()
    return count_kernel_ops(prof.events())


def test_kernel_ops_count_work_not_views_and_fused_norms_once():
    x, w, ones = torch.randn(4, 8), torch.randn(8, 8), torch.ones(8)
    assert _ops(lambda: x.view(2, 16).t().reshape(16, 2)) == 0  # views only
    assert _ops(lambda: x @ w) == 1
    assert _ops(lambda: (x @ w).transpose(0, 1).contiguous()) == 2  # the product and a copy
    assert _ops(lambda: torch.softmax(x, -1) + 1) == 2
    # composite on the CPU (pow, mean, rsqrt, ...), one kernel on CUDA
    assert _ops(lambda: F.rms_norm(x, (8,), ones, 1e-6)) == 1


def test_host_reads_count_each_value_read_and_restore_the_methods():
    t = torch.tensor([1.0, 2.0])
    real_bool = torch.Tensor.__bool__
    with HostReads() as reads:
        bool(t[0])
        t.tolist()
        float(t.sum())
        t + 1  # no read
    assert reads.count == 3
    assert torch.Tensor.__bool__ is real_bool


def test_bandwidth_limit_by_hand():
    config = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  hidden_size=64, head_dim=16)  # fmt: skip
    spec = dict(prompts=2, n=3, prompt_len=10, gen_tokens=5)
    limit = bandwidth_limit(config, params=1000, dtype_bytes=2, spec=spec, bandwidth=1e6)
    kv_per_token = 2 * 2 * 2 * 16 * 2  # layers x (K, V) x kv heads x head dim x bytes = 256
    # prompts once each (2 x 10 tokens), 6 rows at the mean response length (5 + 1) / 2 = 3
    assert limit["kv_bytes_per_step"] == kv_per_token * (2 * 10 + 6 * 3)
    seconds = (2000 + kv_per_token * 38) / 1e6
    assert limit["ms_per_decode_step"] == pytest.approx(1000 * seconds)
    assert limit["rollout_tokens_per_s"] == pytest.approx(6 / seconds)


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_generate_measures_this_tree_against_another(tmp_path):
    """A tiny run of the CLI, this tree against itself as the baseline: both sides measured in
    fresh processes, the limit and the compile check reported."""
    config = tmp_path / "tiny"
    config.mkdir()
    config.joinpath("config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
        "head_dim": 16, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    }))  # fmt: skip
    out = tmp_path / "out.json"
    tree = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    subprocess.run(
        [sys.executable, "-m", "omgrpo", "bench", "generate", "--json", "--configs", str(config),
         "--shrink", "1", "--prompts", "1", "--rollouts", "2", "--prompt-len", "5",
         "--gen-tokens", "6", "--rounds", "1", "--compare", tree, "--out", str(out)],
        check=True, stdout=subprocess.DEVNULL, cwd=tree,
    )  # fmt: skip
    result = json.loads(out.read_text())["configs"]["tiny"]
    for side in ("new", "old"):
        assert result[side]["tokens"] == 2 * 6  # every row decodes to full length
        assert result[side]["ops_per_step"] > 0
        assert result[side]["host_reads_per_step"] <= 1  # the CPU reads after every token
    assert result["speedup"] > 0 and result["limit"]["ms_per_decode_step"] > 0
    assert result["compile"]["fullgraph"] and result["compile"]["graph_breaks"] == 0


def test_a_compare_ref_that_is_neither_a_directory_nor_a_commit_is_named():
    """Refused before anything is measured, naming the flag and the ref (was a traceback)."""
    out = subprocess.run(
        [sys.executable, "-m", "omgrpo", "bench", "generate", "--compare", "no-such-ref-xyz"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "--compare" in out.stderr and "no-such-ref-xyz" in out.stderr
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr
