"""The team's dashboard: omgrpo's MLflow experiments are tagged as model training, a study's or
sweep's runs carry the tags the UI groups by, `omgrpo report`'s files reach the runs' MLflow
runs, and, checked in a real browser (Debian's headless Chromium driven by Selenium through
chromedriver) against a real `mlflow server` on 127.0.0.1, a trained run's page shows the
model-training view and draws its `kl/answer` and `kl/reasoning` charts. The browser test
saves a screenshot under its tmp dir (the path is printed) and, when small, copies it to
`reports/dashboard-check/dashboard.png` (git-ignored)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import TINY
from test_shared_server import REPO, MlflowServer  # tests/tracking is on sys.path

from omgrpo.tracking.artifacts import log_report_artifacts
from omgrpo.tracking.mlflow_tracker import (
    EXPERIMENT_KIND_TAG,
    MODEL_TRAINING_KIND,
    MLflowTracker,
    dashboard_url,
    mlflow_client,
)
from omgrpo.tracking.naming import SWEEP_ENV, run_group_tags
from omgrpo.tracking.store import RunStore

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL_HINT = (
    "the dashboard's browser test drives Debian's Chromium: install it with "
    "`sudo apt-get install -y chromium chromium-driver` (.ci/run does) and "
    "`pip install selenium` (the dev extra)"
)
SCREENSHOT_MAX_BYTES = 300_000
WAIT_S = 90  # a loaded 2-core machine; the page and its charts take a few seconds


# -- tags ------------------------------------------------------------------------------------
def test_run_group_tags_name_arm_unit_seed_base_and_sweep():
    config = {
        "method": "mv",
        "seed": 13,
        "run": {"experiment": "toy_shortcut_base1", "variant": "mv"},
        "model": {"path": None, "warm_start": {"seed": 1}},
    }
    assert run_group_tags(config, env={SWEEP_ENV: "collapse_study_v4_central"}) == {
        "arm": "mv",
        "seed": "13",
        "experiment": "toy_shortcut_base1",
        "unit": "toy_shortcut_base1/s13",
        "base": "toy/warm_start.seed=1",
        "sweep": "collapse_study_v4_central",
    }
    hf = {"seed": 0, "run": {"variant": "om_grpo"}, "model": {"path": "/m/Qwen2.5-Math-1.5B"}}
    assert run_group_tags({"omgrpo": hf}, env={"WANDB_SWEEP_ID": "abc123"}) == {
        "arm": "om_grpo",
        "seed": "0",
        "base": "Qwen2.5-Math-1.5B",
        "sweep": "abc123",
    }
    assert run_group_tags({}, env={}) == {}


@pytest.mark.slow  # a fresh SQLite store: MLflow's migration takes seconds
def test_experiments_are_tagged_model_training_and_a_kind_set_by_hand_is_kept(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker(uri, background=False)
    tracker.start_client()
    client = mlflow_client(uri)

    new = tracker._experiment("created-by-omgrpo")
    untagged = client.create_experiment("created-elsewhere")
    mine = client.create_experiment("users-choice", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert tracker._experiment("created-elsewhere") == untagged  # first used by omgrpo
    assert tracker._experiment("users-choice") == mine
    kinds = {
        e: client.get_experiment(e).tags.get(EXPERIMENT_KIND_TAG) for e in (new, untagged, mine)
    }
    assert kinds == {
        new: MODEL_TRAINING_KIND,
        untagged: MODEL_TRAINING_KIND,
        mine: "genai_development",
    }


# -- a tiny run on the shipped toy base ---------------------------------------------------------
def train_toy_run(root: Path, base_cache: str, tracking: list[str]) -> Path:
    """3 steps of a tiny-settings run on the toy base that ships with omgrpo (installed into
    `base_cache`, not trained): its responses box answers, so `kl/answer` has values (the
    5-step base of `TINY` boxes none and logs NaN, which MLflow does not chart)."""
    from omgrpo.backends.native.trainer import train
    from omgrpo.config import compose

    keep = [o for o in TINY if not o.startswith(("model.", "tracking.", "rollout.max_new"))]
    threads = torch.get_num_threads()
    try:
        return train(
            compose(
                [
                    *keep,
                    "method=self_certainty",  # rewards differ within a group: every step trains
                    f"model.cache_dir={base_cache}",
                    f"run.root={root}",
                    "trainer.steps=3",
                    "trainer.threads=1",
                    "tracking.wandb=false",
                    *tracking,
                ]
            )
        )
    finally:
        torch.set_num_threads(threads)


def artifact_paths(client, run_id: str, path: str) -> list[str]:
    return [a.path for a in client.list_artifacts(run_id, path)]


@pytest.mark.slow
def test_report_files_are_logged_to_the_runs_mlflow_run(tmp_path, base_cache):
    from omgrpo.analysis.report import write_report
    from omgrpo.core.problems import problem_table

    run_dir = train_toy_run(tmp_path / "runs", base_cache, ["tracking.mlflow=true"])
    run_id = RunStore(run_dir).tracker_ids()["mlflow"]
    # the run's per-problem table (a real one: report refuses a damaged table by name)
    RunStore(run_dir).log_problems(0, problem_table(0, ["p1"], [["3", "3"]], [[True, False]]))
    untracked = tmp_path / "runs" / "other"
    untracked.mkdir()
    RunStore(untracked).write_config({"run": {"name": "other"}})  # no MLflow id: skipped
    write_report(run_dir, tmp_path / "report")  # logs it (omgrpo report does the same)
    client = mlflow_client(MLflowTracker.from_config(None, run_dir.parent).uri)
    assert "report/report.md" in artifact_paths(client, run_id, "report")

    logged = log_report_artifacts([run_dir, untracked], tmp_path / "report")
    assert logged == {str(run_dir): run_id}
    top = artifact_paths(client, run_id, "report")
    assert {"report/report.md", "report/summary.json", "report/problems.parquet"} <= set(top)
    figures = artifact_paths(client, run_id, "report/figures")
    assert figures and all(p.endswith(".png") for p in figures), figures
    assert log_report_artifacts([run_dir], tmp_path / "report") == logged  # again: replaced

    gone = tmp_path / "moved"  # its store is not where the run store says: one warning
    shutil.copytree(run_dir, gone / run_dir.name, ignore=shutil.ignore_patterns("checkpoints"))
    with pytest.warns(UserWarning, match="not logged to the MLflow runs of 1 run"):
        assert log_report_artifacts([gone / run_dir.name], tmp_path / "report") == {}
    assert not (gone / "mlflow.db").exists()  # and no store was created there


# -- the browser -------------------------------------------------------------------------------
@contextlib.contextmanager
def headless_chromium(log: Path):
    """A Selenium driver of Debian's Chromium through its chromedriver (no download: Selenium
    Manager is not asked, both paths are given); quit, with its processes, however the test
    ends."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).is_file()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: {INSTALL_HINT}", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"selenium is not installed: {INSTALL_HINT}", pytrace=False)
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,1150", "--no-first-run", "--disable-extensions"):  # fmt: skip
        options.add_argument(arg)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(log))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()  # stops chromedriver too, and the browser it started


