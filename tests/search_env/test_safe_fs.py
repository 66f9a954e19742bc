"""search_env.safe_fs: deletes stay inside their root (walked by descriptor, a folder swapped for a
symlink mid-delete is never entered) and spare `/`, home and the repository; a builder deletes only
what it stamped; results are copied only from regular files; replaces and writes are whole or absent."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from test_import_graph import PACKAGES

from search_env import safe_fs
from search_env.paths import REPO_ROOT
from search_env.safe_fs import (
    NotRegularFileError,
    UnsafeDeleteError,
    clear_owned,
    copy_regular,
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


@pytest.mark.parametrize(
    ("root", "path"),
    [
        ("/", "/no-such-folder-rlvr"),
        ("~", "~/no-such-folder-rlvr"),
        (Path.home(), Path.home() / "no-such-folder-rlvr"),
        (REPO_ROOT, REPO_ROOT / "no-such-folder-rlvr"),
        (f"{REPO_ROOT}/", REPO_ROOT / ".git" / "no-such-folder-rlvr"),
        ("", "victim"),
        (".", "victim"),
    ],
)
def test_remove_tree_refuses_root_home_the_repository_and_the_working_directory_as_root(
    root, path, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "victim").mkdir()
    with pytest.raises(UnsafeDeleteError, match="never a delete's root"):
        remove_tree(path, root)
    assert (tmp_path / "victim").is_dir()


def test_remove_tree_refuses_a_path_holding_the_home_folder_or_the_repository():
    for path in (REPO_ROOT, REPO_ROOT.parent, Path.home()):
        if path.parent != Path("/"):
            with pytest.raises(UnsafeDeleteError, match="home folder or the repository"):
                remove_tree(path, path.parent)


def _two_trees(tmp_path: Path) -> tuple[Path, Path]:
    """``root/a/b/f`` (to delete) and ``outside/b/f`` (never to delete)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    for top, text in ((root / "a", "own"), (outside, "precious")):
        (top / "b" / "sub").mkdir(parents=True)
        (top / "b" / "f").write_text(text)
        (top / "b" / "sub" / "g").write_text(text)
    return root, outside


def test_a_parent_swapped_for_a_symlink_after_the_check_deletes_nothing_outside(tmp_path, monkeypatch):
    """The check passes on the real folder ``root/a``; then ``a`` becomes a symlink to ``outside``.
    The walk from the root's descriptor refuses to enter it."""
    root, outside = _two_trees(tmp_path)
    checked = safe_fs.check_inside

    def check_then_swap(path, owner):
        target = checked(path, owner)
        (root / "a").rename(tmp_path / "a.moved")
        (root / "a").symlink_to(outside)
        return target

    monkeypatch.setattr(safe_fs, "check_inside", check_then_swap)
    with pytest.raises(UnsafeDeleteError, match="not a folder"):
        remove_tree(root / "a" / "b", root)
    assert (outside / "b" / "f").read_text() == "precious"
    assert (outside / "b" / "sub" / "g").read_text() == "precious"


def test_a_folder_swapped_for_a_symlink_mid_delete_is_not_entered(tmp_path, monkeypatch):
    """``sub`` is listed as a folder, then swapped for a symlink to ``outside/b`` just before it is
    opened: the open refuses the link (ELOOP) and ``outside`` keeps everything."""
    root, outside = _two_trees(tmp_path)
    real_open = os.open

    def swap_then_open(path, flags, mode=0o777, *, dir_fd=None):
        if path == "sub" and dir_fd is not None and not (root / "a" / "b" / "sub").is_symlink():
            (root / "a" / "b" / "sub").rename(tmp_path / "sub.moved")
            (root / "a" / "b" / "sub").symlink_to(outside / "b")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", swap_then_open)
    with pytest.raises(OSError):
        remove_tree(root / "a" / "b", root)
    monkeypatch.undo()
    assert (outside / "b" / "f").read_text() == "precious"
    assert (outside / "b" / "sub" / "g").read_text() == "precious"


def test_clear_owned_empties_only_a_marked_folder_which_is_its_root(tmp_path):
    smoke = tmp_path / "smoke"
    clear_owned(smoke, "MARK")  # absent: nothing to do
    smoke.mkdir()
    (smoke / "MARK").write_text("")
    (smoke / "logs").mkdir()
    (smoke / "logs" / "a.log").write_text("x")
    clear_owned(smoke, "MARK")
    assert smoke.is_dir() and not any(smoke.iterdir())
    (smoke / "thesis.tex").write_text("years of work")
    with pytest.raises(UnsafeDeleteError, match="holds no MARK"):
        clear_owned(smoke, "MARK")
    assert (smoke / "thesis.tex").read_text() == "years of work"
    for protected in ("/", Path.home(), REPO_ROOT):
        with pytest.raises(UnsafeDeleteError, match="never a delete's root"):
            clear_owned(protected, "MARK")


def test_copy_regular_refuses_a_symlink_a_fifo_and_a_folder_naming_it(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("private")
    (tmp_path / "link").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    for name, kind in (("link", "a symlink"), ("fifo", "a FIFO"), ("folder", "a folder")):
        with pytest.raises(NotRegularFileError, match=f"{name} is {kind}"):
            copy_regular(tmp_path / name, tmp_path / f"{name}.copy")
        assert not (tmp_path / f"{name}.copy").exists()
    copy_regular(secret, tmp_path / "copy")
    assert (tmp_path / "copy").read_text() == "private"
    with pytest.raises(FileExistsError):
        copy_regular(secret, tmp_path / "copy")


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


SCANNED = (*PACKAGES, "bench")
"""Every product package and bench/ (tests/ may delete and rename freely inside tmp_path)."""
BANNED = {
    ("shutil", "rmtree"),
    ("shutil", "move"),
    ("os", "replace"),
    ("os", "rename"),
    ("os", "renames"),
    ("os", "removedirs"),
}


def unsafe_calls(source: str) -> list[str]:
    """Recursive deletes and renames in ``source`` that bypass safe_fs: ``shutil.rmtree``/``move``,
    ``os.replace``/``rename``/``renames``/``removedirs`` (called or imported by name), and a
    ``Path.replace``/``rename`` (a ``.replace(x)``/``.rename(x)`` call with one positional argument and
    no keywords: ``str.replace`` takes two, pandas' ``rename`` takes keywords)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil"):
            found += [
                f"{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if (node.module, a.name) in BANNED
            ]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            one_arg = len(node.args) == 1 and not node.keywords and node.func.attr in ("replace", "rename")
            if (owner, node.func.attr) in BANNED or one_arg:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_unsafe_calls_finds_each_kind():
    source = "import os, shutil\nfrom shutil import rmtree\nshutil.rmtree(p)\nos.replace(a, b)\np.rename(q)\n"
    source += "s.replace('a', 'b')\nframe.rename(columns={})\n"
    assert [f.split(":")[0] for f in unsafe_calls(source)] == ["2", "3", "4", "5"]


def test_every_delete_and_replace_goes_through_safe_fs():
    """Product code deletes a tree only by safe_fs.remove_tree (inside a declared root) and replaces a
    file or folder only by safe_fs.replace_durably / write_atomic (fsync first): no other module may
    call shutil.rmtree, os.replace and the like."""
    offenders = {
        str(path.relative_to(REPO_ROOT)): found
        for package in SCANNED
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
        if path != REPO_ROOT / "search_env" / "safe_fs.py"
        and (found := unsafe_calls(path.read_text(encoding="utf-8")))
    }
    assert not offenders, f"use search_env.safe_fs (remove_tree, replace_durably, write_atomic): {offenders}"
