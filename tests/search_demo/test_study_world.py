"""The sparse regime's pieces: the paper-shaped study world (search_demo.study_world), the phrasing
warm-start teacher (search_demo.warm_start), the partial-credit and EM-tie metrics, and the
synthetic benchmarks' place in the held-out average."""

from __future__ import annotations

import json
import random
import subprocess
from collections import Counter

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reward_fns import exact_match, token_f1
from search_demo import study_world, world
from search_demo.warm_start import REGIMES, WarmStartConfig, _pick_rows, answered_in_a_phrase
from search_env.benchmarks import IN_DISTRIBUTION, canonical_benchmark
from search_env.paths import REPO_ROOT
from search_env.rollout_stats import partial_credit_frac, rollout_metrics


@pytest.fixture(scope="module")
def built():
    return study_world.build_study_world(0, 1)


def _people_and_companies(rows):
    return {e for r in rows for e in r["entities"]}


def test_suite_has_the_papers_shape(built):
    assert tuple(built["test"]) == study_world.BENCHMARKS
    assert all(len(rows) >= 40 for rows in built["test"].values())
    assert {r["type"] for r in built["train"]} == {"two_hop"}  # the MuSiQue analogue only
    assert set(built["val"]) == set(study_world.BENCHMARKS) - {"syn_unseen_world"}
    held = [b for b in study_world.BENCHMARKS if canonical_benchmark(b) not in IN_DISTRIBUTION]
    assert held == list(study_world.BENCHMARKS[1:])  # only the training type counts as in-distribution
    for split in ("test", "val"):
        for rows in built[split].values():
            assert len({r["id"] for r in rows}) == len(rows)


def test_no_test_or_validation_entity_is_in_a_training_question(built):
    trained = _people_and_companies(built["train"])
    for split in ("test", "val"):
        for name, rows in built[split].items():
            assert not trained & _people_and_companies(rows), (split, name)


def test_three_hop_and_comparison_answers_follow_the_worlds_facts(built):
    base = world.build_world(0)
    facts = {}
    for r in base.questions["test"]:
        for h in r["hops"]:
            facts[(h["subject"], h["relation"])] = h["answer"]
    for r in built["test"]["syn_three_hop"]:
        company = r["hops"][0]["subject"]
        founder = facts[(company, "founded_by")]
        assert r["golden_answers"] == [facts[(facts[(founder, "born_in")], "located_in")]]
        assert company in r["question"]
    for r in built["test"]["syn_comparison"]:
        a, b = (h["subject"] for h in r["hops"])
        gold = r["golden_answers"][0]
        assert gold in (a, b) and a in r["question"] and b in r["question"]
        target = next(h["answer"] for h in r["hops"] if h["subject"] == gold)
        other = next(h["answer"] for h in r["hops"] if h["subject"] != gold)
        assert target in r["question"] and target != other  # exactly one of the two is right


def test_the_unseen_world_shares_no_name_with_the_training_world(built):
    base = world.build_world(0)
    unseen_entities = _people_and_companies(built["test"]["syn_unseen_world"])
    assert not unseen_entities & world.entity_names(base)
    titles = [json.loads(json.dumps(p))["contents"].split("\n", 1)[0] for p in built["passages"]]
    entity_titles = [t for t in titles if "(surname)" not in t and "Festival" not in t]
    assert len(entity_titles) == len(set(entity_titles)), "two passages about one entity"
    assert [p["id"] for p in built["passages"]] == [str(i) for i in range(len(built["passages"]))]


def test_avoiding_nothing_draws_the_same_world():
    assert world.build_world(3, avoid=frozenset()).questions == world.build_world(3).questions


def test_study_world_is_deterministic_and_cached(tmp_path):
    out = study_world.write_study_world(0, 1, tmp_path / "w")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == sorted(
        ["corpus.jsonl", "train.jsonl", "train.parquet", "val.parquet", "world.json"]
        + [f"test/{b}.jsonl" for b in study_world.BENCHMARKS]
    )
    assert set(pd.read_parquet(out / "val.parquet")["data_source"]) == set(study_world.BENCHMARKS[:-1])
    stamp = (out / "world.json").stat().st_mtime_ns
    assert (
        study_world.ensure_study_world(0, 1, out) == out and (out / "world.json").stat().st_mtime_ns == stamp
    )
    again = study_world.build_study_world(0, 1)
    assert again["test"] == study_world.build_study_world(0, 1)["test"]
    with pytest.raises(ValueError, match="unseen_seed must differ"):
        study_world.build_study_world(2, 2)


def test_a_stamp_of_other_seeds_rebuilds_the_study_world(tmp_path):
    out = study_world.write_study_world(0, 1, tmp_path / "w")
    assert world.stamp_matches(out, {"kind": "study", "seed": 0, "unseen_seed": 1})
    assert not world.stamp_matches(out, {"kind": "study", "seed": 0, "unseen_seed": 2})
    assert not world.stamp_matches(tmp_path / "missing", {"seed": 0})
    study_world.ensure_study_world(0, 2, out)
    assert json.loads((out / "world.json").read_text())["unseen_seed"] == 2


