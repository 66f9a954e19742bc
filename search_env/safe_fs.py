"""File-system writes and deletes that survive a kill and stay inside what the caller owns.

Every recursive delete of product code goes through :func:`remove_tree`, which refuses a path outside
its declared root and never deletes `/`, the home folder or the repository. Replaces are preceded by
an fsync (:func:`replace_durably`, :func:`write_atomic`); locks are opened without truncation and
without following a symlink (:func:`open_lock`). Why and where: docs/security.md.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from search_env.paths import REPO_ROOT


class UnsafeDeleteError(ValueError):
    """A recursive delete was asked for a path its root does not hold, or for a protected folder."""


def _protected() -> set[Path]:
    return {Path("/"), Path.home().resolve(), REPO_ROOT.resolve()}


def _lexical(path: str | os.PathLike[str]) -> Path:
    """``path`` absolute, its parent resolved but its last part kept (a symlink is not followed)."""
    p = Path(path).expanduser().absolute()
    return p.parent.resolve() / p.name


def check_inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """``path`` as :func:`remove_tree` would delete it; UnsafeDeleteError when ``root`` does not hold
    it strictly (``path == root`` is refused too) or when it is `/`, the home folder or the repo."""
    target, owner = _lexical(path), Path(root).expanduser().resolve()
    if target.name in ("", ".", "..") or not target.is_relative_to(owner) or target == owner:
        raise UnsafeDeleteError(f"refusing to delete {target}: it is not inside its root {owner}")
    if target in _protected() or owner == Path("/"):
        raise UnsafeDeleteError(
            f"refusing to delete {target} under root {owner}: `/`, the home folder and the repository "
            "are never deleted; give a folder of your own"
        )
    return target


def remove_tree(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Delete ``path`` (a folder, a file or a symlink, which is removed, not followed) when ``root``
    holds it (:func:`check_inside`); False when it did not exist. Raises UnsafeDeleteError before
    deleting anything otherwise."""
    target = check_inside(path, root)
    if target.is_symlink() or target.is_file():
        target.unlink()
        return True
    if not target.exists():
        return False
    shutil.rmtree(target)
    return True


def check_owned(path: str | os.PathLike[str], root: str | os.PathLike[str], stamp: str) -> Path | None:
    """``path`` as :func:`remove_owned` would delete it (None when absent): an empty folder, or a folder
    holding the file ``stamp`` (its builder's own mark), inside ``root``; UnsafeDeleteError otherwise."""
    target = check_inside(path, root)
    if not target.exists() and not target.is_symlink():
        return None
    if target.is_symlink() or not target.is_dir():
        raise UnsafeDeleteError(f"refusing to delete {target}: it is not a folder")
    if any(target.iterdir()) and not (target / stamp).is_file():
        raise UnsafeDeleteError(
            f"refusing to delete {target}: it is not empty and holds no {stamp}, so this program did "
            "not write it"
        )
    return target


def remove_owned(path: str | os.PathLike[str], root: str | os.PathLike[str], stamp: str) -> bool:
    """:func:`remove_tree` of ``path`` only when it is what its builder wrote (:func:`check_owned`);
    False when absent. Raises UnsafeDeleteError naming ``stamp`` before deleting anything otherwise."""
    target = check_owned(path, root, stamp)
    return target is not None and remove_tree(target, root)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync ``path``: a file, or a folder with every file and folder under it (symlinks skipped)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        for sub, _dirs, files in os.walk(path):
            for name in files:
                if not os.path.islink(os.path.join(sub, name)):
                    fsync_file(os.path.join(sub, name))
            fsync_dir(sub)
    elif path.is_file() and not path.is_symlink():
        fsync_file(path)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync one file's data and metadata."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder, so that a rename or create inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """``os.replace(src, dst)`` after fsyncing ``src`` (a file, or a folder and all it holds), then
    fsync the folders of ``dst`` and ``src``. A folder ``dst`` must be absent or empty (os.replace)."""
    fsync_tree(src)
    os.replace(src, dst)
    fsync_dir(Path(dst).absolute().parent)
    if Path(src).absolute().parent != Path(dst).absolute().parent:
        fsync_dir(Path(src).absolute().parent)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` by a temp file in its folder, fsync, rename, folder fsync: a reader
    sees the old file or the new one, never a torn one. The file gets the mode a plain ``open`` would
    (0666 less the umask)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def open_lock(path: str | os.PathLike[str]) -> int:
    """A file descriptor for ``path`` to ``flock``: created at mode 600 if missing, never truncated,
    and refused (OSError ELOOP) when ``path`` is a symlink."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def user_runtime_dir() -> Path:
    """The user's own runtime folder for locks: ``$XDG_RUNTIME_DIR`` when set, else
    ``~/.cache/rlvr-search`` (created at mode 700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "rlvr-search" if base else Path.home() / ".cache" / "rlvr-search"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder
