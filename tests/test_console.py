"""The console a researcher reads: plain per-step lines in logs, a bar on a
terminal, warm-start progress in logs too, and no `nan` between validations."""

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omgrpo.console import TRAIN_FIELDS, Progress

REPO = Path(__file__).resolve().parent.parent


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _steps(progress: Progress, n: int) -> None:
    for step in range(1, n + 1):
        metrics = {"reward/total": 1.0 + step / 10, "answers/unique_per_prompt": 2.5}
        metrics |= {"kl/answer": 0.00123, "kl/reasoning": float("nan")}
        if step == 2:
            metrics["val/acc"] = 0.5
        progress.update(step, metrics)


def test_log_lines_every_n_steps_without_nan():
    out, err = io.StringIO(), io.StringIO()
    _steps(Progress("run", 5, TRAIN_FIELDS, every=2, stdout=out, stderr=err), 5)
    lines = out.getvalue().splitlines()
    assert [re.search(r"step (\d+)/5", line).group(1) for line in lines] == ["2", "4", "5"]
    assert lines[0].startswith("run step 2/5 | reward 1.200 | answers/prompt 2.500 | ")
    assert "kl/answer 0.00123 | kl/reasoning – | val/acc 0.500 | " in lines[0]
    assert "val/acc 0.500 (step 2)" in lines[1]  # the last validation, and when it was
    assert all(re.search(r"\| \d+\.\d\d s/step, eta \dm\d\ds$", line) for line in lines)
    assert "nan" not in out.getvalue().lower() and err.getvalue() == ""


def test_before_the_first_validation_val_acc_is_a_dash():
    out = io.StringIO()
    progress = Progress("run", 3, TRAIN_FIELDS, stdout=out, stderr=io.StringIO())
    progress.update(1, {"reward/total": 0.5})
    assert "val/acc –" in out.getvalue() and "nan" not in out.getvalue()


def test_terminal_gets_a_bar_and_a_redirected_stdout_still_gets_lines():
    err, out = Terminal(), io.StringIO()
    progress = Progress("run", 3, TRAIN_FIELDS, stdout=out, stderr=err)
    _steps(progress, 3)
    progress.write("collapse detected at step 3")
    progress.close()
    assert "3/3" in err.getvalue() and "collapse detected" in err.getvalue()  # the bar
    assert len(out.getvalue().splitlines()) == 4  # 3 step lines + the message, in the log
    assert "collapse detected at step 3" in out.getvalue()


def test_a_terminal_with_a_bar_gets_no_lines():
    term = Terminal()
    _steps(Progress("run", 3, TRAIN_FIELDS, stdout=term, stderr=term), 3)
    assert " | reward " not in term.getvalue() and "3/3" in term.getvalue()


def test_no_bar_means_lines_even_on_a_terminal_and_every_0_means_none():
    term = Terminal()
    _steps(Progress("run", 3, TRAIN_FIELDS, bar=False, stdout=term, stderr=term), 3)
    assert term.getvalue().count(" | reward ") == 3
    quiet = io.StringIO()
    _steps(Progress("run", 3, TRAIN_FIELDS, every=0, stdout=quiet, stderr=io.StringIO()), 3)
    assert quiet.getvalue() == ""


@pytest.mark.slow
@pytest.mark.e2e
def test_training_log_file_has_per_step_and_warm_start_lines(tmp_path, tiny_overrides):
    """`omgrpo train > file`: a line per step (trainer.log_every=1) and the warm start's
    progress, no `nan`, no carriage-return bars."""
    dropped = ("trainer.progress", "model.cache_dir", "model.warm_start.steps")
    overrides = [o for o in tiny_overrides if not o.startswith(dropped)]
    log = tmp_path / "train.log"
    with log.open("w") as f:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "omgrpo",
                "train",
                *overrides,
                "model.warm_start.steps=4",
                "trainer.steps=3",
                f"model.cache_dir={tmp_path / 'cache'}",  # fresh: the warm start runs
            ],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    assert re.search(r"^warm start \(SFT\) step 4/4 \| loss \d+\.\d+ \| ", text, re.M), text
    for step in (1, 2, 3):
        line = re.search(rf"^toy__om_grpo__s0 step {step}/3 \| reward .*$", text, re.M)
        assert line, text
        for field in ("answers/prompt", "kl/answer", "kl/reasoning", "val/acc", "s/step"):
            assert field in line.group(0)
    assert "val/acc" in re.search(r"^toy__om_grpo__s0 step 0/3 .*$", text, re.M).group(0)
    assert "nan" not in text.lower() and "\r" not in text
