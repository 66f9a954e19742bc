"""``python -m study list|run|report STUDY.yaml``: a reward-design study from one file (docs/studies.md)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from eval.report.results import ResultsError
from eval.run.checkpoints import get_dotted
from launch.preflight import visible_gpus
from search_env.cli import positive_int
from study.cost import cost_table
from study.hypotheses import parse_tests
from study.report import write_study_report
from study.runner import run_study
from study.spec import Study, StudyError, load_study, recipe_tree
from study.store import layout


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m study", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("list", "print the cells"),
        ("run", "train and evaluate every cell"),
        ("report", "write the reports"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument("study", type=Path, help="study file, e.g. recipes/studies/micro_sparse.yaml")
        s.add_argument("--runs", type=Path, help="run folders (default runs/<study name>)")
        s.add_argument("--results", type=Path, help="evaluation results (default results/<study name>)")
        s.add_argument("--export", type=Path, help="export folder (default: the file's export)")
        s.add_argument("--cells", nargs="+", help="only these cells, in this order")
    lst = sub.choices["list"]
    lst.add_argument(
        "--gpu-hours", action="store_true", help="estimate each cell's GPU-hours from the stated costs"
    )
    lst.add_argument(
        "--step-seconds", type=float, help="GPU-seconds per training step (default: the file's cost)"
    )
    lst.add_argument(
        "--rollout-seconds", type=float, help="GPU-seconds per evaluation rollout (default: the file's)"
    )
    run = sub.choices["run"]
    run.add_argument(
        "--jobs", type=positive_int, help="cells side by side (default: 2 on CPU, 1 on a GPU node)"
    )
    run.add_argument("--gpus-per-cell", type=positive_int, help="GPU node: split the visible GPUs K per cell")
    run.add_argument(
        "--port", type=int, default=18500, help="retriever port of lane 0 (lane j: +10 j; eval +1)"
    )
    run.add_argument("--no-report", action="store_true", help="do not write the reports at the end")
    run.add_argument("--train-only", action="store_true", help="train every cell; no evaluation or report")
    run.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="hydra overrides for every cell (after its own)",
    )
    sub.choices["report"].add_argument("--out", type=Path, help="report folder (default EXPORT/report)")
    sub.choices["report"].add_argument(
        "--no-figures",
        action="store_true",
        help="tables and statistics only: no PNG is drawn (each is listed)",
    )
    return p


def select(study: Study, names: list[str] | None) -> list:
    return [study.cell(n) for n in names] if names else list(study.cells)


def print_list(study: Study, cells: list, gpu_hours: bool, args: argparse.Namespace) -> None:
    print(
        f"study {study.name} ({study.path}): {len(cells)} cells, trees {', '.join(t or 'main' for t in study.trees)}"
    )
    for c in cells:
        save = get_dotted(recipe_tree(c.recipe), "trainer.save_freq")
        print(f"{c.name}  cap={c.cap}  tree={c.tree or 'main'}  save_freq={save}  recipe={c.recipe.name}")
        print(f"    {shlex.join(c.overrides)}")
    table = cost_table(study, cells, args.step_seconds, args.rollout_seconds)
    if gpu_hours:
        print()
        print(table)
    else:
        total = table.splitlines()[-1].split("|")
        print(
            f"estimated: {total[2].strip()} training steps, {total[3].strip()} checkpoint evaluations, "
            f"{total[7].strip()} GPU-h at the file's stated costs (--gpu-hours: per cell)"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        study = load_study(args.study)
        parse_tests(study.spec.tests, {a for c in study.cells for a in c.axes})
        cells = select(study, args.cells)
        where = layout(study, args.runs, args.results, args.export)
        if args.command == "list":
            print_list(study, cells, args.gpu_hours, args)
            return 0
        if args.command == "run":
            gpus = visible_gpus()
            jobs = args.jobs or (1 if gpus else 2)
            for override in args.set:
                if "=" not in override:
                    raise StudyError(
                        f"--set {override}: not KEY=VALUE. Fix: e.g. --set data.train_batch_size=4"
                    )
            echo = lambda line: print(line, file=sys.stderr)  # noqa: E731
            run_study(
                study,
                where,
                cells,
                jobs,
                args.port,
                args.gpus_per_cell,
                echo,
                tuple(args.set),
                args.train_only,
            )
            if args.no_report or args.train_only:
                return 0
        draw = not getattr(args, "no_figures", False)  # `run` writes the report too, with figures
        for path in write_study_report(study, where, getattr(args, "out", None), draw=draw):
            print(path)
        return 0
    except (StudyError, ResultsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
