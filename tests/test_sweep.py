"""Sweep files (`sweeps/*.yaml`) and the local runner `omgrpo sweep` (omgrpo.sweep)."""

import json
from pathlib import Path

import pytest
import yaml

from omgrpo.sweep import SweepError, expand_grid, load_sweep, main, plan_runs

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"
# counted by hand: methods x seeds (x scales)
EXPECTED_RUNS = {
    "main_table": 6 * 3,  # gt, mv, self_certainty, entropy, coreward, om_grpo
    "ablations": 5 * 3,  # om_grpo, w/o soft, w/o CAR, w/o OMU, w/o CAR and OMU
    "answer_weight": 5 * 3,  # w = 0, 0.25, 0.5, 0.75, format-only
    "car_vs_n": 4 * 3,  # om_grpo (CAR, n = 8) vs no CAR at n = 8, 16, 64
    "ttt": 2 * 3,  # mv, om_grpo on toy_ttt
    "base_strength": 2 * 2 * 3,  # toy_weak / toy_strong x mv / om_grpo
    "collapse_demo": 3 * 1,  # null, mv, om_grpo w/o CAR (v2 settings, shortcut world); seed 0
    # the pre-registered collapse study (make study): per seed; 6 secondary; 3 worlds x 4
    "collapse_study_central": 5 * 1,
    "collapse_study_secondary": 6 * 1,
    "collapse_study_worlds": 4 * 3 * 1,
    "prm": 8 * 1,  # null, mv, om_grpo w/o CAR, PRM x 4 aggregations, PRM with OMU; seed 0
    # the v2 calibration (make calibration): gt, mv_shuffled per seed and candidate
    "collapse_calibration": 2 * 1,
    # the v2 study (make study-v2): per seed; central 6 arms, secondary 7, 2 worlds x 4
    "collapse_study_v2_central": 6 * 1,
    "collapse_study_v2_secondary": 7 * 1,
    "collapse_study_v2_worlds": 2 * 4 * 1,
    # the v3 study (make study-v3): v2's central 6 arms per seed
    "collapse_study_v3_central": 6 * 1,
    # the v4 study (make study-v4): v3's central 6 arms per seed over 450 steps
    "collapse_study_v4_central": 6 * 1,
    # its secondary arms: the three generic masks per seed, on the shipped base
    "collapse_study_v4_secondary": 3 * 1,
}


def test_every_sweep_file_is_listed():
    assert {p.stem for p in SWEEPS.glob("*.yaml")} == set(EXPECTED_RUNS)
    readme = (SWEEPS / "README.md").read_text()
    for name in EXPECTED_RUNS:
        assert f"{name}.yaml" in readme


@pytest.mark.parametrize("name", sorted(EXPECTED_RUNS))
def test_sweep_file_parses_and_expands(name):
    path = SWEEPS / f"{name}.yaml"
    sweep = load_sweep(path)
    assert sweep["method"] == "grid"
    assert sweep["command"] == [
        "${env}",
        "${interpreter}",
        "-m",
        "omgrpo",
        "train",
        "${args_no_hyphens}",
    ]
    params = sweep["parameters"]
    assert "experiment" in params and "run.root" in params
    for key, spec in params.items():
        values = spec.get("values", [spec.get("value")])
        # W&B writes `f"{key}={value}"`: Python's True / None would reach Hydra as "True" /
        # the string "None", so sweep files hold strings and numbers only
        assert all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values)
        assert not isinstance(spec.get("value"), (dict, list)), key
    grid = expand_grid(sweep)
    assert len(grid) == EXPECTED_RUNS[name]
    assert len({tuple(g) for g in grid}) == len(grid)
    assert all(len(g) == len(params) for g in grid)


@pytest.fixture(scope="module")
def plans():
    """Every sweep file planned once (composing ~80 configs takes a while)."""
    return {name: plan_runs(SWEEPS / f"{name}.yaml") for name in EXPECTED_RUNS}


@pytest.mark.parametrize("name", sorted(EXPECTED_RUNS))
@pytest.mark.slow
def test_every_expanded_run_composes(name, plans):
    grid = expand_grid(load_sweep(SWEEPS / f"{name}.yaml"))
    runs = plans[name]
    assert len(runs) == len(grid) == EXPECTED_RUNS[name]
    for combo, run in zip(grid, runs):
        cfg = run.config  # composed by plan_runs with omgrpo.config.compose
        values = dict(ov.split("=", 1) for ov in combo)
        assert cfg.method == values["method"]
        assert str(cfg.seed) == values["seed"]
        assert cfg.run.name == run.name == f"{cfg.run.experiment}__{cfg.method}__s{cfg.seed}"
        assert run.overrides[: len(combo)] == combo


