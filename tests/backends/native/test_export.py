"""`omgrpo export`: a 3-step toy run's checkpoint as a Hugging Face directory that
`transformers` loads with the trainer's own log-probs, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from toy_runs import train_tiny_run  # tests/ is on sys.path (pytest's rootdir conftest)

from omgrpo.cli import main


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, base_cache):
    return train_tiny_run(tmp_path_factory.mktemp("export-runs"), base_cache)


def _trainer_policy(run, step):
    """The policy as the trainer holds it at `step`: its base loaded the trainer's way, then
    the checkpoint's weights (what `run.resume=true` does)."""
    from omegaconf import OmegaConf

    from omgrpo.backends.native.export import run_base_dir
    from omgrpo.models.loading import load_model, load_tokenizer, resolve_dtype
    from omgrpo.tracking.store import RunStore

    cfg = OmegaConf.create(RunStore(run).read_config())
    base = run_base_dir(RunStore(run).read_config())
    model = load_model(
        base, torch.device("cpu"), resolve_dtype(cfg.model.dtype, torch.device("cpu"))
    )
    state = torch.load(RunStore(run).checkpoint_dir(step) / "state.pt", weights_only=False)
    model.load_state_dict(state["model"])
    return model.eval(), load_tokenizer(base), base


@pytest.mark.slow
def test_export_round_trip_gives_the_trainers_log_probs(toy_run, tmp_path):
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omgrpo.generation.rollout import response_logprobs, sample, stop_token_ids
    from omgrpo.models.loading import load_tokenizer
    from omgrpo.tasks import PromptEncoder
    from omgrpo.tasks.registry import TASKS
    from omgrpo.tracking.store import RunStore

    out = tmp_path / "hf"
    assert main(["export", str(toy_run), str(out)]) == 0
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= files
    assert {"tokenizer.json", "omgrpo_export.json"} <= files
    meta = json.loads((out / "omgrpo_export.json").read_text())
    assert (meta["run"], meta["checkpoint"], meta["step"]) == (toy_run.name, "last", 3)
    assert len(meta["config_sha256"]) == 64 and meta["dtype"] == "float32"

    policy, tokenizer, _ = _trainer_policy(toy_run, 3)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok.get_vocab() == tokenizer.get_vocab()
    assert hf_tok.chat_template == tokenizer.chat_template
    # the tokenizer omgrpo loads from the export encodes prompts as the trainer's did
    cfg = OmegaConf.create(RunStore(toy_run).read_config())
    problems = TASKS["toy"](cfg.task).test[:3]
    prompts = [PromptEncoder(tokenizer, 512)(p) for p in problems]
    assert prompts == [PromptEncoder(load_tokenizer(str(out)), 512)(p) for p in problems]

    torch.manual_seed(0)
    seqs = sample(
        policy,
        prompts,
        n=2,
        max_new_tokens=16,
        temperature=1.0,
        top_p=1.0,
        eos_id=stop_token_ids(tokenizer, policy),
        pad_id=tokenizer.pad_token_id,
    )
    ours = response_logprobs(policy, seqs)["logprobs"]
    theirs = response_logprobs(hf, seqs)["logprobs"]
    # the same fp32 weights and the same code on the same CPU: bit-identical, not just close
    assert torch.equal(ours, theirs)
    assert seqs.response_mask.sum() > 0 and ours[seqs.response_mask.bool()].abs().sum() > 0
    # and they are step 3's weights, not the base's: the run's Self-Certainty reward has spread
    # in every group (tests/toy_runs.py), so each step moved every weight the loss reaches
    base_model = AutoModelForCausalLM.from_pretrained(meta["base_model"]).eval()
    trained, base = policy.state_dict(), base_model.state_dict()
    assert any(not torch.equal(trained[k], base[k]) for k in trained if k in base)
    assert not torch.equal(response_logprobs(base_model, seqs)["logprobs"], ours)


@pytest.mark.slow
def test_export_refuses_a_used_folder_a_missing_step_and_a_damaged_checkpoint(
    toy_run, tmp_path, capsys
):
    from omgrpo.tracking.store import RunStore

    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("x")
    assert main(["export", str(toy_run), str(used)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in used.iterdir()) == ["notes.txt"]

    assert main(["export", str(toy_run), "--checkpoint", "step_1", str(tmp_path / "a")]) == 2
    assert "available: step_2, step_3" in capsys.readouterr().err

    # step 2 exported by name; its metadata says so
    assert main(["export", str(toy_run), "--checkpoint", "step_2", str(tmp_path / "s2")]) == 0
    assert json.loads((tmp_path / "s2" / "omgrpo_export.json").read_text())["step"] == 2

    state = RunStore(toy_run).checkpoint_dir(2) / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    assert main(["export", str(toy_run), "--checkpoint", "step_2", str(tmp_path / "b")]) == 2
    assert "sha256 does not match" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / ".b.tmp").exists()
