"""The transfer world (search_demo.transfer_world) and its checks before any RL, on the shipped
assets: A1 surface, A2 feasibility, A3 atomic skills, A4 support (docs/micro_transfer.md)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from reward_fns.metrics import form_normalised_em
from search_demo import base_model, transfer_checks, transfer_warm_start, transfer_world
from search_env.benchmarks import BY_KEY, IN_DISTRIBUTION, order_benchmarks
from search_env.paths import REPO_ROOT
from study import transfer

RECIPE = yaml.safe_load((REPO_ROOT / "recipes" / "micro_transfer.yaml").read_text())
WORLD_SEED = yaml.safe_load((REPO_ROOT / "recipes" / "demo_cpu_base.yaml").read_text())["launch"]["assets"][
    "world_seed"
]
UNSEEN_SEED = RECIPE["launch"]["assets"]["unseen_world_seed"]
LIMITS = transfer_checks.Limits(
    max_turns=RECIPE["actor_rollout_ref"]["rollout"]["multi_turn"]["max_assistant_turns"],
    max_response_tokens=RECIPE["data"]["max_response_length"],
)
HELD_OUT = [*transfer_world.HELD_OUT, transfer_world.STRETCH]
GRAMMAR = re.compile(
    r"In which (city|country|region) (was .+ born|is .+ based|is .+)\?"
    r"|Which of .+, .+ or .+ (was born in|is in) .+\?"
)
A3_PER_RELATION = 20
"""A3: greedy rollouts per relation."""
A4_PER_TYPE = 10
"""A4: questions per type, each sampled 5 times."""
A4_DEEPEST = 20
"""A4: questions of the deepest held-out type (H3), each sampled 5 times."""


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return transfer_world.write_transfer_world(WORLD_SEED, UNSEEN_SEED, tmp_path_factory.mktemp("transfer"))


def _rows(world_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (world_dir / "test" / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(transfer_warm_start.SHIPPED)


def test_the_reports_know_each_type_and_average_only_the_held_out_ones():
    """Every test type is a registered benchmark (its label and column order in the tables); only the
    types RL trains on count as in-distribution, so the held-out average is over H1-H5 and the stretch."""
    assert set(transfer_world.BENCHMARKS) <= set(BY_KEY)
    assert {b for b in transfer_world.BENCHMARKS if b in IN_DISTRIBUTION} == set(transfer_world.RL_TYPES)
    assert order_benchmarks(transfer_world.BENCHMARKS)[: len(transfer_world.RL_TYPES)] == list(
        transfer_world.RL_TYPES
    )


def test_the_study_report_asserts_the_held_out_types_of_the_world() -> None:
    """study.transfer may not import search_demo (tests/test_import_graph.py): its own list of the
    asserted types must stay the world's."""
    assert set(transfer.ASSERTED) == set(transfer_world.HELD_OUT)
    assert {transfer.DEEPEST, transfer.SELECTION} <= set(transfer_world.HELD_OUT)


def test_one_grammar_and_the_training_mix(world_dir: Path) -> None:
    train = [json.loads(x) for x in (world_dir / "train.jsonl").read_text().splitlines()]
    knobs = transfer_world.DEFAULT_KNOBS
    assert len(train) == knobs.train_prompts
    selections = [r for r in train if r["question"].startswith("Which of")]
    assert len(selections) == round(knobs.select_share * knobs.train_prompts)
    chains = [r for r in train if r not in selections]
    assert sum(len(r["hops"]) == 3 for r in chains) == round(knobs.deep_share * knobs.train_prompts)
    trained = {r["relation"] for r in train}
    assert trained == {
        "born_in+located_in",
        "headquartered_in+located_in",
        "headquartered_in+located_in+region_of",
        "located_in",
    }
    train_entities = {e for r in train for e in r["entities"]}
    for name in transfer_world.BENCHMARKS:
        rows = _rows(world_dir, name)
        assert len(rows) >= 36, name
        for r in rows:
            assert GRAMMAR.fullmatch(r["question"]), r["question"]
            assert not train_entities & set(r["entities"]), (name, r["question"])
    assert {r["relation"] for r in _rows(world_dir, "xfer_new_pair")} == {"located_in+region_of"}
    assert {r["relation"] for r in _rows(world_dir, "xfer_new_triple")} == {"born_in+located_in+region_of"}
    relations = {"xfer_city_selection": {"located_in"}, "xfer_selection": {"region_of"}}
    relations[transfer_world.STRETCH] = {"born_in"}
    for name, wanted in relations.items():  # the answer is one of the three named options
        rows = _rows(world_dir, name)
        for r in rows:
            gold = r["golden_answers"][0]
            assert gold in r["entities"][:3] and r["question"].count(gold) == 1, r["question"]
        assert {r["relation"] for r in rows} == wanted, name


def test_a1_every_held_out_prompt_token_is_in_20_training_sequences(world_dir: Path, tokenizer) -> None:
    train = [json.loads(x) for x in (world_dir / "train.jsonl").read_text().splitlines()]
    counts = transfer_checks.training_sequence_counts(tokenizer, train)
    for name in HELD_OUT:
        questions = [r["question"] for r in _rows(world_dir, name)]
        assert transfer_checks.surface_misses(tokenizer, questions, counts) == {}, name
    questions = [r["question"] for name in HELD_OUT for r in _rows(world_dir, name)[:3]]
    full = tokenizer(transfer_checks.prompt_texts(tokenizer, questions), add_special_tokens=False)[
        "input_ids"
    ]
    assert transfer_checks.prompt_ids(tokenizer, questions) == full  # the head tokenized once is exact