@pytest.mark.slow
def test_sweeps_never_share_a_run_directory(plans):
    """The paper's sweep files write under run.root=runs (one MLflow store): names must not
    collide, or a W&B agent's second run of a name would find the first one's directory. The
    demo, the pre-registered study, its v2 calibration and v2 keep their runs (and report
    input) apart in runs/collapse-demo, runs/collapse-study, runs/collapse-calibration,
    runs/collapse-study-v2, runs/collapse-study-v3 and runs/collapse-study-v4."""
    names = [str(r.root / r.name) for runs in plans.values() for r in runs]
    assert len(names) == len(set(names)) == sum(EXPECTED_RUNS.values())
    roots = {name: {str(r.root) for r in runs} for name, runs in plans.items()}
    assert roots.pop("collapse_demo") == {"runs/collapse-demo"}
    for part in ("central", "secondary", "worlds"):
        assert roots.pop(f"collapse_study_{part}") == {"runs/collapse-study"}
        assert roots.pop(f"collapse_study_v2_{part}") == {"runs/collapse-study-v2"}
    assert roots.pop("collapse_study_v3_central") == {"runs/collapse-study-v3"}
    assert roots.pop("collapse_study_v4_central") == {"runs/collapse-study-v4"}
    assert roots.pop("collapse_study_v4_secondary") == {"runs/collapse-study-v4"}
    assert roots.pop("prm") == {"runs/prm"}  # the PRM baselines (appendix) beside their own MV
    assert roots.pop("collapse_calibration") == {"runs/collapse-calibration"}
    assert set.union(*roots.values()) == {"runs"}


@pytest.mark.slow
def test_run_group_defaults_to_the_sweep_file_name(tmp_path):
    path = tmp_path / "my_study.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "method": "grid",
                "parameters": {
                    "method": {"values": ["mv", "om_grpo"]},
                    "seed": {"value": 3},
                    "run.root": {"value": str(tmp_path / "runs")},
                },
            }
        )
    )
    assert [r.name for r in plan_runs(path)] == ["my_study__mv__s3", "my_study__om_grpo__s3"]
    # an explicit run.experiment (here as an extra override) wins
    assert plan_runs(path, ["run.experiment=other"])[0].name == "other__mv__s3"
    # extra overrides replace the grid's value for the same key
    assert plan_runs(path, ["seed=5"])[1].overrides.count("seed=5") == 1
    # a grid varying `experiment` keeps each preset's run.experiment
    base = SWEEPS / "base_strength.yaml"
    assert {r.name.split("__")[0] for r in plan_runs(base)} == {"toy_weak", "toy_strong"}


def test_grid_points_that_collide_are_refused():
    with pytest.raises(SweepError, match=r"main_table\.yaml: two grid points"):
        plan_runs(SWEEPS / "main_table.yaml", ["seed=7"])  # 3 seeds -> one name


def test_expand_grid_is_a_cartesian_product_in_file_order():
    sweep = {
        "method": "grid",
        "parameters": {
            "a": {"values": [1, 2]},
            "b": {"value": "x"},
            "c": {"values": [0.5, True, None]},
        },
    }
    assert expand_grid(sweep) == [
        ["a=1", "b=x", "c=0.5"],
        ["a=1", "b=x", "c=true"],
        ["a=1", "b=x", "c=null"],
        ["a=2", "b=x", "c=0.5"],
        ["a=2", "b=x", "c=true"],
        ["a=2", "b=x", "c=null"],
    ]


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"method": "grid"}, "'parameters'"),
        ({"method": "grid", "parameters": {}}, "'parameters'"),
        ({"method": "grid", "parameters": {"seed": {"min": 0, "max": 3}}}, "parameters.seed"),
        ({"method": "grid", "parameters": {"seed": 3}}, "parameters.seed"),
        ({"method": "grid", "parameters": {"seed": {"values": []}}}, "parameters.seed.values"),
        ({"method": "grid", "parameters": {"optim": {"value": {"lr": 1}}}}, "parameters.optim"),
        ({"method": "random", "parameters": {"seed": {"value": 1}}}, "method"),
        ({"parameters": {"seed": {"value": 1}}}, "'method'"),
        (["not", "a", "mapping"], "mapping"),
    ],
)
def test_malformed_sweep_names_file_and_key(tmp_path, body, where):
    path = tmp_path / "bad_sweep.yaml"
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(SweepError) as err:
        load_sweep(path)
    assert str(path) in str(err.value)
    assert where in str(err.value)


