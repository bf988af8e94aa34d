"""The per-arm mechanism summary (omgrpo.analysis.mechanism) on a hand-made frame."""

import math

import pandas as pd
import pytest

from omgrpo.analysis.mechanism import gates_table, mechanism_section, mechanism_table, route


def _rows(run, variant, steps, answer, other, history, gate_stop):
    """A run's probe rows (plus a step without a probe, as validation-only step 0 is)."""
    out = [{"run": run, "experiment": "w", "variant": variant, "step": 0, "val/acc": 0.5}]
    for i, step in enumerate(steps):
        full = answer[i] + other[i] + history[i]
        out.append(
            {
                "run": run,
                "experiment": "w",
                "variant": variant,
                "step": step,
                "mech/p_box1": 0.2 + 0.1 * i,
                "mech/p_box1_hard": 0.3 + 0.1 * i,
                "mech/d_box1_full_hard": full,
                "mech/d_box1_answer_hard": answer[i],
                "mech/d_box1_other_hard": other[i],
                "mech/d_box1_history_hard": history[i],
                "mech/gate_first_hard": 0.2,
                "mech/gate_stop_hard": gate_stop[i],
                "mech/computed_lead_hard": 0.1,
                "mech/leak_cos": 0.5,
                "mech/kl_answer": 0.01 * (i + 1),
            }
        )
    return out


def _frame():
    rows = []
    # MV: both runs raise P(box 1) mostly through the answer tokens
    rows += _rows("mv0", "mv", [1, 10], [0.01, 0.03], [0.0, 0.01], [0.0, 0.0], [0.2, 0.6])
    rows += _rows("mv1", "mv", [1, 10], [0.0, 0.02], [0.0, 0.0], [0.0, 0.0], [0.2, 0.8])
    # OM-GRPO: no answer part, the other tokens raise it
    rows += _rows("om0", "om", [1, 10], [0.0, 0.0], [0.004, 0.002], [0.0, 0.001], [0.2, 0.9])
    return pd.DataFrame(rows)


def test_mechanism_table_by_hand():
    table = mechanism_table(_frame()).set_index("variant")
    mv, om = table.loc["mv"], table.loc["om"]
    assert (mv["runs"], om["runs"]) == (2, 1)
    # per run mean over probes (0.02, 0.01), then over runs
    assert mv["d_box1_answer"] == pytest.approx(0.015)
    assert mv["d_box1_other"] == pytest.approx(0.0025)
    assert mv["answer_share"] == pytest.approx(0.015 / 0.0175)
    assert (mv["route"], om["route"]) == ("answer tokens", "other tokens")
    assert om["d_box1_full"] == pytest.approx(0.0035)
    assert om["answer_share"] == 0.0
    # the hard values, first and last probe
    assert mv["gate_stop_first"] == pytest.approx(0.2)
    assert mv["gate_stop_last"] == pytest.approx(0.7)
    assert mv["p_box1_first"] == pytest.approx(0.3) and mv["p_box1_last"] == pytest.approx(0.4)
    assert om["kl_answer"] == pytest.approx(0.02)


def test_without_per_difficulty_values_the_overall_ones_are_used():
    df = _frame()
    table = mechanism_table(df, difficulty=None).set_index("variant")
    assert table.loc["mv", "p_box1_last"] == pytest.approx(0.3)  # mech/p_box1, not _hard
    assert math.isnan(table.loc["mv", "gate_stop_last"])  # no overall gate in this frame


def test_route_rule():
    assert route(0.02, 0.01) == "answer tokens"
    assert route(0.0, 0.01) == "other tokens"
    assert route(-0.01, -0.02) == "none"
    assert route(0.01, math.nan) == "answer tokens"


def test_gates_table_and_section():
    gates = gates_table(_frame()).set_index("variant")
    assert gates.loc["mv", 1] == "0.20 / 0.20" and gates.loc["mv", 10] == "0.20 / 0.70"
    lines = mechanism_section(_frame())
    assert lines[0] == "## Mechanism"
    text = "\n".join(lines)
    assert "| w / mv | 2 | +0.0175 | +0.0150 | +0.0025 | +0.0000 | answer tokens |" in text
    assert "| w / om | 0.20 / 0.20 | 0.20 / 0.90 |" in text


def test_runs_without_the_probe_give_no_section():
    df = pd.DataFrame({"run": ["a"], "experiment": ["w"], "variant": ["mv"], "step": [1]})
    assert mechanism_table(df).empty and mechanism_section(df) == []
