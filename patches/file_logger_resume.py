"""Keep the file logger's history across a resume, each step exactly once.

Upstream: ``verl/utils/tracking.py`` — ``FileLogger.__init__`` (line 541 in 0.9.1) opens the
JSONL file with ``open(path, "wb")``, so resuming a run truncates every metric logged before
the checkpoint.

Patch: the module-global name ``open`` of ``verl.utils.tracking`` maps mode ``"wb"`` (used only
by ``FileLogger``) to ``"ab"``, every other call passes through; on the first ``log(step)`` after opening, drop lines whose step is
``>= step`` (written after the checkpoint that training resumes from, by a run that was then
killed) and a torn last line, rewriting the file atomically and durably (``safe_fs.write_atomic``: temp file, fsync, rename), so each
step appears exactly once. Line format is unchanged: ``{"step": N, "data": {...}}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from patches.post_import import when_imported
from search_env.safe_fs import write_atomic

TARGET = "verl.utils.tracking"
PATCHED_FLAG = "_rlvr_append"


def kept_lines(path: Path, first_new_step: int) -> tuple[list[bytes], bool]:
    """Lines of an existing log that precede ``first_new_step``, and whether any were dropped."""
    kept, dropped = [], False
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            dropped = True  # a torn or foreign line
            continue
        if line.endswith(b"\n") and isinstance(step, int) and step < first_new_step:
            kept.append(line)
        else:
            dropped = True
    return kept, dropped


def _patch(module: ModuleType) -> None:
    logger_cls = module.FileLogger
    if getattr(logger_cls, PATCHED_FLAG, False):
        return
    original_log = logger_cls.log

    def append_instead_of_truncate(file, mode="r", *args, **kwargs):
        return open(file, "ab" if mode == "wb" else mode, *args, **kwargs)

    def log(self, data, step):
        if not getattr(self, "_rlvr_checked", False):
            self._rlvr_checked = True
            path = Path(self.filepath)
            kept, dropped = kept_lines(path, step)
            if dropped:
                self.fp.close()
                write_atomic(path, b"".join(kept))
                self.fp = open(path, "ab", buffering=0)  # noqa: SIM115
        return original_log(self, data, step)

    module.open = append_instead_of_truncate
    logger_cls.log = log
    setattr(logger_cls, PATCHED_FLAG, True)


def install() -> None:
    """Patch ``FileLogger`` when (or if already) ``verl.utils.tracking`` is imported."""
    when_imported(TARGET, _patch)