def test_cli_reports_a_malformed_sweep(tmp_path, capsys):
    path = tmp_path / "bad_sweep.yaml"
    path.write_text("method: grid\nparameters:\n  seed: {}\n")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "bad_sweep.yaml" in err and "parameters.seed" in err


@pytest.mark.slow
def test_finished_runs_are_skipped_and_partial_ones_resumed(tmp_path):
    runs = plan_runs(SWEEPS / "ttt.yaml", [f"run.root={tmp_path}"])
    (tmp_path / runs[0].name).mkdir()
    (tmp_path / runs[0].name / "status.json").write_text(json.dumps({"state": "finished"}))
    (tmp_path / runs[1].name).mkdir()
    (tmp_path / runs[1].name / "status.json").write_text(json.dumps({"state": "running"}))
    (tmp_path / runs[2].name).mkdir()
    (tmp_path / runs[2].name / "status.json").write_text('{"state": "fini')  # half written
    again = plan_runs(SWEEPS / "ttt.yaml", [f"run.root={tmp_path}"])
    assert [r.state for r in again] == ["skip", "resume", "resume", "new", "new", "new"]
    assert "run.resume=auto" in again[1].overrides
    assert "run.resume=auto" not in again[3].overrides


def _tiny_sweep(tmp_path: Path, tiny_overrides: list[str], steps: int = 2) -> Path:
    """A 2 x 1 sweep of TINY toy runs (two methods, seed 0: two at once with `--jobs 2`, the
    most a 2-core machine runs), the TINY overrides as `value:` constants."""
    params = {"method": {"values": ["mv", "om_grpo_no_car"]}, "seed": {"values": [0]}}
    for ov in [*tiny_overrides, f"trainer.steps={steps}"]:
        key, value = ov.split("=", 1)
        params[key] = {"value": yaml.safe_load(value)}
    assert params["tracking.mlflow"] == {"value": False}
    assert params["tracking.wandb"] == {"value": False}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"method": "grid", "parameters": params}, sort_keys=False))
    return path


@pytest.mark.slow
@pytest.mark.e2e
def test_sweep_end_to_end_parallel_then_skipped(tmp_path, tiny_overrides, capsys):
    cache = tmp_path / "fresh-cache"  # no base yet: the sweep must train it once, up front
    tiny_overrides = [o for o in tiny_overrides if not o.startswith("model.cache_dir=")]
    tiny_overrides.append(f"model.cache_dir={cache}")
    path = _tiny_sweep(tmp_path, tiny_overrides)
    root = tmp_path / "runs"
    names = [f"tiny__{m}__s0" for m in ("mv", "om_grpo_no_car")]

    assert main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 runs (2 to run)" in out
    assert sum(f"] {n}: " in out for n in names) == 2

    assert main([str(path), "--jobs", "2"]) == 0
    out = capsys.readouterr()
    assert "2 done, 0 skipped, 0 failed" in out.out
    assert "preparing the shared toy base" in out.err
    assert len(list(cache.glob("toy-base-*/config.json"))) == 1
    for name in names:
        assert json.loads((root / name / "status.json").read_text())["state"] == "finished"
        log = (root / name).with_suffix(".log").read_text()
        assert "trainer.threads=" in log and "run finished" in log
        assert "warm start: training" not in log  # the runs found the base ready

    assert main([str(path), "--jobs", "2"]) == 0
    out = capsys.readouterr()
    assert "0 done, 2 skipped, 0 failed" in out.out
    assert "2 already finished or failed (skipped)" in out.err

    # a run left half-done (killed after its last checkpoint) is resumed, the others skipped
    status = root / names[0] / "status.json"
    status.write_text(json.dumps({"state": "running", "step": 2}))
    assert main([str(path)]) == 0
    out = capsys.readouterr()
    assert "1 done, 1 skipped, 0 failed" in out.out
    assert "resuming " + names[0] in out.err
    assert json.loads(status.read_text())["state"] == "finished"
    assert "run.resume=auto" in (root / f"{names[0]}.log").read_text()