def wait_for(driver, what: str, condition):
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    # the UI re-renders chart cards while they load: an element read mid-render is stale, and
    # the condition is simply tried again at the next poll
    wait = WebDriverWait(
        driver, WAIT_S, poll_frequency=0.5, ignored_exceptions=(StaleElementReferenceException,)
    )
    try:
        return wait.until(condition)
    except TimeoutException:
        body = driver.execute_script("return document.body ? document.body.innerText : ''")
        pytest.fail(f"{what} within {WAIT_S} s at {driver.current_url}; the page says:\n{body}")


def drawn_chart(driver, metric: str) -> str | None:
    """The title of `metric`'s chart card once Plotly has drawn its line (a trace path with
    points), else None; read in one go, since a card element goes stale when the UI re-renders
    it. Cards are `experiment-view-compare-runs-card`s; the legend names the metric."""
    from selenium.webdriver.common.by import By

    for card in driver.find_elements(
        By.CSS_SELECTOR, "[data-testid=experiment-view-compare-runs-card]"
    ):
        if f"({metric})" not in card.text:
            continue
        lines = card.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .scatterlayer path.js-line")
        if any((line.get_attribute("d") or "").count("L") >= 1 for line in lines):
            return card.text.splitlines()[0]
    return None


def check_experiment_page(driver, url: str) -> str:
    """Open the experiment's page; assert it is the model-training view (its runs), not the
    GenAI one (Overview, Traces, Evaluations); returns the page's text."""
    from selenium.webdriver.common.by import By

    driver.get(url)
    wait_for(driver, "the experiment's runs", lambda d: d.title.startswith("Runs - Experiment"))

    def page_text(d) -> str:
        return d.find_element(By.TAG_NAME, "body").text

    wait_for(driver, "the run's row", lambda d: "toy__self_certainty__s0" in page_text(d))
    body = page_text(driver)
    for genai in ("Evaluation runs", "Evaluations", "Token Usage"):
        assert genai not in body, f"{genai!r} shown: the GenAI view, not model training"
    return body


