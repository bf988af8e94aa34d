"""The committed studies regenerate from their compact runs (metrics.jsonl.xz, `omgrpo compact`)
exactly as committed. The cheapest: the v2 study's calibration verdict (12 runs and 2 headroom
replays -> calibration.json and calibration.tables.md, seconds). The study reports themselves
(`omgrpo study-report`, a minute or more each) were checked the same way when the runs were
compacted; reports/README.md says how."""

from pathlib import Path

import pytest

from omgrpo.analysis import calibration

REPO = Path(__file__).resolve().parents[2]
V2 = REPO / "reports/collapse-study-v2"


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
