"""Old module names that still work after the demo and the CPU engine left ``search_env``.

Each old module (``search_env/cpu/<name>.py``, ``search_env/world.py``) only calls
:func:`forward`: imported, it is the new module under the old name; run with ``python -m``, it
runs the new command. Either way it first prints one deprecation line with the new name.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings


def forward(old: str, new: str, as_main: bool, command: str | None = None) -> None:
    """Stand in for module ``old`` (its ``__spec__.name``), now ``new``.

    ``as_main``: the old module runs under ``python -m`` (its ``__name__ == "__main__"``); then
    ``python -m <command>`` (default ``new``) runs in its place, with the same arguments.
    """
    command = command or new
    if as_main:
        print(f"deprecated: python -m {old} is now python -m {command}", file=sys.stderr)
        runpy.run_module(command, run_name="__main__", alter_sys=True)
        return
    warnings.warn(f"{old} moved to {new}; import {new}", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
