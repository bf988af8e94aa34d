"""The v2 calibration's rule (omgrpo.analysis.calibration) on hand-built control runs."""

import math

import pandas as pd
import pytest

from omgrpo.analysis.calibration import change, choose, judge, smoothed_drift

STEPS = list(range(0, 151, 15))


def _run(name, method, seed, lr, acc, easy, hard):
    """A finished run whose metrics are the given functions of the step."""
    return pd.DataFrame(
        {
            "experiment": name,
            "method": method,
            "seed": seed,
            "status": "finished",
            "step": STEPS,
            "cfg.optim.lr": lr,
            "cfg.algorithm.kl_coef": 0.005,
            "val/acc": [acc(t) for t in STEPS],
            "val/acc_easy": [easy(t) for t in STEPS],
            "val/acc_hard": [hard(t) for t in STEPS],
        }
    )


def _frame(seeds=(0, 1), gains=(0.10, 0.104)):
    flat = lambda v: lambda t: v  # noqa: E731
    runs = []
    for s in seeds:
        # X: the null stays put, GT gains `gains[seed]` on hard problems from step 120 on
        runs.append(_run("x", "mv_shuffled", s, 1e-5, flat(0.66), flat(0.98), flat(0.26)))
        gain = gains[s]
        runs.append(
            _run(
                "x", "gt", s, 1e-5, flat(0.66), flat(0.98), lambda t, g=gain: 0.26 + g * (t >= 120)
            )
        )
        # Y (larger lr): the null loses 0.05 from step 90 on; GT as X
        runs.append(
            _run(
                "y",
                "mv_shuffled",
                s,
                3e-5,
                lambda t: 0.66 - 0.05 * (t >= 90),
                flat(0.98),
                flat(0.26),
            )
        )
        runs.append(
            _run(
                "y", "gt", s, 3e-5, flat(0.66), flat(0.98), lambda t, g=gain: 0.26 + g * (t >= 120)
            )
        )
    return pd.concat(runs, ignore_index=True)


def test_change_and_smoothed_drift_by_hand():
    df = _frame()
    null_y = df[(df.experiment == "y") & (df.method == "mv_shuffled") & (df.seed == 0)]
    assert change(null_y, "val/acc") == pytest.approx(-0.05)
    drift = smoothed_drift([null_y], "val/acc")
    assert drift.loc[75] == pytest.approx(-0.05 / 3)  # steps 60, 75, 90
    assert drift.loc[150] == pytest.approx(-0.05)  # the end: steps 135 and 150


def test_the_rule_passes_the_calm_null_and_fails_the_drifting_one():
    x, y = judge(_frame(), ["x", "y"], headroom=0.06, base_passed=True)
    assert x.null_pass and x.gt_pass and x.passed
    assert x.gt_values == pytest.approx([0.10, 0.104]) and x.gt_change[0] == pytest.approx(0.102)
    # two seeds: the t-interval's half-width is 12.71 x SD / sqrt(2); 0.09 / 0.11 reaches 0
    assert judge(_frame(gains=(0.09, 0.11)), ["x"], 0.06, True)[0].gt_change[1][0] < 0
    assert y.null_pass is False and y.gt_pass and y.passed is False
    assert choose([x, y]) is x  # y has the larger lr but fails
    # GT must reach half the headroom; the base must pass its checks
    assert judge(_frame(), ["x"], headroom=0.25, base_passed=True)[0].gt_pass is False
    assert judge(_frame(), ["x"], headroom=0.06, base_passed=False)[0].passed is False


def test_one_seed_decides_nothing_and_a_missing_candidate_limits_every_one():
    (x,) = judge(_frame(seeds=(0,)), ["x"], headroom=0.06, base_passed=True)
    assert x.passed is None and x.null_pass is None and x.gt_pass is None
    assert x.gt_values == pytest.approx([0.10])  # shown as an observation
    x, z = judge(_frame(), ["x", "z"], headroom=0.06, base_passed=True)
    assert x.seeds == [] and x.passed is None and math.isnan(z.lr)


def test_process_quality_section_by_hand():
    """The study report's process-quality table: start -> final seed means per world/method."""
    from omgrpo.analysis.study import process_quality_section

    spec = {"start_step": 0, "final_steps": [120, 135, 150]}
    frames = []
    for seed, final in ((0, 0.4), (1, 0.6)):
        chain = [0.3 if t < 120 else final for t in STEPS]
        frames.append(
            pd.DataFrame(
                {
                    "experiment": "w",
                    "method": "gt",
                    "run": f"w__gt__s{seed}",
                    "step": STEPS,
                    "val/chain_acc_hard": chain,
                    "val/guess_truncated_hard": [0.1] * len(STEPS),
                }
            )
        )
    lines = process_quality_section(pd.concat(frames, ignore_index=True), spec)
    row = next(line for line in lines if line.startswith("| w |"))
    assert row == "| w | gt | 2 | 0.30 → 0.50 | 0.10 → 0.10 |"
    assert process_quality_section(pd.DataFrame({"val/acc": [0.5]}), spec) == []
