"""Progress a researcher can read, on a terminal and in a log file.

`Progress` shows a tqdm bar when stderr is a terminal and prints one plain line every `every`
steps when stdout is not one (a log file, `omgrpo sweep`'s per-run logs), so `omgrpo train >
run.log` gets both: the bar on screen, the lines in the file. A line names each field's latest
value; a field not logged this step shows its last value and the step it came from, one never
logged shows "–" (never "nan"). The trainer uses `TRAIN_FIELDS`, the toy warm start a loss.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from tqdm.auto import tqdm

# label -> metric shown on the trainer's console
TRAIN_FIELDS = {
    "reward": "reward/total",
    "answers/prompt": "answers/unique_per_prompt",
    "kl/answer": "kl/answer",
    "kl/reasoning": "kl/reasoning",
    "val/acc": "val/acc",
}


class Progress:
    """A bar on a terminal, a line every `every` steps in a log (`every` = 0: no lines)."""

    def __init__(
        self,
        desc: str,
        total: int,
        fields: Mapping[str, str],
        *,
        start: int = 0,
        every: int = 1,
        bar: bool = True,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ):
        self.desc, self.total, self.fields, self.every = desc, total, dict(fields), every
        self.out, self.err = stdout or sys.stdout, stderr or sys.stderr
        self.bar = None
        if bar and self.err.isatty():
            self.bar = tqdm(
                total=total, initial=start, desc=desc, file=self.err, dynamic_ncols=True
            )
        # lines go to stdout unless the bar is already on the same screen
        self.lines = every > 0 and not (self.bar is not None and self.out.isatty())
        self.latest: dict[str, tuple[float, int]] = {}  # metric -> (value, step)
        self.mark = (start, time.perf_counter())  # (step, time) of the last line

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record `step`'s metrics; advance the bar, print a line when one is due."""
        for metric in self.fields.values():
            value = metrics.get(metric)
            if value is not None and math.isfinite(value):
                self.latest[metric] = (float(value), step)
        shown = {label: self._value(metric, step) for label, metric in self.fields.items()}
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(shown, refresh=False)
        if self.lines and (step % self.every == 0 or step == self.total):
            self.out.write(self._line(step, shown) + "\n")
            self.out.flush()

    def write(self, text: str) -> None:
        """A message that does not break the bar (and reaches the log)."""
        if self.bar is not None:
            tqdm.write(text, file=self.err)
        if self.bar is None or not self.out.isatty():
            self.out.write(text + "\n")
            self.out.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _value(self, metric: str, step: int) -> str:
        if metric not in self.latest:
            return "–"
        value, at = self.latest[metric]
        text = f"{value:.3g}" if abs(value) < 1e-2 and value != 0 else f"{value:.3f}"
        return text if at == step else f"{text} (step {at})"

    def _line(self, step: int, shown: Mapping[str, str]) -> str:
        last_step, last_time = self.mark
        now = time.perf_counter()
        self.mark = (step, now)
        parts = [f"{self.desc} step {step}/{self.total}"]
        parts += [f"{label} {text}" for label, text in shown.items()]
        if step > last_step:  # wall time since the last line: validation and saving included
            per_step = (now - last_time) / (step - last_step)
            parts.append(f"{per_step:.2f} s/step, eta {_duration(per_step * (self.total - step))}")
        return " | ".join(parts)


def quiet_library_bars() -> None:
    """Turn transformers' own bars (loading and saving weights) off when stderr is not a
    terminal: in a log file each is a line of carriage-return noise."""
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
