"""verl's per-sample reward function (validation), and reading verl's labels.

`compute_score` is verl's custom reward function (`reward.custom_reward_function`, path
`pkg://omgrpo.backends.verl.reward`). It scores one response on its own: label-free `score`
(the format reward), `pred` (the normalised boxed answer, so verl's validation reports maj@N),
`acc` (equivalence to the label: a diagnostic, and verl's `val-core` metric) and, when the row
names its problem, `problem` (its id: the validation's `problems.parquet`). During
training the omgrpo agent loop presets every rollout's reward with the group reward of
`omgrpo.core.step.score_step`, so verl calls this function only for validation (and for any rollout
without a preset reward).
"""

from __future__ import annotations

from typing import Any

from omgrpo.core.answers import Grader, normalize
from omgrpo.core.rewards import format_score
from omgrpo.core.step import extract_answer, is_correct

__all__ = ["NO_ANSWER", "compute_score", "label_of", "pred_of", "problem_of"]

NO_ANSWER = "[no answer]"
"""`pred` of a response without a boxed answer (verl's maj@N needs a string)."""


def label_of(ground_truth: Any) -> str | None:
    """The label as a string (verl datasets store numbers too); None when absent or empty."""
    if ground_truth is None:
        return None
    if isinstance(ground_truth, (list, tuple)):  # some datasets keep a list of accepted answers
        ground_truth = ground_truth[0] if ground_truth else None
        if ground_truth is None:
            return None
    text = str(ground_truth).strip()
    return text or None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    math_verify: bool | None = None,
    **kwargs: Any,
) -> dict[str, float | str]:
    """Per-sample score (verl's `compute_score` signature).

    Returns ``{"score": format reward, "format": same, "acc": 1.0 / 0.0 vs the label (0.0
    without a label), "pred": normalised boxed answer or "[no answer]"}``, with "problem": the
    row's problem id (`problem_of`) when it has one. The score never
    reads the label, so a run that falls back to per-sample scoring stays label-free.
    `math_verify` (`omgrpo.reward.math_verify`, passed by the presets through
    `reward.custom_reward_function.reward_kwargs`) switches the equivalence fallback of `acc`
    for this call (None: on, the default). Each call grades with its own default budget.
    """
    grader = Grader(math_verify=True if math_verify is None else bool(math_verify))
    answer = extract_answer(solution_str or "")
    fmt = format_score(answer)
    acc = float(bool(is_correct(answer, label_of(ground_truth), grader)))
    out: dict[str, float | str] = {"score": fmt, "format": fmt, "acc": acc, "pred": pred_of(answer)}
    problem = problem_of(data_source, extra_info)
    if problem is not None:
        out["problem"] = problem
    return out


def problem_of(data_source: str, extra_info: dict | None) -> str | None:
    """A row's problem id, stable across validations: `extra_info.id` (the native problem id,
    `omgrpo.backends.verl.data.verl_rows`), else `<data_source>/<extra_info.index>`; None
    without either."""
    if not isinstance(extra_info, dict):
        return None
    if extra_info.get("id") is not None:
        return str(extra_info["id"])
    if extra_info.get("index") is not None:
        index = extra_info["index"]
        return f"{data_source}/{index.item() if hasattr(index, 'item') else index}"
    return None


def pred_of(answer: str | None) -> str:
    """verl's `pred` of an extracted answer: normalised, or "[no answer]"."""
    return normalize(answer) if answer is not None else NO_ANSWER
