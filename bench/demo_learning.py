"""Does the CPU demo learn? Runs it end to end and checks its learning targets
(``check``).

    .venv/bin/python -m bench.demo_learning [--run-dir runs/demo_learning] [--other-world-seed 1]
                                            [--check-only] [hydra overrides...]

1. ``python -m search_demo run --also-world-seed S2``: world + warm start (cached in
   .demo/), GRPO through ``launch/run.sh recipes/demo_cpu.yaml``, ``launch/eval.sh`` of step 0
   and the last step on 100 held-out test questions per type of the training world and of a
   world of another seed (new names, new corpus);
2. checks, from ``RUN/demo_report.json``:
   - held-out EM after GRPO >= step-0 EM + 0.15 (all questions), two-hop EM rising too;
   - reward/mean over the last 5 steps above the first 5;
   - the same EM targets on the other seed's world.
Prints each target with its numbers, the wall time and the machine load (``os.getloadavg``:
the machine may be shared), and exits 1 if a target is missed. ``--check-only`` re-checks a
finished run. A speed or learning benchmark, not a test: it takes ~10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from eval.stats import mean
from search_demo.driver import main as demo_main
from search_env.paths import REPO_ROOT

EM_GAIN = 0.15


def check(report: dict) -> list[tuple[str, bool, str]]:
    """(target, met, numbers) for every learning target of the demo (the module docstring lists them)."""
    out = []
    rewards = [s["reward/mean"] for s in report["steps"]]
    first, last = mean(rewards[:5]), mean(rewards[-5:])
    out.append(("reward/mean: last 5 steps > first 5", last > first, f"{first:.3f} -> {last:.3f}"))
    for _, ev in sorted(report["evaluations"].items()):
        before, after = ev["before"], ev["after"]
        gain = after["all"]["em"] - before["all"]["em"]
        out.append(
            (
                f"{ev['label']}: EM gain >= {EM_GAIN}",
                gain >= EM_GAIN,
                f"EM {before['all']['em']:.3f} -> {after['all']['em']:.3f} ({gain:+.3f}, n={before['all']['n']})",
            )
        )
        two_b, two_a = before["two_hop"]["em"], after["two_hop"]["em"]
        out.append((f"{ev['label']}: two-hop EM rises", two_a > two_b, f"{two_b:.3f} -> {two_a:.3f}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "demo_learning")
    parser.add_argument("--other-world-seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=18470)
    parser.add_argument("--check-only", action="store_true", help="only check a finished run")
    args, overrides = parser.parse_known_args(argv)
    started, load = time.monotonic(), os.getloadavg()
    if not args.check_only:
        rc = demo_main(
            [
                "run",
                "--run-dir",
                str(args.run_dir),
                "--port",
                str(args.port),
                "--also-world-seed",
                str(args.other_world_seed),
                *overrides,
            ]
        )
        if rc != 0:
            print(f"demo run failed (exit {rc})", file=sys.stderr)
            return rc
    report = json.loads((args.run_dir / "demo_report.json").read_text())
    results = check(report)
    wall = time.monotonic() - started
    print(
        f"\ndemo learning targets ({args.run_dir}; wall {wall / 60:.1f} min; load before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}):"
    )
    for target, met, numbers in results:
        print(f"  [{'PASS' if met else 'FAIL'}] {target}: {numbers}")
    return 0 if all(met for _, met, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
