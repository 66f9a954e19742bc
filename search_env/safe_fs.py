"""File-system writes and deletes that survive a kill and stay inside what the caller owns.

Every recursive delete of product code goes through :func:`remove_tree`, which refuses a path outside
its declared root, never deletes `/`, the home folder or the repository, and walks from the root by
folder descriptors that never follow a symlink. Results are copied by :func:`copy_regular` (regular
files only, no symlink followed). Replaces are preceded by
an fsync (:func:`replace_durably`, :func:`write_atomic`); locks are opened without truncation and
without following a symlink (:func:`open_lock`). Why and where: docs/security.md.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

from search_env.paths import REPO_ROOT


class UnsafeDeleteError(ValueError):
    """A recursive delete was asked for a path its root does not hold, or for a protected folder."""


class NotRegularFileError(ValueError):
    """A file to copy or read is a symlink, a folder or a special file."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _protected() -> set[Path]:
    return {Path("/"), Path.home().resolve(), REPO_ROOT.resolve()}


def _lexical(path: str | os.PathLike[str]) -> Path:
    """``path`` absolute, its parent resolved but its last part kept (a symlink is not followed)."""
    p = Path(path).expanduser().absolute()
    return p.parent.resolve() / p.name


def check_root(root: str | os.PathLike[str]) -> Path:
    """``root`` resolved, when it may hold deletes: UnsafeDeleteError for `/`, the home folder, the
    repository and the working directory given as ``''`` or ``.`` (a relative root naming it)."""
    given = Path(root).expanduser()
    owner = given.resolve()
    if owner in _protected() or (not given.is_absolute() and owner == Path.cwd().resolve()):
        raise UnsafeDeleteError(
            f"refusing to delete under the root {str(root)!r} ({owner}): `/`, the home folder, the "
            "repository and the working directory are never a delete's root; give a folder of your own"
        )
    return owner


def check_inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """``path`` as :func:`remove_tree` would delete it; UnsafeDeleteError when ``root`` may not hold
    deletes (:func:`check_root`), does not hold ``path`` strictly, or ``path`` is or holds `/`, the
    home folder or the repository."""
    owner = check_root(root)
    target = _lexical(path)
    if target.name in ("", ".", "..") or not target.is_relative_to(owner) or target == owner:
        raise UnsafeDeleteError(f"refusing to delete {target}: it is not inside its root {owner}")
    if any(kept.is_relative_to(target) for kept in _protected()):
        raise UnsafeDeleteError(
            f"refusing to delete {target}: it is or holds `/`, the home folder or the repository"
        )
    return target


def remove_tree(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Delete ``path`` (a folder, a file or a symlink, which is removed, not followed) when ``root``
    holds it (:func:`check_inside`); False when it did not exist. Raises UnsafeDeleteError before
    deleting anything otherwise. Every step goes through folder descriptors opened from ``root``
    without following a symlink, so a folder swapped for a link mid-delete is never entered
    (docs/security.md "What is never deleted or torn")."""
    target = check_inside(path, root)
    owner = check_root(root)
    *folders, name = target.relative_to(owner).parts
    try:
        fd = os.open(owner, _DIR_FLAGS)
    except FileNotFoundError:
        return False
    try:
        for part in folders:
            try:
                inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return False
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise UnsafeDeleteError(
                    f"refusing to delete {target}: {part} on its way from {owner} is not a folder (a symlink?)"
                ) from None
            os.close(fd)
            fd = inner
        return _remove_entry(fd, name)
    finally:
        os.close(fd)


def _remove_entry(dir_fd: int, name: str) -> bool:
    """Delete ``name`` in the folder ``dir_fd``: unlink a file or symlink, empty and rmdir a folder
    (entered by descriptor, never through a symlink). False when absent."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return True
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)  # ELOOP if it became a symlink since the stat
    try:
        with os.scandir(fd) as entries:
            names = [entry.name for entry in entries]
        for inner in names:
            _remove_entry(fd, inner)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)
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


def clear_owned(folder: str | os.PathLike[str], stamp: str) -> None:
    """Empty ``folder`` (the root of every delete here) when it is empty or holds the file ``stamp``;
    UnsafeDeleteError naming ``stamp`` before deleting anything otherwise. An absent folder is fine."""
    owner = check_root(folder)
    if not owner.exists():
        return
    if not owner.is_dir():
        raise UnsafeDeleteError(f"refusing to delete {owner}: it is not a folder")
    names = [p.name for p in owner.iterdir()]
    if names and stamp not in names:
        raise UnsafeDeleteError(
            f"refusing to delete what {owner} holds: it holds no {stamp}, so this program did not write it"
        )
    for name in names:
        remove_tree(owner / name, owner)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for reading, without following a symlink; NotRegularFileError naming it when it
    is a symlink, a folder, a FIFO or a device (results and exports hold regular files only)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise NotRegularFileError(f"{path} is a symlink, not a regular file") from None
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        what = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
        raise NotRegularFileError(f"{path} is {what.get(kind, 'a device')}, not a regular file")
    return os.fdopen(fd, "rb")


def copy_regular(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy the regular file ``src`` (:func:`open_regular`) to the new file ``dst``, which is created,
    never followed through a symlink nor overwritten."""
    with open_regular(src) as source:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "wb") as target:
            shutil.copyfileobj(source, target, 16 << 20)


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
