"""When the patches switch on, and the one log line each prints when it installs.

Installing rlvr-search changes no verl run that does not use it. In a process that imports verl,
``patches/__init__.py`` installs:

- ``RUN`` (the study's metrics and retriever stop rule, the resumable metrics log, the ``hf``
  rollout backend) when the run uses rlvr-search (:func:`run_uses_rlvr_search`: ``RUN_ENV=1``,
  which ``launch/train.py`` exports to the trainer and every Ray worker), or in CPU mode;
- ``CPU_MODE_ONLY`` (the ``cpu`` platform and everything verl and vLLM need to train on CPU) in
  CPU mode (:func:`cpu_compat.cpu_mode.cpu_mode_active`);
- nothing otherwise: not even a post-import hook.
"""

from __future__ import annotations

import logging
import os

RUN_ENV = "RLVR_SEARCH_PATCHES"
"""``1``: this run uses rlvr-search's agent loop, tool or reward, so the ``RUN`` patches apply."""

logger = logging.getLogger("rlvr_search.patches")
logger.setLevel(logging.INFO)  # verl's basic config (WARNING) would hide the lines that name each patch


def run_uses_rlvr_search() -> bool:
    """Whether this process belongs to a run that declared it uses rlvr-search (``RUN_ENV=1``)."""
    return os.environ.get(RUN_ENV, "").strip() == "1"


def announce(module: str, target: str, why: str) -> None:
    """Log ``rlvr-search: patched <target> (<why>) [patches/<file>.py]`` for patch module ``module``."""
    logger.info("rlvr-search: patched %s (%s) [%s.py]", target, why, module.replace(".", "/"))
