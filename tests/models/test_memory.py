"""The memory plan (`omgrpo plan`, `omgrpo.models.memory`) on the shipped config.json fixtures
of the paper's backbones (no weights): parameter counts, the K/V closed form, the verdicts
and knobs, and the refusal `omgrpo train` gives before loading weights."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omgrpo import cli
from omgrpo.backends.native import run as native_run
from omgrpo.backends.native.update import single_update
from omgrpo.config import compose
from omgrpo.models.memory import (
    GIB,
    MemoryPlanError,
    check_memory_plan,
    kv_cache_bytes,
    model_shape,
    plan_memory,
    sizes_from_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
QWEN3 = CONFIGS / "qwen3-1.7b-base"
# paper preset -> the fixture of its backbone
PRESETS = {
    "paper": QWEN3,
    "paper_ttt": QWEN3,
    "paper_qwen3_1p7b": QWEN3,
    "paper_llama3p2_3b": CONFIGS / "llama-3.2-3b-instruct",
    "paper_qwen2p5_7b": CONFIGS / "qwen2.5-7b",
}
SMALL = ["trainer.prompts_per_step=4", "rollout.max_new_tokens=512"]


@pytest.mark.parametrize(
    "name, params, shape",
    [
        # (layers, hidden, heads, K/V heads, head dim, intermediate, vocab): notes/real-scale.md
        ("qwen3-1.7b-base", 1_720_574_976, (28, 2048, 16, 8, 128, 6144, 151936)),
        ("llama-3.2-3b-instruct", 3_212_749_824, (28, 3072, 24, 8, 128, 8192, 128256)),
        ("qwen2.5-7b", 7_615_616_512, (28, 3584, 28, 4, 128, 18944, 152064)),
    ],
)
def test_fixtures_build_on_the_meta_device_with_the_published_sizes(name, params, shape):
    s = model_shape(str(CONFIGS / name))
    assert s.params == params  # tied embeddings counted once
    got = (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab)
    assert got == shape
    assert s.lean  # all three decode on the engine's Llama-family path


def test_kv_cache_matches_the_closed_form_for_qwen3():
    shape = model_shape(str(QWEN3))
    per_token = 28 * 2 * 8 * 128 * 2  # layers x K and V x kv heads x head dim x bf16 bytes
    assert per_token == 114_688
    assert kv_cache_bytes(shape, 2, 3072) == 114_688 * 3072
    plan = plan_memory(compose(["experiment=paper", f"model.path={QWEN3}"]), str(QWEN3), 80 * GIB)
    # the lean decoder: each of the 128 prompts once (512 tokens), 3072 new tokens per row
    tokens = 128 * 512 + 1024 * 3072
    assert plan.components["kv_cache_generation"] == 114_688 * tokens
    assert round(plan.components["kv_cache_generation"] / 1e9) == 368  # the issue's ~360 GB


def _plan_cli(capsys, *args: str) -> tuple[int, dict]:
    code = cli.main(["plan", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_paper_presets_generation_fits_in_chunks(capsys):
    """All 1024 rows at once would need 343 GiB of K/V; in chunks sized to what the resident
    state leaves, generation, CAR and validation fit. On 80 GiB the whole preset fits (its
    update micro-batch of 4 rows); on 24 GiB what is refused is the update."""
    chunks = []
    for device_gb in ("80", "24"):
        code, plan = _plan_cli(
            capsys, "experiment=paper", f"model.path={QWEN3}", "--device-gb", device_gb
        )
        assert (code == 0) == plan["fits"] == (device_gb == "80")
        stages = {st["name"]: st for st in plan["stages"]}
        for name in ("generation", "car", "validation"):
            assert stages[name]["fits"] and stages[name]["peak_gib"] <= plan["usable_gib"]
            assert plan["chunk_rows"][name] == stages[name]["rows"]
        assert plan["generation_chunks_supported"] is True
        chunk = plan["generation_chunk_rows"]
        assert chunk == stages["generation"]["rows"] and 0 < chunk < 1024
        assert chunk % 8 == 0  # whole prompts with their rollout.n rows
        assert stages["update"]["rows"] == 4
        if device_gb == "24":
            assert not stages["update"]["fits"] and "update needs" in plan["refusal"]
            assert "generation needs" not in plan["refusal"]
        chunks.append(chunk)
    assert chunks[0] > chunks[1]  # 56 GiB left for generation on 80 GiB, 5.6 GiB on 24


def test_the_paper_presets_update_of_8_rows_is_refused_on_80_gib_with_the_knob(capsys):
    code, plan = _plan_cli(
        capsys, "experiment=paper", f"model.path={QWEN3}", "algorithm.micro_batch_size=8",
        "--device-gb", "80",
    )  # fmt: skip
    assert code == 1 and "update needs 77.9 GiB" in plan["refusal"]
    assert "algorithm.micro_batch_size=7" in plan["refusal"]


def test_a_row_too_long_for_the_device_is_refused_naming_the_response_length(capsys):
    code, plan = _plan_cli(
        capsys,
        "experiment=paper",
        f"model.path={QWEN3}",
        *SMALL[:1],
        "rollout.max_new_tokens=600000",  # one row's K/V alone: 64 GiB
        "--device-gb",
        "80",
    )
    generation = next(st for st in plan["stages"] if st["name"] == "generation")
    assert code == 1 and not generation["fits"] and generation["rows"] == 1
    assert generation["knobs"][0].startswith("rollout.max_new_tokens=")


def test_an_explicit_max_batch_tokens_sets_the_chunk(capsys):
    code, plan = _plan_cli(
        capsys,
        "experiment=paper",
        f"model.path={QWEN3}",
        *SMALL,
        "rollout.max_batch_tokens=20000",
        "--device-gb",
        "80",
    )
    # 4 prompts x 8 rows: a chunk of k prompts holds 512 k + 8 x 512 k = 4608 k K/V tokens
    assert plan["generation_chunk_rows"] == 4 * 8 and code == 0
    code, plan = _plan_cli(
        capsys,
        "experiment=paper",
        f"model.path={QWEN3}",
        *SMALL,
        "rollout.max_batch_tokens=10000",
        "--device-gb",
        "80",
    )
    assert plan["generation_chunk_rows"] == 2 * 8  # 9216 <= 10000 < 13824


def test_a_small_paper_config_fits_on_80_gib(capsys):
    code, plan = _plan_cli(
        capsys, "experiment=paper", f"model.path={QWEN3}", *SMALL, "--device-gb", "80"
    )
    assert code == 0 and plan["fits"] is True and plan["refusal"] is None
    names = [st["name"] for st in plan["stages"]]
    assert names == ["generation", "car", "scoring", "update", "optimizer_step", "validation"]
    assert all(st["fits"] and st["peak_gib"] <= plan["usable_gib"] for st in plan["stages"])
    generation = plan["stages"][0]
    assert generation["rows"] == 32 and plan["generation_chunk_rows"] == 32
    resident = sum(v["bytes"] for v in plan["resident"].values())
    assert resident == 5 * 1_720_574_976 * 2  # weights, reference, gradients, 2 AdamW moments
    assert all(st["peak"] == resident + st["transient"] for st in plan["stages"])


@pytest.mark.parametrize("knob_at", [0, 1])
@pytest.mark.slow
def test_the_knob_a_refusal_names_makes_the_stage_fit(capsys, knob_at):
    # without checkpointing (the paper preset's checkpointed update fits 48 GiB at this size)
    small = [
        "experiment=paper",
        f"model.path={QWEN3}",
        *SMALL,
        "algorithm.micro_batch_size=8",
        "model.gradient_checkpointing=false",
    ]
    code, plan = _plan_cli(capsys, *small, "--device-gb", "48")
    update = next(st for st in plan["stages"] if st["name"] == "update")
    assert code == 1 and not update["fits"]
    assert update["knobs"][0].startswith("algorithm.micro_batch_size=")
    # the update of a Qwen3 checkpoints (HF's checkpointed forward): checkpointing is a knob
    assert update["knobs"][1] == "model.gradient_checkpointing=true"
    code, plan = _plan_cli(capsys, *small, update["knobs"][knob_at], "--device-gb", "48")
    assert next(st for st in plan["stages"] if st["name"] == "update")["fits"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_paper_preset_gets_a_plan(capsys, preset):
    code, plan = _plan_cli(
        capsys, f"experiment={preset}", f"model.path={PRESETS[preset]}", "--device-gb", "80"
    )
    assert code in (0, 1) and (code == 0) == plan["fits"]
    assert {"generation", "update", "validation"} <= {st["name"] for st in plan["stages"]}
    assert plan["model"]["params"] > 1e9


def test_plan_exit_code_2_without_model_path_or_device_size(capsys, monkeypatch):
    assert cli.main(["plan", "--device-gb", "80"]) == 2
    assert "set model.path" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["plan", "experiment=paper", f"model.path={QWEN3}"]) == 2
    assert "--device-gb" in capsys.readouterr().err


def test_plan_prints_a_table_with_a_verdict(capsys):
    code = cli.main(
        ["plan", "experiment=paper", f"model.path={QWEN3}", *SMALL, "--device-gb", "80"]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.rstrip().endswith("verdict: fits")
    assert "114,688 bytes per token per row" in out and "in chunks of 32 rows" in out


@pytest.mark.slow
def test_old_pass_follows_the_trainers_rule():
    for overrides in ([], ["experiment=paper"], ["algorithm.mini_batch_size=8"]):
        cfg = compose(overrides)
        rows = cfg.trainer.prompts_per_step * cfg.rollout.n
        assert sizes_from_config(cfg, "cpu").old_pass == (not single_update(cfg.algorithm, rows))
    # the top-entropy mask's pass runs with a single update too (trainer.old_pass)
    cfg = compose(["algorithm.top_entropy_quantile=0.2"])
    assert single_update(cfg.algorithm, cfg.trainer.prompts_per_step * cfg.rollout.n)
    assert sizes_from_config(cfg, "cpu").old_pass


def _fake_cuda(monkeypatch, gib: int) -> None:
    props = SimpleNamespace(total_memory=gib * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


def test_train_refuses_on_cuda_before_loading_weights(tmp_path, monkeypatch):
    """A model directory with config.json and placeholder weight / tokenizer files: setup must
    refuse from the plan before it reads either."""
    model = tmp_path / "qwen3"
    model.mkdir()
    (model / "config.json").write_text((QWEN3 / "config.json").read_text())
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    _fake_cuda(monkeypatch, 80)
    monkeypatch.setattr(native_run, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(native_run, "load_tokenizer", pytest.fail)
    cfg = compose(
        [
            "experiment=paper",
            f"model.path={model}",
            f"task.train_path={data}",
            f"task.val_path={data}",
            f"run.root={tmp_path / 'runs'}",
            "algorithm.micro_batch_size=8",  # the preset's 4 fits 80 GiB
        ]
    )
    with pytest.raises(MemoryPlanError, match=r"update needs .*algorithm\.micro_batch_size="):
        native_run.setup(cfg)


def test_cpu_only_logs_the_plan_in_one_line(capsys):
    cfg = compose(["experiment=paper", f"model.path={QWEN3}", *SMALL])
    plan = check_memory_plan(cfg, str(QWEN3), torch.device("cpu"))
    out = capsys.readouterr().out
    assert plan is not None and plan.sizes.dtype == "float32"  # auto: fp32 on the CPU
    assert out.count("\n") == 1 and out.startswith("memory plan (cpu, float32): peak ")


def test_a_config_the_planner_cannot_read_is_not_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    cfg = compose(["experiment=paper", f"model.path={tmp_path}"])
    assert check_memory_plan(cfg, str(tmp_path), torch.device("cpu")) is None
    assert capsys.readouterr().out.startswith("memory plan: none (")


def test_lean_scorer_with_gradient_checkpointing_in_train_mode():
    """Found while planning: HF's checkpointed layers drop the prefill cache in train mode, so
    the lean scorer failed (IndexError) at every update of a Llama / Qwen2 / Qwen3 model with
    model.gradient_checkpointing=true (experiment=paper). The update now runs HF's checkpointed
    forward (`rollout.hf_checkpointing`), as `LEAN_SCORER_CHECKPOINTS` records."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from omgrpo.generation.rollout import Sequences, response_logits
    from omgrpo.models.memory import LEAN_SCORER_CHECKPOINTS

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config)
    ones = torch.ones(2, 4, dtype=torch.long)
    seqs = Sequences(torch.randint(1, 64, (2, 4)), ones, torch.randint(1, 64, (2, 4)), ones)
    lean = response_logits(model.eval(), seqs).detach()
    model.gradient_checkpointing_enable()
    model.train()
    logits = response_logits(model, seqs)
    logits.sum().backward()
    torch.testing.assert_close(logits.detach(), lean, atol=1e-5, rtol=1e-5)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert LEAN_SCORER_CHECKPOINTS


def test_resident_state_that_does_not_fit_is_named_first(capsys):
    """Qwen2.5-7B with a reference model: weights, reference, gradients and AdamW state alone
    pass 72 GiB, so the refusal leads with the optimizer step and the reference knob."""
    code, plan = _plan_cli(
        capsys,
        "experiment=paper",
        f"model.path={PRESETS['paper_qwen2p5_7b']}",
        *SMALL,
        "--device-gb",
        "80",
    )
    assert code == 1
    assert plan["refusal"].split(": ", 1)[1].startswith("optimizer_step needs")
    assert "algorithm.kl_coef=0" in plan["refusal"] and "chunks of at most" not in plan["refusal"]