def check_run_charts(driver, url: str) -> dict[str, str]:
    """Open the run's model-metrics tab, filter to the KL charts and wait until `kl/answer` and
    `kl/reasoning` are drawn; returns each chart's title."""
    from selenium.webdriver.common.by import By

    driver.get(url)
    search = wait_for(
        driver,
        "the metric charts' search box",
        lambda d: d.find_elements(By.CSS_SELECTOR, "input[placeholder='Search metric charts']"),
    )[0]
    for close in driver.find_elements(By.CSS_SELECTOR, "button[aria-label=Close]"):
        with contextlib.suppress(Exception):  # the assistant's side panel: more room
            close.click()
    search.send_keys("kl/")
    return {m: wait_for(driver, f"a drawn {m} chart", lambda d, m=m: drawn_chart(d, m))
            for m in ("kl/answer", "kl/reasoning")}  # fmt: skip


@pytest.mark.slow
@pytest.mark.e2e
def test_dashboard_in_a_real_browser(tmp_path, base_cache):
    with MlflowServer(tmp_path) as server:
        experiment = "omgrpo-dashboard"
        tracking = ["tracking.mlflow=true", f"tracking.mlflow_uri={server.uri}",
                    f"tracking.mlflow_experiment={experiment}"]  # fmt: skip
        run_dir = train_toy_run(tmp_path / "runs", base_cache, tracking)
        run_id = RunStore(run_dir).tracker_ids()["mlflow"]
        client = mlflow_client(server.uri)
        run = client.get_run(run_id)
        exp_id = run.info.experiment_id
        assert client.get_experiment(exp_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
        tags = run.data.tags
        assert (tags["arm"], tags["seed"], tags["unit"]) == ("self_certainty", "0", "toy/s0")

        with headless_chromium(tmp_path / "chromedriver.log") as driver:
            check_experiment_page(driver, dashboard_url(server.uri, exp_id))
            titles = check_run_charts(driver, dashboard_url(server.uri, exp_id, run_id))
            assert titles == {"kl/answer": "answer", "kl/reasoning": "reasoning"}
            shot = tmp_path / "dashboard.png"
            assert driver.save_screenshot(str(shot))
    print(f"\ndashboard screenshot: {shot} ({shot.stat().st_size} bytes)")
    if shot.stat().st_size < SCREENSHOT_MAX_BYTES:
        stable = REPO / "reports" / "dashboard-check" / "dashboard.png"
        stable.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, stable)
        print(f"copied to {stable}")


def test_ci_installs_chromium_where_missing():
    script = (REPO / ".ci" / "run").read_text()
    assert "command -v chromium" in script and "chromium-driver" in script
    assert script.index("chromium-driver") < script.index("make test")
    subprocess.run(["bash", "-n", str(REPO / ".ci" / "run")], check=True)
