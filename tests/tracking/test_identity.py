"""A run is an identity, not a path (two machines may train the same path): its UUID, kept in the
run store, decides which MLflow runs a start supersedes and which W&B run it writes; the standard
MLflow / W&B environment variables select the trackers; experiment creation survives a race. Real
backends: a SQLite MLflow store and offline W&B runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from omgrpo.tracking import (
    RUN_UUID_TAG,
    FanOutTracker,
    MLflowTracker,
    TrackingConfig,
    WandbTracker,
    mlflow_client,
    resolve_tracking_config,
    stable_run_id,
)
from omgrpo.tracking.store import RunStore, legacy_run_uuid
from omgrpo.tracking.sync import sync_run

STEPS = {1: {"loss/pg": 0.5}, 2: {"loss/pg": 0.25}, 3: {"loss/pg": 0.125}}


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    uri = "sqlite:///" + str(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    mlflow_client(uri)  # migrate once (~7 s)
    return uri


@pytest.fixture
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_SWEEP_ID", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def new_run(run_dir: Path, uri: str, experiment: str, fresh: bool = True) -> tuple[str, str]:
    """Start a run as the trainer does (a fresh identity unless `fresh=False`), log 3 steps to
    the store, MLflow and W&B; returns (MLflow run id, W&B run id)."""
    store = RunStore(run_dir)
    if fresh:
        store.new_identity()
    config = {"run": {"name": run_dir.name, "experiment": experiment}, "seed": 0}
    store.write_config(config)
    mlflow, wandb = MLflowTracker(uri, background=False), WandbTracker()
    fan = FanOutTracker([wandb, mlflow])
    fan.start(run_dir, config, name=run_dir.name, group=experiment, tags=[])
    for step, metrics in STEPS.items():
        store.log_metrics(step, metrics)
        fan.log_metrics(step, metrics)
    store.write_status(state="finished", step=3)
    fan.finish("finished")
    assert fan.active == ["wandb", "mlflow"], fan.failed
    return mlflow.run_id, wandb.run_id


def active_runs(uri: str, experiment: str) -> dict[str, dict[str, str]]:
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    return {r.info.run_id: r.data.tags for r in client.search_runs([exp.experiment_id])}


@pytest.mark.slow
def test_a_new_run_at_a_path_another_run_used_is_a_different_run(
    tmp_path, mlflow_uri, offline_wandb
):
    """Machine A trains runs/x, its directory is moved away (or a second container starts with
    an empty disk); a new run at the same absolute path supersedes nothing of A's."""
    path = tmp_path / "runs" / "x"
    a_mlflow, a_wandb = new_run(path, mlflow_uri, "same-path")
    archived = tmp_path / "archive" / "x"
    archived.parent.mkdir()
    shutil.move(path, archived)
    b_mlflow, b_wandb = new_run(path, mlflow_uri, "same-path")
    shutil.rmtree(path)  # a third machine whose disk never had the run store
    c_mlflow, c_wandb = new_run(path, mlflow_uri, "same-path")

    runs = active_runs(mlflow_uri, "same-path")
    assert set(runs) == {a_mlflow, b_mlflow, c_mlflow}
    assert all("omgrpo.superseded_by" not in tags for tags in runs.values())
    assert len({tags[RUN_UUID_TAG] for tags in runs.values()}) == 3
    assert len({a_wandb, b_wandb, c_wandb}) == 3
    assert runs[a_mlflow][RUN_UUID_TAG] == RunStore(archived).run_uuid()
    assert a_wandb == stable_run_id(RunStore(archived).run_uuid())

    # analysis keeps the three apart (same name and path, other identities)
    from omgrpo.analysis import load_runs

    df = load_runs(mlflow_experiment="same-path", mlflow_uri=mlflow_uri)
    assert df["run"].nunique() == 3 and df["run_uuid"].nunique() == 3
    assert df.groupby("run")["step"].apply(list).map(sorted).tolist() == [[1, 2, 3]] * 3


