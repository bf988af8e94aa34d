"""`omgrpo tables` on fixture evaluation summaries: the expected cells, missing cells that name
their command, TTT before -> after, CAR vs n with time per step, LaTeX."""

import json

import pytest

from omgrpo.analysis.paper_tables import all_eval_tables, load_evals
from omgrpo.cli import main


def _summary(
    root,
    name,
    variant,
    seed,
    avg,
    *,
    ci=(0.0, 0.0),
    checkpoint="last",
    ttt=False,
    benchmarks=("toy_test",),
    steps=None,
):
    """A run directory with one `omgrpo eval` summary (k = 4 for every benchmark)."""
    run_dir = root / name
    label = "toy" if checkpoint == "last" else f"toy-{checkpoint}"
    out = run_dir / "eval" / label
    out.mkdir(parents=True, exist_ok=True)
    experiment = name.split("__")[0]
    summary = {
        "suite": "toy",
        "target": str(run_dir),
        "run": {
            "name": name,
            "experiment": experiment,
            "variant": variant,
            "method": variant,
            "scale": "toy",
            "seed": seed,
            "ttt": ttt,
        },
        "checkpoint": {"name": checkpoint, "step": 0 if checkpoint == "base" else 40},
        "benchmarks": {
            b: {
                "k": 4,
                "metrics": {"avg@4": avg, "pass@4": min(1.0, avg + 0.3)},
                "ci95": {"avg@4": list(ci), "pass@4": list(ci)},
            }
            for b in benchmarks
        },
    }
    (out / "summary.json").write_text(json.dumps(summary))
    if steps is not None:
        (run_dir / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"train/step": i + 1, "time/step": t}) + "\n"
                for i, t in enumerate(steps)
            )
        )
    return run_dir


@pytest.fixture
def evals(tmp_path):
    for seed, avg in enumerate([0.5, 0.6, 0.7]):
        _summary(tmp_path, f"main_table__om_grpo__s{seed}", "om_grpo", seed, avg)
    _summary(tmp_path, "main_table__mv__s0", "mv", 0, 0.5, ci=(0.4, 0.6))
    _summary(tmp_path, "main_table__gt__s0", "gt", 0, 0.8, ci=(0.7, 0.9), benchmarks=("other",))
    _summary(tmp_path, "ttt__mv__s0", "mv", 0, 0.3, ttt=True, checkpoint="base")
    _summary(tmp_path, "ttt__mv__s0", "mv", 0, 0.45, ttt=True)
    _summary(
        tmp_path,
        "car_vs_n__om_grpo_no_car_n16__s0",
        "om_grpo_no_car_n16",
        0,
        0.55,
        steps=[2.0, 4.0],
    )
    return tmp_path


def _row(table, method):
    frame = table.frame.set_index("method")
    return frame.loc[method]


def test_main_table_cells(evals):
    tables = all_eval_tables(load_evals(evals))
    main_t = tables["main"]
    om = _row(main_t, "OM-GRPO")
    # 0.5, 0.6, 0.7: mean 0.6, sd 0.1, t(2) = 4.303 -> 4.303 * 0.1 / sqrt(3) = 0.2484
    assert om["toy_test avg@4"] == "60.00 ± 24.84"
    assert om["seeds"] == "3"
    mv = _row(main_t, "Majority Voting")
    assert mv["toy_test avg@4"] == "50.00 ± 10.00†"  # one seed: half the bootstrap interval
    gt = _row(main_t, "GT-Reward")  # evaluated on another benchmark only
    assert (
        gt["toy_test avg@4"] == f"missing: `omgrpo eval {evals / 'main_table__gt__s0'} --suite toy`"
    )
    assert gt["other avg@4"] == "80.00 ± 10.00†"
    assert om["other avg@4"].startswith("missing: `omgrpo eval ")
    assert _row(main_t, "Entropy")["toy_test avg@4"] == (
        "missing: `omgrpo sweep sweeps/main_table.yaml --eval toy`"
    )
    assert _row(tables["pass_at_k"], "OM-GRPO")["toy_test pass@4"].startswith("90.00 ± ")
    assert "ttt" not in " ".join(main_t.frame["method"])  # TTT runs stay in their table


def test_ttt_car_and_latex(evals):
    tables = all_eval_tables(load_evals(evals))
    ttt = tables["ttt"].frame
    assert list(ttt["method"][:2]) == ["Before TTRL", "Majority Voting"]
    assert ttt.loc[0, "toy_test avg@4"] == "30.00 ± 0.00†"
    assert ttt.loc[1, "toy_test avg@4"] == "45.00 ± 0.00†"
    assert ttt.loc[2, "toy_test avg@4"] == "missing: `omgrpo sweep sweeps/ttt.yaml --eval toy`"
    car = _row(tables["car_vs_n"], "w/o CAR (n=16) (toy/car_vs_n)")
    assert (car["time/step (s)"], car["train time (min)"]) == ("3.00", "0.1")
    latex = tables["main"].latex
    assert "\\toprule" in latex and "\\bottomrule" in latex
    assert "60.00 $\\pm$ 24.84" in latex and "toy\\_test avg@4" in latex


def test_tables_cli_writes_markdown_and_latex(evals, tmp_path, capsys):
    out = tmp_path / "tables"
    assert main(["tables", str(evals), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {"tables.md", "main.md", "main.tex", "ttt.tex"}
    assert "60.00 ± 24.84" in (out / "tables.md").read_text()
    assert main(["tables", str(tmp_path / "nothing_here"), "--out", str(out)]) == 2


def test_report_section_only_when_evals_exist(evals, tmp_path):
    from omgrpo.analysis.paper_tables import eval_tables_section

    lines = eval_tables_section([evals])
    assert lines[0] == "## Benchmark evaluations (`omgrpo eval`)"
    assert any("60.00 ± 24.84" in line for line in lines)
    empty = tmp_path / "no_evals"
    empty.mkdir()
    assert eval_tables_section([empty]) == []


def test_tables_print_provenance_and_warn_on_mixed_commits(evals, tmp_path, capsys):
    """Each suite's runs get a provenance line; runs from two commits in one table warn."""
    from omgrpo.analysis.provenance import ProvenanceWarning
    from omgrpo.tracking.store import RunStore

    record = {
        "git_commit": "a" * 40,
        "git_dirty": False,
        "versions": {"omgrpo": "0.1.0", "torch": "2.13.0+cpu", "vllm": None},
        "torch_build": "cpu",
        "device_type": "cpu",
        "device_count": 2,
        "device_names": ["x86_64"],
    }
    RunStore(evals / "main_table__om_grpo__s0").write_provenance(record)
    RunStore(evals / "main_table__om_grpo__s1").write_provenance(
        {**record, "git_commit": "b" * 40, "git_dirty": True}
    )
    with pytest.warns(ProvenanceWarning, match="2 different commits"):
        assert main(["tables", str(evals), "--out", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("- suite toy:"))
    assert "7 run(s)" in line and "5 without provenance" in line  # ttt__mv__s0 twice
    assert "commit aaaaaaaaaa, bbbbbbbbbb (1 dirty)" in line
    assert "torch 2.13.0+cpu" in line and "vllm –" in line and "devices 2× x86_64" in line
    assert "WARNING: the runs compared come from 2 different commits" in out
