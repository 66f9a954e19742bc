"""``python -m study list|run|report|cell|retrievers|status STUDY.yaml``: a reward-design study from
one file (docs/studies.md), locally or on a Slurm or Ray cluster (docs/cluster.md)."""

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
from study.ray_jobs import run_on_ray
from study.report import write_study_report
from study.retrievers import serve_here, start_on_ray
from study.runner import run_study
from study.slurm import finished, queue_or_none, submit_retrievers, submit_study
from study.spec import Study, StudyError, load_study, recipe_tree
from study.stage import RETRIEVERS, STAGES, cell_main
from study.status import print_status
from study.store import Layout, layout


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m study", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("list", "print the cells"),
        ("run", "train and evaluate every cell"),
        ("report", "write the reports"),
        ("cell", "run one stage of one cell here (what a cluster job runs)"),
        ("retrievers", "start one retriever per cluster node, or serve one here (--serve)"),
        ("status", "what is done, queued, running or failed"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument("study", type=Path, help="study file, e.g. recipes/studies/micro_sparse.yaml")
        s.add_argument("--runs", type=Path, help="run folders (default runs/<study name>)")
        s.add_argument("--results", type=Path, help="evaluation results (default results/<study name>)")
        s.add_argument("--export", type=Path, help="export folder (default: the file's export)")
        if name in ("list", "run", "report", "status", "retrievers"):
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
        "--on",
        choices=("local", "slurm", "ray"),
        default="local",
        help="local: here (default); slurm or ray: submit every stage as a cluster job and exit",
    )
    cell = sub.choices["cell"]
    cell.add_argument("--cell", help="the cell (study list names them); the report stage needs none")
    cell.add_argument("--stage", required=True, choices=STAGES, help="train, eval (both splits) or report")
    cell.add_argument(
        "--port", type=int, help="training's retriever port (evaluation: +1; default: a free pair)"
    )
    ret = sub.choices["retrievers"]
    for s in (run, cell, ret):
        s.add_argument(
            "--set",
            nargs="+",
            default=[],
            metavar="KEY=VALUE",
            help="hydra overrides for every cell (after its own)",
        )
    for s in (run, cell):
        s.add_argument(
            "--retrievers",
            choices=RETRIEVERS,
            default="private",
            help="private: each stage starts its own on loopback; published: the URLs in RUNS/retrievers/",
        )
    ret.add_argument("--on", choices=("slurm", "ray"), help="the cluster to start them on")
    ret.add_argument("--serve", action="store_true", help="serve one here (what each node's job runs)")
    ret.add_argument("--port", type=int, help="each retriever's port on its node (default: the recipe's)")
    ret.add_argument("--host", help="--serve: the address to bind (default: this node's private IP)")
    ret.add_argument(
        "--nodes", nargs="+", default=[], help="slurm: the nodes to start one on (one CPU job each)"
    )
    for s in (run, ret):
        g = s.add_argument_group("slurm (--on slurm)")
        g.add_argument("--partition", help="#SBATCH --partition")
        g.add_argument("--account", help="#SBATCH --account")
        g.add_argument(
            "--time", help="#SBATCH --time of each GPU stage, e.g. 24:00:00 (site default if unset)"
        )
        g.add_argument("--dry-run", action="store_true", help="print the jobs and scripts; submit nothing")
        g.add_argument(
            "--sbatch-line",
            action="append",
            default=[],
            metavar="LINE",
            help="a site #SBATCH line for every job, e.g. '--qos=normal' (repeatable)",
        )
        r = s.add_argument_group("ray (--on ray)")
        r.add_argument("--address", help="the Ray dashboard, e.g. http://10.0.0.1:8265")
    run.add_argument(
        "--signal-s",
        type=positive_int,
        default=300,
        help="slurm: seconds before the time limit at which a train job stops and requeues itself",
    )
    run.add_argument("--max-retries", type=int, default=2, help="ray: resubmissions of a failed stage")
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


def cluster_run(study: Study, where: Layout, cells: list, args: argparse.Namespace) -> int:
    """``run --on slurm|ray``: submit the stages and exit."""
    if args.on == "slurm":
        return submit_study(study, where, cells, args)
    if not args.address:
        raise StudyError("--on ray: needs --address. Fix: e.g. --address http://HEAD_IP:8265")
    return run_on_ray(study, where, cells, args)


def retrievers_main(study: Study, where: Layout, args: argparse.Namespace) -> int:
    """``retrievers``: ``--serve`` one here, or start one per node ``--on slurm|ray``."""
    if args.serve:
        return serve_here(study, where, args)
    if args.on == "slurm":
        return submit_retrievers(study, where, args)
    if args.on == "ray":
        if not args.address:
            raise StudyError("--on ray: needs --address. Fix: e.g. --address http://HEAD_IP:8265")
        return start_on_ray(study, where, args)
    raise StudyError("retrievers: needs --on slurm|ray or --serve. Fix: e.g. --on slurm --nodes n1 n2")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        study = load_study(args.study)
        parse_tests(study.spec.tests, {a for c in study.cells for a in c.axes})
        cells = select(study, getattr(args, "cells", None))
        where = layout(study, args.runs, args.results, args.export)
        for override in getattr(args, "set", []):
            if "=" not in override:
                raise StudyError(f"--set {override}: not KEY=VALUE. Fix: e.g. --set data.train_batch_size=4")
        if args.command == "cell":
            return cell_main(study, where, args)
        if args.command == "retrievers":
            return retrievers_main(study, where, args)
        if args.command == "status":
            prefix = f"{study.name}."
            return print_status(study, where, cells, queue_or_none(prefix, True), finished(prefix))
        if args.command == "run" and args.on != "local":
            return cluster_run(study, where, cells, args)
        if args.command == "list":
            print_list(study, cells, args.gpu_hours, args)
            return 0
        if args.command == "run":
            gpus = visible_gpus()
            jobs = args.jobs or (1 if gpus else 2)
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
