"""search_env.safe_fs: deletes stay inside their root and spare `/`, home and the repository; a
builder deletes only what it stamped; replaces and writes are whole or absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from search_env.paths import REPO_ROOT
from search_env.safe_fs import (
    UnsafeDeleteError,
    open_lock,
    remove_owned,
    remove_tree,
    replace_durably,
    write_atomic,
)


def test_remove_tree_deletes_inside_its_root_only(tmp_path):
    inside = tmp_path / "root" / "a"
    (inside / "b").mkdir(parents=True)
    (inside / "b" / "f").write_text("x")
    outside = tmp_path / "keep"
    outside.mkdir()
    with pytest.raises(UnsafeDeleteError, match="not inside its root"):
        remove_tree(tmp_path / "root" / ".." / "keep", tmp_path / "root")
    with pytest.raises(UnsafeDeleteError, match="not inside its root"):
        remove_tree(tmp_path / "root", tmp_path / "root")
    assert outside.is_dir()
    assert remove_tree(inside, tmp_path / "root") and not inside.exists()
    assert not remove_tree(inside, tmp_path / "root")  # already gone


def test_remove_tree_never_deletes_root_home_or_the_repository():
    for path, root in ((REPO_ROOT, REPO_ROOT.parent), (Path.home(), Path.home().parent), ("/", "/")):
        with pytest.raises(UnsafeDeleteError):
            remove_tree(path, root)
    assert REPO_ROOT.is_dir() and Path.home().is_dir()


def test_remove_tree_unlinks_a_symlink_and_keeps_its_target(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "f").write_text("x")
    (tmp_path / "root").mkdir()
    link = tmp_path / "root" / "link"
    link.symlink_to(target)
    assert remove_tree(link, tmp_path / "root")
    assert not link.is_symlink() and (target / "f").read_text() == "x"


def test_remove_owned_deletes_only_empty_or_stamped_folders(tmp_path):
    empty, stamped, foreign = tmp_path / "empty", tmp_path / "stamped", tmp_path / "foreign"
    for d in (empty, stamped, foreign):
        d.mkdir()
    (stamped / "STAMP").write_text("{}")
    (stamped / "weights").write_text("w")
    (foreign / "thesis.tex").write_text("years of work")
    assert remove_owned(empty, tmp_path, "STAMP") and not empty.exists()
    assert remove_owned(stamped, tmp_path, "STAMP") and not stamped.exists()
    with pytest.raises(UnsafeDeleteError, match="holds no STAMP"):
        remove_owned(foreign, tmp_path, "STAMP")
    assert (foreign / "thesis.tex").read_text() == "years of work"
    assert not remove_owned(tmp_path / "absent", tmp_path, "STAMP")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UnsafeDeleteError, match="not a folder"):
        remove_owned(tmp_path / "file", tmp_path, "STAMP")


def test_replace_durably_moves_a_folder_and_write_atomic_leaves_old_or_new(tmp_path, monkeypatch):
    src = tmp_path / "staged"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_text("new")
    replace_durably(src, tmp_path / "dst")
    assert (tmp_path / "dst" / "sub" / "f").read_text() == "new" and not src.exists()
    path = tmp_path / "doc.json"
    write_atomic(path, "old")

    def torn(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", torn)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["doc.json", "dst"]


def test_open_lock_neither_truncates_nor_follows_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "lock").symlink_to(victim)
    with pytest.raises(OSError):
        open_lock(tmp_path / "lock")
    own = tmp_path / "own.lock"
    own.write_text("kept")
    os.close(open_lock(own))
    assert own.read_text() == "kept" and victim.read_text() == "precious"
