"""The suite's file order (tests/conftest.py): longest files first, by the durations snapshot."""

from conftest import DURATIONS, recorded_seconds_per_file


def test_a_files_seconds_sum_its_listed_phases():
    text = """# make durations: header line
============================== slowest durations ===============================
226.45s setup    tests/a/test_x.py::test_one
28.91s call     tests/a/test_x.py::test_one
1.50s teardown tests/a/test_x.py::test_two[p-1]
0.75s call     tests/test_y.py::test_z[a::b]

(6716 durations < 0.5s hidden.)
"""
    assert recorded_seconds_per_file(text) == {
        "tests/a/test_x.py": 226.45 + 28.91 + 1.50,
        "tests/test_y.py": 0.75,
    }


def test_the_committed_snapshot_is_read():
    seconds = recorded_seconds_per_file(DURATIONS.read_text())
    assert len(seconds) > 20 and all(name.startswith("tests/") for name in seconds)
