"""The transfer world's warm start: atomic skills and the search loop, not the held-out compositions.

The shipped base model SFT-trained on scripted-teacher rollouts (the machinery of
``search_demo.warm_start``: verl's agent loop against a real BM25 server, the same SFT loop) over
the train regions of transfer worlds of ``warm_start.SFT_WORLD_SEEDS``. Demonstrated: one hop on
each of the four relations, person and company -> city -> country, company -> city -> country ->
region, and selection on located_in and headquartered_in. Never demonstrated: city -> region,
person -> region, selection on region_of or born_in. Why: docs/micro_transfer.md.

    python -m search_demo.transfer_warm_start --out DIR [--base DIR] [--steps N] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from search_demo import base_model, transfer_world, world
from search_demo.trajectories import render_trajectory
from search_demo.warm_start import (
    SFT_WORLD_SEEDS,
    WarmStartConfig,
    base_stamp,
    copy_shipped,
    sft_into,
    stamp_key,
    stopped_early,
)
from search_env import protocol
from search_env.jsonl import write_jsonl
from search_env.paths import REPO_ROOT
from search_env.safe_fs import UnsafeDeleteError

TRANSFER_WARM_START_VERSION = 2
"""Bumped when this module's output changes for the same inputs."""
SHIPPED = REPO_ROOT / "assets" / "warm_start_transfer"
"""The built transfer warm start (default config, the shipped base model), committed."""
ANSWER_PHRASE = "in {a}"
"""A phrased answer's form (every asked kind is a place: "in Velmora"); selection answers stay bare."""


@dataclass(frozen=True)
class TransferWarmStart:
    """What the transfer warm start demonstrates (counts per SFT world) and how long it trains."""

    seed: int = 0
    single_hop: int = 30
    """One-hop questions per relation (four relations; region_of has one per country: 19)."""
    two_hop: int = 40
    """Person -> city -> country questions (the demonstrated search loop)."""
    company_two_hop: int = 40
    """Company -> city -> country questions (an RL training type). With companies asked at one, two
    and three hops, the number of searches has to follow the asked type, not the subject: without
    them the warm start never searched three times for a person (pass@5 0 on H3, measured)."""
    selection: int = 60
    """Selection questions on located_in (the teacher searches the question itself and answers the
    title of the first passage: the option's passage that names the country). With 24 the warm
    start answered a name from no passage (greedy 0.2 on the RL type); with 60, greedy 0.70."""
    company_selection: int = 60
    """Selection questions on headquartered_in ("Which of Co1, Co2 or Co3 is in City?"). With them H3
    had support at both SFT seeds tried (pass@5 0.15 and 0.35 on 20 questions), without them at one
    (0.00 and 0.15): two relations of selection make the search loop less tied to one subject kind."""
    three_hop: int = 36
    """Company -> city -> country -> region questions (the search loop three deep; an RL training
    type, never a held-out one). Without them the warm start answers the first search's city on
    every region question about a person or company: pass@5 0 on both three-hop types (measured),
    so RL would have no three-search rollout to reinforce."""
    two_hop_stop_early: float = 0.1
    """Share of the two-hop demonstrations that answer the bridge city after one search (the flawed
    teacher of ``warm_start.stopped_early``: a behaviour for RL to correct)."""
    phrased_answer: float = 0.8
    """Share of the chain demonstrations answered "in X" instead of "X" (EM 0, F1 partial)."""
    steps: int = 450
    """SFT steps (batch 8)."""
    max_turns: int = 5
    """Assistant turns of a demonstration rollout (a three-hop question needs 4)."""

    def sft_config(self) -> WarmStartConfig:
        """The ``warm_start.WarmStartConfig`` the shared SFT loop and teacher read."""
        return WarmStartConfig(
            seed=self.seed,
            two_hop_stop_early=self.two_hop_stop_early,
            phrased_answer=self.phrased_answer,
            steps=self.steps,
            max_turns=self.max_turns,
        )