def test_a2_the_scripted_teacher_solves_every_type_within_the_limits(world_dir: Path, tokenizer) -> None:
    solved = transfer_checks.oracle_feasibility(world_dir, tokenizer, LIMITS)
    assert set(solved) == set(transfer_world.BENCHMARKS)
    assert min(solved.values()) >= 0.95, solved
    tight = transfer_checks.Limits(max_turns=3)  # a three-hop question needs 4 turns
    assert transfer_checks.oracle_feasibility(world_dir, tokenizer, tight, ["xfer_new_triple"]) == {
        "xfer_new_triple": 0.0
    }


def test_the_shipped_warm_start_is_current() -> None:
    key = transfer_warm_start.cache_key(transfer_warm_start.TransferWarmStart(), base_model.SHIPPED)
    assert transfer_warm_start.stamp_key(transfer_warm_start.SHIPPED) == key, (
        "assets/warm_start_transfer is stale: rebuild it with `python -m search_demo.transfer_warm_start "
        "--out assets/warm_start_transfer --force`"
    )


def test_the_warm_start_key_holds_the_sft_worlds_knobs_only(monkeypatch) -> None:
    """Tuning an RL knob keeps the built warm start (its SFT data does not change; measured: the same
    weights byte for byte at deep_share 0.25 and 0.5); a knob of the SFT worlds rebuilds it."""
    key = transfer_warm_start.cache_key(transfer_warm_start.TransferWarmStart(), base_model.SHIPPED)
    rl = replace(transfer_world.SFT_KNOBS, deep_share=0.25, select_share=0.125, train_prompts=320)
    monkeypatch.setattr(transfer_world, "SFT_KNOBS", rl)
    assert transfer_warm_start.cache_key(transfer_warm_start.TransferWarmStart(), base_model.SHIPPED) == key
    monkeypatch.setattr(transfer_world, "SFT_KNOBS", replace(rl, min_name_rows=5))
    assert transfer_warm_start.cache_key(transfer_warm_start.TransferWarmStart(), base_model.SHIPPED) != key


@pytest.fixture(scope="module")
def answers(world_dir: Path):
    with transfer_checks.warm_start_rollouts(
        transfer_warm_start.SHIPPED, world_dir / "corpus.jsonl", seed=0, limits=LIMITS
    ) as answer:
        yield answer


def test_a3_the_warm_start_has_every_atomic_skill(world_dir: Path, answers) -> None:
    by_relation = defaultdict(list)
    for r in _rows(world_dir, "xfer_single_hop"):
        by_relation[r["relation"]].append(r)
    rows = [r for rel in sorted(by_relation) for r in by_relation[rel][:A3_PER_RELATION]]
    acc = defaultdict(list)
    for r, (got,) in zip(rows, answers(rows, 1, True), strict=True):
        acc[r["relation"]].append(form_normalised_em(got, r["golden_answers"]))
    assert set(acc) == {"born_in", "headquartered_in", "located_in", "region_of"}
    means = {k: sum(v) / len(v) for k, v in acc.items()}
    assert min(means.values()) >= 0.6, means


def _pass5(world_dir: Path, answers, types: list[str], per_type: int = A4_PER_TYPE) -> dict[str, float]:
    """pass@5 at T = 1, form-normalised, on the first ``per_type`` questions of each type."""
    rows = [r for name in types for r in _rows(world_dir, name)[:per_type]]
    hit = defaultdict(list)
    for r, got in zip(rows, answers(rows, 5, False), strict=True):
        hit[r["type"]].append(max(form_normalised_em(a, r["golden_answers"]) for a in got))
    return {k: sum(v) / len(v) for k, v in hit.items()}


def test_a4_the_warm_start_samples_every_rl_type(world_dir: Path, answers) -> None:
    pass5 = _pass5(world_dir, answers, list(transfer_world.RL_TYPES))
    assert min(pass5.values()) >= 0.2, pass5


def test_a4_the_warm_start_samples_the_deepest_held_out_type(world_dir: Path, answers) -> None:
    """On 20 questions: the warm start samples a person's region rarely (0.15-0.35 at the SFT seeds tried)."""
    assert _pass5(world_dir, answers, ["xfer_new_triple"], A4_DEEPEST)["xfer_new_triple"] > 0


def test_form_normalisation_drops_one_phrase_word_only() -> None:
    em = form_normalised_em
    assert em("in Velmora", ["Velmora"]) == em("Velmora", ["Velmora"]) == 1.0
    assert (
        em("in in Velmora", ["Velmora"])
        == em("Velmora Festival", ["Velmora"])
        == em(None, ["Velmora"])
        == 0.0
    )


def test_the_demo_assets_command_takes_the_transfer_regime(world_dir: Path, tmp_path: Path, capsys) -> None:
    from search_demo import driver

    args = ["assets", "--world-seed", str(WORLD_SEED), "--regime", "transfer"]
    ready = driver.build_parser().parse_args(
        [
            *args,
            "--unseen-world-seed",
            str(UNSEEN_SEED),
            "--world",
            str(world_dir),
            "--warm-start",
            str(transfer_warm_start.SHIPPED),
        ]
    )
    assert driver.assets_ready(ready) is not None  # the world and the shipped warm start are current
    assert transfer_world.ensure_transfer_world(WORLD_SEED, UNSEEN_SEED, world_dir) == world_dir
    stale = driver.build_parser().parse_args(
        [
            *args,
            "--unseen-world-seed",
            "2",
            "--world",
            str(world_dir),
            "--warm-start",
            str(transfer_warm_start.SHIPPED),
        ]
    )
    assert driver.assets_ready(stale) is None  # another unseen world: rebuilt
    assert driver.main([*args, "--world", str(tmp_path / "w"), "--warm-start", str(tmp_path / "ws")]) == 2
    assert "--regime transfer needs --unseen-world-seed" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
