"""Shared pieces of the command lines (argparse types)."""

from __future__ import annotations

import argparse
import os
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


def alias_path(value: str, maybe_name: bool = False) -> str:
    """A path given on a command line, made absolute against this folder (recipes' paths are relative
    to the repository); ``maybe_name``: kept as given unless it exists (a suite: a path or a name)."""
    if maybe_name and not os.path.exists(os.path.expanduser(value)):
        return value
    return os.path.abspath(os.path.expanduser(value))