def phrased(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` answered in :data:`ANSWER_PHRASE` ("in Velmora" for "Velmora")."""
    return {**row, "golden_answers": [ANSWER_PHRASE.format(a=row["golden_answers"][0])]}


def pick_rows(
    pools: dict[str, list[dict[str, Any]]], cfg: TransferWarmStart, world_seed: int
) -> list[dict[str, Any]]:
    """The demonstrated rows of one SFT world (``transfer_world.sft_rows``), in SFT order: per
    relation ``cfg.single_hop`` one-hop rows, then the counts of ``cfg`` of each other pool (seeded
    draws); then early stops (both two-hop pools) and phrased answers (chains only), each its own
    draw."""
    rng = random.Random(f"transfer_warm_start:{cfg.seed}:{world_seed}")
    tagged = {kind: [{**r, "type": kind} for r in rows] for kind, rows in pools.items()}
    by_relation: dict[str, list[dict[str, Any]]] = {}
    for r in tagged["single_hop"]:
        by_relation.setdefault(r["relation"], []).append(r)
    picked = [
        r
        for rel in sorted(by_relation)
        for r in rng.sample(by_relation[rel], min(cfg.single_hop, len(by_relation[rel])))
    ]
    counts = {
        "two_hop": cfg.two_hop,
        "two_hop_company": cfg.company_two_hop,
        "selection": cfg.selection,
        "company_selection": cfg.company_selection,
        "three_hop": cfg.three_hop,
    }
    for kind, n in counts.items():
        picked += rng.sample(tagged[kind], n)
    rng.shuffle(picked)
    early = random.Random(f"transfer_stop_early:{cfg.seed}:{world_seed}")
    picked = [
        stopped_early(r) if r["type"].startswith("two_hop") and early.random() < cfg.two_hop_stop_early else r
        for r in picked
    ]
    phrase = random.Random(f"transfer_phrased:{cfg.seed}:{world_seed}")
    return [
        phrased(r) if "selection" not in r["type"] and phrase.random() < cfg.phrased_answer else r
        for r in picked
    ]


def cache_key(cfg: TransferWarmStart, base: Path) -> str:
    """Hash of everything the transfer warm start depends on."""
    pools = transfer_world.sft_rows(SFT_WORLD_SEEDS[0])
    sample = pools["two_hop"][0]
    chunks = [["a passage", "another passage"]] * 2
    parts = {
        "version": TRANSFER_WARM_START_VERSION,
        "format": render_trajectory(sample, chunks),
        "stops": list(protocol.STOP_STRINGS),
        "tool_format": protocol.TOOL_FORMAT,
        "base": base_stamp(base)["key"],
        "world": {
            "version": world.WORLD_VERSION,
            "transfer": transfer_world.TRANSFER_WORLD_VERSION,
            "sft_seeds": list(SFT_WORLD_SEEDS),
            "knobs": transfer_world.sft_world_knobs(),
        },
        "config": asdict(cfg),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def build_transfer_warm_start(
    out: str | Path, cfg: TransferWarmStart = TransferWarmStart(), base: Path | None = None, log: Any = print
) -> Path:
    """Build the transfer warm start into ``out`` (HF folder + ``warm_start.json``); returns ``out``."""
    base = Path(base or base_model.SHIPPED)

    def worlds(tmp: Path) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
        for seed in SFT_WORLD_SEEDS:
            world_dir = tmp / f"world_{seed}"
            write_jsonl(transfer_world.sft_passages(seed), world_dir / "corpus.jsonl")
            yield world_dir, pick_rows(transfer_world.sft_rows(seed), cfg, seed)

    stamp = {"kind": "transfer", "config": asdict(cfg)}
    name = "transfer warm start"
    return sft_into(Path(out), base, cache_key(cfg, base), cfg.sft_config(), worlds, stamp, name, log)


def ensure_transfer_warm_start(
    out: str | Path, cfg: TransferWarmStart = TransferWarmStart(), base: Path | None = None, log: Any = print
) -> Path:
    """``out`` if its stamp matches :func:`cache_key`; else a copy of :data:`SHIPPED` if that one
    matches; else a fresh :func:`build_transfer_warm_start`."""
    out = Path(out)
    key = cache_key(cfg, Path(base or base_model.SHIPPED))
    if stamp_key(out) == key:
        return out
    if stamp_key(SHIPPED) != key or SHIPPED.resolve() == out.resolve():
        return build_transfer_warm_start(out, cfg, base=base, log=log)
    return copy_shipped(SHIPPED, out, key, "transfer warm start", log)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m search_demo.transfer_warm_start", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="model folder to write")
    parser.add_argument(
        "--base", type=Path, default=None, help="base model folder (default: assets/demo_base)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=TransferWarmStart.steps, help="SFT steps")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    args = parser.parse_args(argv)
    cfg = replace(TransferWarmStart(), seed=args.seed, steps=args.steps)
    try:
        (build_transfer_warm_start if args.force else ensure_transfer_warm_start)(
            args.out, cfg, base=args.base
        )
    except UnsafeDeleteError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
