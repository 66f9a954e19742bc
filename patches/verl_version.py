"""The verl release these patches were written against, and a loud warning on any other.

Every patch module adapts private verl internals (file/line named in its docstring), so a
different verl may break them silently; ``tests/patches/test_patches.py`` pins each behaviour.
"""

from __future__ import annotations

import logging

import verl

SUPPORTED_VERL = "0.9.1"
logger = logging.getLogger(__name__)


def verl_version_supported() -> bool:
    """True when the installed verl is the release the patches target."""
    return getattr(verl, "__version__", None) == SUPPORTED_VERL


def warn_if_unsupported() -> None:
    """Log a warning naming both versions when verl is not ``SUPPORTED_VERL``."""
    if not verl_version_supported():
        logger.warning(
            "rlvr-search patches target verl==%s but verl %s is installed; pin verl==%s",
            SUPPORTED_VERL,
            getattr(verl, "__version__", "?"),
            SUPPORTED_VERL,
        )