def test_demo_command_line_offers_every_regime_and_rejects_one_world_twice(tmp_path, capsys):
    from search_demo import driver

    assert driver.REGIME_NAMES == tuple(REGIMES)
    base = ["assets", "--world-seed", "0", "--world", "w", "--warm-start", "ws", "--regime"]
    for name in REGIMES:
        assert driver.build_parser().parse_args([*base, name]).regime == name
    with pytest.raises(SystemExit):
        driver.build_parser().parse_args([*base, "sparce"])
    code = driver.main(
        [
            "assets",
            "--world-seed",
            "3",
            "--unseen-world-seed",
            "3",
            "--world",
            str(tmp_path / "w"),
            "--warm-start",
            str(tmp_path / "ws"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--unseen-world-seed must differ from --world-seed (both 3)" in err
    assert not (tmp_path / "w").exists()


def test_phrased_answer_is_right_but_not_an_exact_match():
    rows = world.build_world(0).questions["train"]
    for row in rows[:60]:
        phrased = answered_in_a_phrase(row)["golden_answers"][0]
        gold = row["golden_answers"]
        assert exact_match(phrased, gold) == 0.0 and 0.6 < token_f1(phrased, gold) < 1.0, (gold, phrased)


def test_phrased_draw_leaves_the_stop_early_draw_unchanged():
    rows = world.build_world(-101).questions["train"]
    sparse = REGIMES["sparse"]
    plain = _pick_rows(rows, WarmStartConfig(two_hop_stop_early=sparse.two_hop_stop_early))
    phrased = _pick_rows(rows, sparse)
    assert [r["id"] for r in plain] == [r["id"] for r in phrased]
    assert [len(r["hops"]) for r in plain] == [len(r["hops"]) for r in phrased]
    changed = [p["golden_answers"] != v["golden_answers"] for p, v in zip(plain, phrased, strict=True)]
    assert abs(sum(changed) / len(changed) - sparse.phrased_answer) < 0.06
    assert REGIMES["dense"] == WarmStartConfig()
    early = _pick_rows(rows, WarmStartConfig())  # the dense teacher stops early on some two-hop rows
    assert any(len(e["hops"]) < len(p["hops"]) for e, p in zip(early, plain, strict=True))


def test_partial_credit_fraction_and_em_ties():
    assert partial_credit_frac([(1.0, 1.0), (1.0, 1.0)]) is None  # nothing wrong: undefined
    assert partial_credit_frac([(0.0, 0.5), (0.0, 0.0), (1.0, 1.0), (None, 0.3)]) == 0.5
    extra = [
        {"reward_extra_info": {"score": f1, "em": em, "f1": f1}}
        for em, f1 in [(0, 0.3), (0, 0.3), (0, 0.0), (0, 0.0), (1, 1.0), (0, 0.4)]
    ]
    m = rollout_metrics(extra, ["a", "a", "b", "b", "c", "c"])
    # F1 ties group a (0.3, 0.3) and b; EM ties a and b; c differs under both
    assert m["grpo/zero_variance_group_frac"] == pytest.approx(2 / 3)
    assert m["grpo/em_zero_variance_group_frac"] == pytest.approx(2 / 3)
    assert m["reward/partial_credit_frac"] == pytest.approx(3 / 5)


@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0]), st.floats(0, 1)), max_size=30))
def test_partial_credit_fraction_is_a_fraction_of_the_wrong(scores):
    got = partial_credit_frac(scores)
    wrong = [f for e, f in scores if e == 0.0]
    if not wrong:
        assert got is None
    else:
        assert 0.0 <= got <= 1.0
        assert got * len(wrong) == pytest.approx(sum(0 < f < 1 for f in wrong))


@pytest.mark.slow
def test_sparse_cells_extend_the_caps_rule_to_five_seeds_and_add_group_size():
    out = subprocess.run(
        ["bash", "launch/micro_study.sh", "--regime", "sparse", "--list"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split("\n")
    cells = {}
    for line, overrides in zip(out, out[1:], strict=False):  # a cell line, then its overrides
        if "  cap=" in line and not line.startswith(" "):
            name, *fields = line.split()
            cells[name] = dict(f.split("=", 1) for f in fields)
            cells[name]["G"] = "10" if "actor_rollout_ref.rollout.n=10" in overrides else "5"
    caps = {int(n.rsplit("_s", 1)[1]): int(c["cap"]) for n, c in cells.items() if c["tree"] == "main"}
    assert caps == {42: 18, 43: 23, 44: 31, 45: 18, 46: 23}  # 180 : 230 : 312 x 1/10, then cycling
    assert Counter(c["tree"] for c in cells.values()) == {"main": 15, "g10": 6}
    g10 = {n: c for n, c in cells.items() if c["tree"] == "g10"}
    assert {n.split("_g10")[0] for n in g10} == {"em_only", "f1_only"}
    assert all(c["G"] == "10" and c["cap"] == "18" for c in g10.values())
    assert all(c["G"] == "5" for n, c in cells.items() if n not in g10)
    bad = subprocess.run(
        ["bash", "launch/micro_study.sh", "--regime", "sparce"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "micro_sparce.yaml: no such study file" in bad.stderr


def test_rng_of_the_study_world_is_its_own():
    """The study world draws with its own generator: the demo world's files stay byte-identical."""
    state = random.getstate()
    study_world.build_study_world(0, 1)
    assert random.getstate() == state
