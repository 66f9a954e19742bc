"""Command line of the evaluation harness (docs/evaluation.md): each command's flags live with its module.

python -m eval run ...     evaluate a run's checkpoints (eval/run/cli.py)
python -m eval plan ...    rows per benchmark for a precision (eval/report/plan_rows.py)
python -m eval select ...  each run's selected checkpoints (eval/report/select.py)
python -m eval report ...  tables, statistics and figures (eval/report/document.py)

``python -m eval COMMAND --help`` lists a command's flags.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": "eval.run.cli",
    "plan": "eval.report.plan_rows",
    "select": "eval.report.select",
    "report": "eval.report.document",
}
"""Command -> the module whose ``main(argv)`` runs it (imported only when chosen: pandas, verl, torch)."""


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv[0]`` names; 0 with the usage for ``-h``/``--help``, 2 with it otherwise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    return int(importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
