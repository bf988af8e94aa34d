"""Every sweep file under a real W&B agent: the command line that wandb's own agent code renders
for a parameter combination (`wandb_agent.Agent._command_run`, which fills `${env}`,
`${interpreter}` and `${args_no_hyphens}`; only the process it would start is replaced by a
recorder) parses with omgrpo's command line (`omgrpo train ... --cfg job`) into the config the
sweep file means: the one `omgrpo sweep` composes for that grid point, with each parameter's
value in place."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from omgrpo import cli
from omgrpo.config import compose
from omgrpo.sweep import format_value, load_sweep

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"
SWEEP_FILES = sorted(SWEEPS.glob("*.yaml"))
MISSING = object()


def _combinations(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """The first and the last grid point of a sweep, as W&B hands them to an agent."""
    keys = list(sweep["parameters"])
    axes = [s["values"] if "values" in s else [s["value"]] for s in sweep["parameters"].values()]
    grid = list(itertools.product(*axes))
    return [dict(zip(keys, grid[0], strict=True)), dict(zip(keys, grid[-1], strict=True))]


def _agent_command(
    sweep: dict[str, Any], combo: dict[str, Any], tmp_path, monkeypatch, env_out=None
):
    """The command wandb's agent starts for a run of `combo` (its process recorded, not run);
    the environment it gives the process goes into `env_out` if given."""
    from wandb import wandb_agent

    started = []

    class Recorder:
        def __init__(self, command=None, env=None, **kwargs):
            started.append(command)
            if env_out is not None:
                env_out.update(env or {})

    monkeypatch.setattr(wandb_agent, "AgentProcess", Recorder)
    # _command_run writes the run's parameters under WANDB_DIR and exports these variables
    for var, value in [("WANDB_DIR", tmp_path), ("WANDB_SWEEP_ID", "s"), ("WANDB_RUN_ID", "r")]:
        monkeypatch.setenv(var, str(value))
    monkeypatch.setenv("WANDB_SWEEP_PARAM_PATH", "")
    agent = wandb_agent.Agent.__new__(wandb_agent.Agent)  # no server: only the command
    agent._sweep_command = list(sweep["command"])
    agent._function, agent._in_jupyter, agent._forward_signals = None, False, False
    agent._run_processes = {}
    args = {key: {"value": value} for key, value in combo.items()}
    agent._command_run({"run_id": "r", "program": sweep.get("program"), "args": args})
    (command,) = started
    return command


def test_the_sweep_files_are_found():
    assert len(SWEEP_FILES) >= 10


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.stem)
@pytest.mark.slow
def test_wandb_agent_command_composes_the_intended_config(path, tmp_path, monkeypatch, capsys):
    sweep = load_sweep(path)
    for combo in _combinations(sweep):
        command = _agent_command(sweep, combo, tmp_path, monkeypatch)
        head, args = command[:5], command[5:]
        assert head[1:] == ["python", "-m", "omgrpo", "train"], command
        monkeypatch.setattr(sys, "argv", list(sys.argv))  # the launch sets it for Hydra
        assert cli.main(["train", *args, "--cfg", "job"]) in (0, None)
        parsed = yaml.safe_load(capsys.readouterr().out)

        intended = compose([f"{k}={format_value(v)}" for k, v in combo.items()])
        assert parsed == OmegaConf.to_container(intended, resolve=False), " ".join(command)
        for key, value in combo.items():  # config keys hold the value; groups pick presets
            got = OmegaConf.select(OmegaConf.create(parsed), key, default=MISSING)
            assert got is MISSING or got == value, (key, got, value)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_rerun_of_the_agent_command_continues_then_skips(tiny_overrides, tmp_path, monkeypatch):
    """A W&B agent that reruns a combination (preempted, restarted): the run that was cut off
    continues from its checkpoint with its identity, and a finished one is skipped, exit 0."""
    sweep = load_sweep(SWEEPS / "main_table.yaml")
    combo = {**_combinations(sweep)[0], "run.root": str(tmp_path / "runs")}
    for override in [*tiny_overrides, "trainer.steps=3", "trainer.save_every=1"]:
        key, value = override.split("=", 1)
        if key != "run.root":
            combo[key] = yaml.safe_load(value)
    command = _agent_command(sweep, combo, tmp_path, monkeypatch)
    run_dir = tmp_path / "runs" / compose(command[5:]).run.name
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("WANDB_SERVICE", None)

    def agent_run() -> subprocess.CompletedProcess:
        cmd = [sys.executable, *command[2:]]  # the agent's `python`, this interpreter
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)

    first = agent_run()
    assert first.returncode == 0, first.stderr[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    identity = (run_dir / "identity.json").read_text()
    assert status["state"] == "finished" and status["step"] == 3
    # cut off after step 2 (its checkpoint kept, step 3 lost): the rerun continues it
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")
    (run_dir / "status.json").write_text(json.dumps({**status, "state": "killed", "step": 2}))
    second = agent_run()
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming {run_dir} from step 2" in second.stdout
    assert (run_dir / "identity.json").read_text() == identity
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    third = agent_run()
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"skipping {run_dir}: it already finished at step 3" in third.stdout


@pytest.mark.slow
def test_an_agent_of_a_split_machine_composes_a_verl_run_on_its_gpus(tmp_path, monkeypatch, capsys):
    """`omgrpo sweep --agent ID --jobs 2` on a 4-GPU machine: agent 1's environment (the job
    split) reaches the run wandb's agent starts, and the command it renders for a sweep file's
    grid point with `backend: verl` composes (`omgrpo train ... --dry-run`, no Ray) into the
    verl config of that point: 2 GPUs per node, the checkpoint folder under the file's
    run.root, the method and seed of the point."""
    from omgrpo.backends.verl.config import compose_verl
    from omgrpo.sweep import job_split

    sweep = load_sweep(SWEEPS / "ablations.yaml")
    sweep["parameters"]["backend"] = {"value": "verl"}
    sweep["parameters"]["experiment"] = {"value": "paper_qwen3_1p7b"}
    combo = _combinations(sweep)[-1]
    split = job_split(1, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert split["CUDA_VISIBLE_DEVICES"] == "2,3" and split["OMGRPO_JOB_GPUS"] == "2"
    for var, value in split.items():  # what `omgrpo sweep --agent` gives agent 1
        monkeypatch.setenv(var, value)
    env: dict[str, str] = {}
    command = _agent_command(sweep, combo, tmp_path, monkeypatch, env_out=env)
    assert {k: env.get(k) for k in split} == split
    args = command[5:]
    assert "backend=verl" in args and command[1:5] == ["python", "-m", "omgrpo", "train"]
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert cli.main(["train", *args, "--dry-run"]) == 0
    parsed = yaml.safe_load(capsys.readouterr().out)
    rest = [a for a in args if not a.startswith(("backend=", "experiment="))]
    intended = compose_verl("paper_qwen3_1p7b", rest)
    assert parsed == OmegaConf.to_container(intended, resolve=True), " ".join(command)
    name = f"ablations__{combo['method']}__s{combo['seed']}"
    assert parsed["trainer"]["experiment_name"] == name
    assert parsed["trainer"]["n_gpus_per_node"] == 2
    assert parsed["trainer"]["default_local_dir"] == f"runs/{name}/checkpoints"
    assert parsed["omgrpo"]["method"] == combo["method"]
    assert parsed["omgrpo"]["seed"] == combo["seed"]
