"""The committed studies regenerate from their compact runs (metrics.jsonl.xz, `omgrpo compact`)
exactly as committed. The cheapest: the v2 study's calibration verdict (12 runs and 2 headroom
replays -> calibration.json and calibration.tables.md, seconds). The study reports themselves
(`omgrpo study-report`, 14-18 s each without the figures): v4's and v3's report.md below
their headers (title, who wrote it when, the runs), and v2's except its base-checks section, which
reads the bare-guess world's base from the local cache (that base is not shipped). v1 committed
no runs; its pre-registration still parses (tests/analysis/test_study.py)."""

from pathlib import Path

import pytest

from omgrpo.analysis import calibration

REPO = Path(__file__).resolve().parents[2]
V2 = REPO / "reports/collapse-study-v2"
HEADER_LINES = 4  # title, blank, "Written by ...", "<n> runs in <folder>."


@pytest.mark.e2e
def test_the_v2_calibration_regenerates_from_its_compact_runs(tmp_path):
    runs, headroom = V2 / "calibration/runs", V2 / "calibration/headroom"
    assert not list(runs.rglob("metrics.jsonl")) and not list(headroom.rglob("metrics.jsonl"))
    assert len(list(runs.glob("*/metrics.jsonl.xz"))) == 12  # what the loader reads here
    calibration.main(
        [str(runs), "--headroom", str(headroom), "--out", str(tmp_path / "calibration.md"),
         "--checks", str(REPO / "omgrpo/bases/toy-base-474a2a6b9402/checks.json")]
    )  # fmt: skip
    for name in ("calibration.json", "calibration.tables.md"):
        assert (tmp_path / name).read_text() == (V2 / name).read_text(), name


def _body(text: str, leave_out: str | None) -> list[str]:
    """A report below its header, up to its figure list (not drawn here), without the section
    `leave_out`."""
    lines = text.split("\n## Figures\n")[0].splitlines()[HEADER_LINES:]
    if leave_out is None:
        return lines
    start = lines.index(leave_out)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    return lines[:start] + lines[end:]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("folder", "prereg", "leave_out"),
    [
        ("collapse-study-v4", "PREREGISTRATION-v4.md", None),
        ("collapse-study-v3", "PREREGISTRATION-v3.md", None),
        ("collapse-study-v2", "PREREGISTRATION-v2.md", "## Base checks"),
    ],
)
def test_the_study_reports_regenerate_below_their_headers(
    tmp_path, monkeypatch, folder, prereg, leave_out
):
    from omgrpo.analysis.study import write_study_report

    monkeypatch.chdir(REPO)  # the report names its paths as given, relative to the repo
    study = Path("reports") / folder
    out = write_study_report([study / "runs"], study / prereg, tmp_path, figures=False)
    committed = (study / "report.md").read_text()
    assert _body(out.read_text(), leave_out) == _body(committed, leave_out)