@pytest.mark.slow
@pytest.mark.e2e
def test_failed_runs_do_not_stop_the_others(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    # task=files without files composes, then fails in the trainer
    path.write_text(
        yaml.safe_dump(
            {
                "method": "grid",
                "parameters": {
                    "seed": {"values": [0, 1]},
                    "task.name": {"value": "files"},
                    "tracking.mlflow": {"value": False},
                    "tracking.wandb": {"value": False},
                    "run.root": {"value": str(tmp_path / "runs")},
                },
            }
        )
    )
    assert main([str(path), "--jobs", "2"]) == 1
    out = capsys.readouterr()
    assert "0 done, 0 skipped, 2 failed" in out.out
    for seed in (0, 1):
        log = tmp_path / "runs" / f"broken__om_grpo__s{seed}.log"
        assert str(log) in out.err
        assert "task.train_path" in log.read_text()


@pytest.mark.slow
def test_the_demo_is_the_v2_studys_central_comparison():
    """`make demo` runs the v2 study's null, MV and OM-GRPO (paper's span) runs as the study
    would at seed 0: same world, base, settings and length; only the names, the seed and the
    mechanism probe (off in the demo) differ."""
    from omgrpo.backends.native.checkpoint import flatten
    from omgrpo.config import compose, to_container

    demo = expand_grid(load_sweep(SWEEPS / "collapse_demo.yaml"))
    study = expand_grid(load_sweep(SWEEPS / "collapse_study_v2_central.yaml"))
    methods = [next(o for o in g if o.startswith("method=")) for g in demo]
    assert methods == ["method=mv_shuffled", "method=mv", "method=om_grpo_no_car"]
    for overrides, method in zip(demo, methods):
        twin = next(g for g in study if method in g)  # every demo method is in the study
        a = flatten(to_container(compose(overrides)))
        b = flatten(to_container(compose(twin)))
        differ = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
        names = {"run.experiment", "run.root", "run.name"}
        assert differ == {"seed", "diagnostics.mechanism_every", *names}
        assert a["diagnostics.mechanism_every"] == 0 and a["trainer.steps"] == 150


def test_job_split_gives_each_slot_its_threads_and_gpus(monkeypatch):
    from omgrpo import sweep

    monkeypatch.setattr(sweep, "_cores", lambda: 8)
    gpus = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert sweep.job_split(0, 1, gpus) == {}  # one job: the whole machine
    assert [sweep.job_split(i, 2, gpus) for i in range(2)] == [
        {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": d,
         "OMGRPO_JOB_GPUS": "2"}
        for d in ("0,1", "2,3")
    ]  # fmt: skip
    # 3 jobs on 4 GPUs: one each (the 4th stays free); 4 jobs on 2 GPUs: shared in turn
    assert [sweep.job_split(i, 3, gpus)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == list("012")
    two = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert [sweep.job_split(i, 4, two)["CUDA_VISIBLE_DEVICES"] for i in range(4)] == list("0101")
    # no GPUs (an empty list hides them all); threads set by the user stay theirs
    assert sweep.job_split(1, 3, {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}) == {
        "MKL_NUM_THREADS": "2"
    }


@pytest.mark.slow
@pytest.mark.e2e
def test_agents_get_the_split_of_jobs(monkeypatch, capsys):
    """`omgrpo sweep --agent ID --jobs 2`: two `wandb agent ID` commands, each with its slot's
    environment; `python -m wandb agent` is a command wandb has."""
    import subprocess
    import sys

    from omgrpo import sweep

    monkeypatch.setattr(sweep, "_cores", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    assert main(["--agent", "team/omgrpo/abc123", "--jobs", "2", "--count", "3", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    command = f"{sys.executable} -m wandb agent team/omgrpo/abc123 --count 3"
    assert lines == [
        f"agent {i}: OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 CUDA_VISIBLE_DEVICES={i} "
        f"OMGRPO_JOB_GPUS=1 {command}"
        for i in range(2)
    ]
    (_, cmd), _ = sweep.agent_commands("team/omgrpo/abc123", 2)
    usage = subprocess.run([*cmd[:4], "--help"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "SWEEP_ID" in usage.stdout
    with pytest.raises(SystemExit):  # agents take their grid from the sweep server
        main(["sweeps/ttt.yaml", "--agent", "team/omgrpo/abc123"])


@pytest.mark.slow
def test_a_sweep_file_plans_verl_runs(tmp_path, capsys, monkeypatch):
    """backend=verl with a verl preset as extra overrides: every grid point composes with the
    verl backend (named by trainer.experiment_name, its run store under run.root with verl's
    checkpoints inside), gets no native trainer.threads, and a rerun resumes."""
    from omgrpo import sweep

    monkeypatch.setattr(sweep, "_cores", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "verl_pair.yaml"
    body = {"method": "grid", "parameters": {"method": {"values": ["om_grpo", "mv"]},
            "seed": {"value": 0}, "experiment": {"value": "toy"}, "run.root": {"value": "x"}}}  # fmt: skip
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    extra = ["backend=verl", "experiment=paper_qwen3_1p7b", f"run.root={tmp_path / 'ckpt'}"]
    runs = plan_runs(path, extra)
    assert [(r.name, r.backend, r.state) for r in runs] == [
        ("verl_pair__om_grpo__s0", "verl", "new"),
        ("verl_pair__mv__s0", "verl", "new"),
    ]
    assert [r.dir for r in runs] == [tmp_path / "ckpt" / r.name for r in runs]
    assert [str(r.config.trainer.default_local_dir) for r in runs] == [
        str(r.dir / "checkpoints") for r in runs
    ]
    assert main([str(path), *extra, "--jobs", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "trainer.threads" not in out and "backend=verl" in out
    assert "job slot 1: OMP_NUM_THREADS=4 MKL_NUM_THREADS=4 CUDA_VISIBLE_DEVICES=4,5,6,7" in out
    runs[0].dir.mkdir(parents=True)  # a checkpoint folder from an earlier launch
    again = plan_runs(path, extra)
    assert [r.state for r in again] == ["resume", "new"]
    assert "run.resume=auto" in again[0].overrides


@pytest.mark.slow
def test_the_v3_study_is_v2s_central_grid_with_16_validation_samples():
    """PREREGISTRATION-v3 changes one setting of v2's central grid (16 validation samples per
    problem instead of 4) and its units' seeds; the arms, world, base and training are v2's."""
    from omgrpo.backends.native.checkpoint import flatten
    from omgrpo.config import compose, to_container

    v2 = expand_grid(load_sweep(SWEEPS / "collapse_study_v2_central.yaml"))
    v3 = expand_grid(load_sweep(SWEEPS / "collapse_study_v3_central.yaml"))
    assert len(v3) == len(v2) == 6
    for new, old in zip(v3, v2, strict=True):
        a = flatten(to_container(compose(new)))
        b = flatten(to_container(compose(old)))
        differ = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
        assert differ == {"seed", "eval.k", "run.root", "run.name"}, differ
        assert (a["eval.k"], b["eval.k"], a["seed"]) == (16, 4, 7)


@pytest.mark.slow
def test_the_v4_study_is_v3s_central_grid_over_450_steps():
    """PREREGISTRATION-v4 changes the horizon of v3's central grid (450 steps, the same 8
    warm-up steps, the mechanism probe every 30 steps) and its units' seeds; the arms, world,
    base and training are v3's."""
    from omgrpo.backends.native.checkpoint import flatten
    from omgrpo.config import compose, to_container

    v3 = expand_grid(load_sweep(SWEEPS / "collapse_study_v3_central.yaml"))
    v4 = expand_grid(load_sweep(SWEEPS / "collapse_study_v4_central.yaml"))
    assert len(v4) == len(v3) == 6
    allowed = {"seed", "trainer.steps", "optim.warmup_ratio", "diagnostics.mechanism_every"}
    for new, old in zip(v4, v3, strict=True):
        a = flatten(to_container(compose(new)))
        b = flatten(to_container(compose(old)))
        differ = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
        assert differ == allowed | {"run.root", "run.name"}, differ
        assert (a["trainer.steps"], a["seed"], a["diagnostics.mechanism_every"]) == (450, 13, 30)
        # v3's warm-up steps, kept: round(0.05 * 150) == round(0.0178 * 450) == 8
        assert round(a["optim.warmup_ratio"] * 450) == round(b["optim.warmup_ratio"] * 150) == 8