@pytest.mark.slow
def test_a_moved_or_copied_run_directory_keeps_its_identity(tmp_path, mlflow_uri, offline_wandb):
    """Syncing a moved run finds its own MLflow run (complete: nothing is added) and writes its
    own W&B run."""
    path = tmp_path / "runs" / "y"
    first_mlflow, first_wandb = new_run(path, mlflow_uri, "moved")
    moved = tmp_path / "elsewhere" / "y"
    moved.parent.mkdir()
    shutil.move(path, moved)
    client = mlflow_client(mlflow_uri)
    points = len(client.get_metric_history(first_mlflow, "loss/pg"))
    assert sync_run(moved, "mlflow", TrackingConfig(mlflow_uri=mlflow_uri)) == first_mlflow
    assert sync_run(moved, "wandb", TrackingConfig()) == first_wandb
    assert list(active_runs(mlflow_uri, "moved")) == [first_mlflow]
    assert len(client.get_metric_history(first_mlflow, "loss/pg")) == points > 0

    copy = tmp_path / "copy" / "y"
    shutil.copytree(moved, copy)
    assert RunStore(copy).run_uuid() == RunStore(moved).run_uuid()
    assert sync_run(copy, "wandb", TrackingConfig()) == first_wandb


@pytest.mark.slow
def test_an_old_run_store_without_identity_still_resumes(tmp_path, mlflow_uri, offline_wandb):
    """A store from before identities (no identity.json; its MLflow run tagged only with the
    path): it gets a UUID derived from its path, kept from then on, and a resume supersedes
    its old MLflow run and continues its W&B run (both found through trackers.json)."""
    path = tmp_path / "runs" / "old"
    old_mlflow, old_wandb = new_run(path, mlflow_uri, "legacy")
    (path / "identity.json").unlink()
    client = mlflow_client(mlflow_uri)
    client.delete_tag(old_mlflow, RUN_UUID_TAG)  # as an older omgrpo logged it

    assert RunStore(path).run_uuid() == legacy_run_uuid(path)
    new_mlflow, new_wandb = new_run(path, mlflow_uri, "legacy", fresh=False)
    assert new_wandb == old_wandb
    assert list(active_runs(mlflow_uri, "legacy")) == [new_mlflow]
    assert client.get_run(old_mlflow).data.tags["omgrpo.superseded_by"] == new_mlflow
    moved = tmp_path / "moved-old"
    shutil.move(path, moved)
    assert RunStore(moved).run_uuid() == legacy_run_uuid(path)  # kept, not re-derived


def test_a_recorded_mlflow_run_of_another_identity_is_left_alone(tmp_path, mlflow_uri):
    """trackers.json copied in from another run (same MLflow id, other UUID) supersedes
    nothing."""
    a, b = tmp_path / "a", tmp_path / "b"
    RunStore(a).new_identity()
    tracker = MLflowTracker(mlflow_uri, background=False)
    tracker.start(a, {"seed": 0}, name="a", group="recorded", tags=[])
    tracker.finish("finished")
    RunStore(b).new_identity()
    shutil.copy(a / "trackers.json", b / "trackers.json")
    other = MLflowTracker(mlflow_uri, background=False)
    assert other.find_runs(b) == []
    assert [r.info.run_id for r in other.find_runs(a)] == [tracker.run_id]


# -- environment variables --------------------------------------------------------------------
ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_ENTITY")


