"""omgrpo.staging: outputs written all or nothing, next to their target, and nothing this
process did not create is touched on the way."""

from __future__ import annotations

import pytest

from omgrpo.staging import staged_dir, staged_file, staged_files


def test_a_staged_file_replaces_its_target_only_when_whole(tmp_path):
    out = tmp_path / "summary.json"
    out.write_text("earlier")
    (tmp_path / ".summary.json.tmp").write_text("someone else's")  # a name it never reuses
    with pytest.raises(RuntimeError), staged_file(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert out.read_text() == "earlier"
    with staged_file(out) as tmp:
        tmp.write_text("whole")
    assert out.read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".summary.json.tmp", "summary.json"]
    assert (tmp_path / ".summary.json.tmp").read_text() == "someone else's"
    assert oct(out.stat().st_mode & 0o777) != oct(0o600)  # as open() makes it, not mkstemp's


def test_a_staged_dir_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError), staged_dir(out) as tmp:
        (tmp / "a").write_text("a")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with staged_dir(out) as tmp:
        (tmp / "a").write_text("a")
    assert (out / "a").read_text() == "a" and list(tmp_path.iterdir()) == [out]
    with pytest.raises(FileExistsError), staged_dir(out):
        pass  # not empty: refused before anything is written


def test_staged_files_move_in_together_and_keep_other_files(tmp_path):
    out = tmp_path / "tables"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    (out / "t.md").write_text("earlier")
    with pytest.raises(RuntimeError), staged_files(out) as tmp:
        (tmp / "t.md").write_text("new")
        raise RuntimeError("failed halfway")
    assert (out / "t.md").read_text() == "earlier"
    with staged_files(out) as tmp:
        (tmp / "t.md").write_text("new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "f.png").write_bytes(b"png")
    assert (out / "t.md").read_text() == "new" and (out / "sub" / "f.png").read_bytes() == b"png"
    assert (out / "mine.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tables"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError), staged_files(tmp_path / "afile"):
        pass
