"""The synthetic demo world: valid passages and questions, disjoint splits, seeded, tokenizer-covered."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from search_demo import world
from search_env.retrieval.corpus import split_contents


@pytest.fixture(scope="module")
def built() -> world.World:
    return world.build_world(11)


def _titles(w: world.World) -> dict[str, str]:
    return dict(split_contents(p["contents"]) for p in w.passages)


def test_passages_are_wiki18_rows(built):
    ids = [p["id"] for p in built.passages]
    assert len(set(ids)) == len(ids)
    for p in built.passages:
        title, text = split_contents(p["contents"])
        assert p["contents"] == f'"{title}"\n{text}' and title and text.endswith(".")
    titles = _titles(built)
    assert len(titles) == len(built.passages), "titles are unique"
    assert any(t.endswith("(surname)") for t in titles) and any(t.endswith("Festival") for t in titles)


def test_questions_follow_their_hops_through_the_corpus(built):
    titles = _titles(built)
    for split, rows in built.questions.items():
        assert {r["type"] for r in rows} == set(world.TYPES)
        for r in rows:
            assert r["split"] == split and set(r) >= {"id", "question", "golden_answers", "type", "hops"}
            hops = r["hops"]
            assert len(hops) == (1 if r["type"] == "single_hop" else 2)
            assert r["golden_answers"] == [hops[-1]["answer"]]
            assert 1 <= len(r["golden_answers"][0].split()) <= 3
            assert hops[0]["subject"] in r["question"] and r["golden_answers"][0] not in r["question"]
            for hop in hops:  # each hop is stated by its subject's own passage
                assert hop["answer"] in titles[hop["subject"]], (r["id"], hop)
            if len(hops) == 2:
                assert hops[0]["answer"] == hops[1]["subject"], "bridge: hop 1's answer is hop 2's subject"
                assert hops[1]["answer"] not in titles[hops[0]["subject"]], "two-hop needs both passages"
            for entity in r["entities"]:
                assert entity in titles, f"{entity} has no passage"


def test_splits_use_disjoint_entities(built):
    entities = {s: {e for r in rows for e in r["entities"]} for s, rows in built.questions.items()}
    assert not entities["test"] & entities["train"]
    assert not entities["val"] & entities["train"]
    assert not entities["test"] & entities["val"]
    assert len(built.questions["test"]) >= 200 and len(built.questions["train"]) >= 500
    ids = [r["id"] for rows in built.questions.values() for r in rows]
    assert len(set(ids)) == len(ids)


def test_deterministic_by_seed():
    a, b, c = world.build_world(5), world.build_world(5), world.build_world(6)
    assert a.passages == b.passages and a.questions == b.questions
    assert a.passages != c.passages
    names = {r["hops"][0]["subject"] for r in a.questions["test"]}
    assert names != {r["hops"][0]["subject"] for r in c.questions["test"]}


def test_names_come_from_the_fixed_inventory():
    words = set(world.INVENTORY.words())
    for seed in (0, 123456):
        w = world.build_world(seed)
        for rows in w.questions.values():
            for r in rows:
                for entity in r["entities"]:
                    assert set(entity.split()) <= words, entity


def test_too_small_inventory_or_bad_sizes_raise():
    sizes = dict(world.DEFAULT_SIZES)
    sizes["train"] = world.RegionSize(countries=100, cities=300, people=10, companies=10)
    with pytest.raises(ValueError, match="inventory has too few"):
        world.build_world(0, sizes)
    with pytest.raises(ValueError, match="splits"):
        world.build_world(0, {"train": world.DEFAULT_SIZES["train"]})


def test_cli_writes_corpus_suite_and_parquet(tmp_path):
    world.main(["--seed", "3", "--out", str(tmp_path)])
    meta = json.loads((tmp_path / "world.json").read_text())
    assert meta["seed"] == 3 and meta["version"] == world.WORLD_VERSION
    corpus = [json.loads(line) for line in (tmp_path / "corpus.jsonl").read_text().splitlines()]
    assert len(corpus) == meta["passages"]
    for qtype in world.TYPES:
        rows = [json.loads(line) for line in (tmp_path / "test" / f"{qtype}.jsonl").read_text().splitlines()]
        assert rows and all(r["type"] == qtype for r in rows)
        assert len(rows) == meta["questions"]["test"][qtype]
    train = pd.read_parquet(tmp_path / "train.parquet")
    assert set(train["data_source"]) == set(world.TYPES)
    assert len(train) == sum(meta["questions"]["train"].values())


def test_cli_refuses_to_overwrite_another_seeds_world(tmp_path, capsys):
    world.main(["--seed", "3", "--out", str(tmp_path)])
    corpus = (tmp_path / "corpus.jsonl").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        world.main(["--seed", "4", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "already holds the world of seed 3" in capsys.readouterr().err
    assert (tmp_path / "corpus.jsonl").read_bytes() == corpus, "the existing world must be left as it was"
    world.main(["--seed", "3", "--out", str(tmp_path)])  # the same seed rewrites the same files
    assert (tmp_path / "corpus.jsonl").read_bytes() == corpus


def test_demo_tokenizer_covers_every_name():
    """Every inventory word is one or two tokens, whichever seed's world it appears in."""
    from search_demo import tiny, trajectories

    tok = tiny.build_demo_tokenizer(trajectories.tokenizer_texts())
    lengths = {w: len(tok.encode(w, add_special_tokens=False)) for w in world.INVENTORY.words()}
    assert max(lengths.values()) <= 2, [w for w, n in lengths.items() if n > 2][:10]
    # a name has the same tokens wherever it stands (question, query line, passage, answer)
    for name in (
        f"{world.INVENTORY.first_names[3]} {world.INVENTORY.last_names[5]}",
        world.INVENTORY.places[7],
    ):
        alone = tok.encode(name, add_special_tokens=False)
        assert len(alone) == len(name.split())  # one token per word
        for context in (
            f"Where was {name} born?",
            f"\n{name}\n",
            f"<answer> {name} </answer>",
            f"{name} was a poet.",
        ):
            ids = tok.encode(context, add_special_tokens=False)
            assert any(ids[i : i + len(alone)] == alone for i in range(len(ids))), context