def test_config_keys_override_env_vars_which_override_defaults(monkeypatch):
    for var in (*ENV, "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    plain = resolve_tracking_config(None)
    assert (plain.mlflow_uri, plain.mlflow_experiment) == (None, None)
    assert (plain.wandb_project, plain.wandb_entity, plain.wandb_mode) == ("omgrpo", None, None)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////env/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "env-exp")
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_ENTITY", "env-team")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    env = resolve_tracking_config({})
    assert (env.mlflow_uri, env.mlflow_experiment) == ("sqlite:////env/mlflow.db", "env-exp")
    assert (env.wandb_project, env.wandb_entity, env.wandb_mode) == (
        "env-project",
        "env-team",
        "disabled",
    )
    keys = {
        "mlflow_uri": "sqlite:////cfg.db",
        "mlflow_experiment": "cfg-exp",
        "wandb_project": "cfg-project",
        "wandb_entity": "cfg-team",
        "wandb_mode": "offline",
    }
    explicit = resolve_tracking_config(keys)
    assert {k: getattr(explicit, k) for k in keys} == keys


@pytest.mark.slow
def test_training_trackers_follow_the_env_vars(tmp_path, monkeypatch, offline_wandb):
    """With only the environment set, MLflow logs into $MLFLOW_TRACKING_URI's experiment
    $MLFLOW_EXPERIMENT_NAME (not the run store's sqlite), W&B into $WANDB_PROJECT."""
    uri = "sqlite:///" + str(tmp_path / "shared.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    mlflow = MLflowTracker.from_config(TrackingConfig(), tmp_path / "runs", background=False)
    wandb = WandbTracker.from_config(TrackingConfig())
    assert (mlflow.uri, wandb.project) == (uri, "env-project")
    run_dir = tmp_path / "runs" / "e"
    for tracker in (mlflow, wandb):
        tracker.start(run_dir, {"seed": 0}, name="e", group="the-group", tags=[])
    assert wandb.run.project == "env-project"
    for tracker in (mlflow, wandb):
        tracker.finish("finished")
    assert list(active_runs(uri, "from-env")) == [mlflow.run_id]
    assert not (tmp_path / "runs" / "mlflow.db").exists()


def test_creating_an_experiment_another_agent_just_created_reads_it(mlflow_uri, monkeypatch):
    """The race between `get_experiment_by_name` (None) and `create_experiment`: MLflow answers
    RESOURCE_ALREADY_EXISTS and the tracker takes the experiment the other agent made."""
    client = mlflow_client(mlflow_uri)
    existing = client.create_experiment("raced")
    tracker = MLflowTracker(mlflow_uri, background=False)
    tracker.client = client
    real = client.get_experiment_by_name
    calls = []

    def first_look_misses(name):
        calls.append(name)
        return None if len(calls) == 1 else real(name)

    monkeypatch.setattr(client, "get_experiment_by_name", first_look_misses)
    assert tracker._experiment("raced") == existing
    assert calls == ["raced", "raced"]


# -- MLflow's own schema migration ------------------------------------------------------------
def old_schema_db(path: Path, revision: str = "0a8213491aaa") -> str:
    """A SQLite store as an MLflow of 2023 left it (alembic revision `revision`)."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.store.tracking.dbmodels.initial_models import Base

    uri = f"sqlite:///{path}"
    engine = sqlalchemy.create_engine(uri)
    Base.metadata.create_all(engine)
    config = _get_alembic_config(uri)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
    engine.dispose()
    return uri


@pytest.mark.slow
def test_an_mlflow_db_of_an_older_schema_opens_and_takes_a_run(tmp_path):
    """MLflow 3.17 upgrades an older store on first open (every older schema lacks a table it
    has), so omgrpo needs no schema upgrade of its own."""
    import sqlalchemy
    from mlflow.store.db.utils import _get_latest_schema_revision, _get_schema_version

    uri = old_schema_db(tmp_path / "old.db")
    engine = sqlalchemy.create_engine(uri)
    assert _get_schema_version(engine) != _get_latest_schema_revision()
    tracker = MLflowTracker(uri, background=False)
    tracker.start(tmp_path / "r", {"seed": 0}, name="r", group="old-db", tags=[])
    tracker.log_metrics(1, {"loss/pg": 1.0})
    tracker.finish("finished")
    assert _get_schema_version(engine) == _get_latest_schema_revision()
    engine.dispose()
    history = mlflow_client(uri).get_metric_history(tracker.run_id, "loss/pg")
    assert [(m.step, m.value) for m in history] == [(1, 1.0)]
