"""``python -m launch COMMAND ...``: run, eval, prepare, preflight, resume, retriever (``--help`` of each)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from launch import evaluate, preflight, prepare, resume, retriever, train

COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "run": (train.main, "train one recipe end to end (launch/run.sh)"),
    "eval": (evaluate.main, "evaluate every checkpoint of a run (launch/eval.sh)"),
    "prepare": (prepare.main, "fetch what the GPU recipes need (launch/prepare.sh)"),
    "preflight": (preflight.main, "check a recipe's prerequisites and write its run setup"),
    "resume": (resume.main, "strays of an earlier run; the checkpoint to resume from"),
    "retriever": (retriever.main, "serve the retriever a recipe describes (launch/serve_retriever.sh)"),
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in COMMANDS:
        lines = "\n".join(f"  {name:10} {text}" for name, (_, text) in COMMANDS.items())
        print(f"usage: python -m launch COMMAND [args...]\n\ncommands:\n{lines}", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    command, _ = COMMANDS[args[0]]
    return int(command(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
