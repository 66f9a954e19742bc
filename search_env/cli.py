"""Shared pieces of the command lines (argparse types)."""

from __future__ import annotations

import argparse
from typing import Any


def positive_int(text: str) -> int:
    """argparse type of a count that must be at least 1 (ArgumentTypeError naming the value)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def hydra_quoted(value: Any) -> str:
    """``value`` as a hydra quoted string (commas, colons and slashes kept as they are)."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"
