"""The transfer world: one question grammar for every depth, mixed-depth training, held-out types
that recombine what training shows.

Built on a demo world (``search_demo.world``) whose countries are grouped into regions (a fifth
relation, ``region_of``: "Drelmor is a country in the Kaithor region."). Every question asks
"In which {city|country|region} {unit}?", the unit naming the subject ("was P born", "is Co
based", "is City", "is K"); the asked type is where the search chain stops, so the depth follows
from the subject and the asked type. Selection questions ("Which of A, B or C is in K?") answer
with a name copied from the question: one search with the question as the query, then the title
of the passage that names K. Training (RL) sees person and company -> country (two hops),
company -> region (three hops, :attr:`TransferKnobs.deep_share`) and selection on located_in
(:attr:`TransferKnobs.select_share`); the test suite holds those and the held-out types H1-H5 and
a stretch type (:data:`BENCHMARKS`). What each type tests and why: docs/micro_transfer.md.

    python -m search_demo.transfer_world --seed 0 --unseen-seed 1 --out DIR
"""

from __future__ import annotations

import functools
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from search_demo import world
from search_env.jsonl import write_jsonl

TRANSFER_WORLD_VERSION = 3
"""Bumped whenever this module's output for the same seeds and knobs changes (the world's stamp)."""

NEXT: dict[str, tuple[str, str]] = {
    "person": ("born_in", "city"),
    "company": ("headquartered_in", "city"),
    "city": ("located_in", "country"),
    "country": ("region_of", "region"),
}
"""Subject kind -> (the relation a search of it reads, the kind of that relation's object)."""
UNITS = {"person": "was {s} born", "company": "is {s} based", "city": "is {s}", "country": "is {s}"}
"""The grammar's subject units ("In which {asked} {unit}?")."""
SELECT_UNITS = {"person": "was born in", "company": "is in", "city": "is in", "country": "is in"}
"""The selection grammar's relation units ("Which of A, B or C {unit} {object}?")."""
SELECT = "Which of {a}, {b} or {c} {unit} {o}?"

RL_TYPES = ("xfer_two_hop", "xfer_three_hop", "xfer_city_selection")
"""The training types (test benchmarks of the same names hold the test region's questions)."""
HELD_OUT = {
    "xfer_single_hop": "H1: one hop, every relation",
    "xfer_new_pair": "H2: city -> region, a two-hop pair never trained",
    "xfer_new_triple": "H3: person -> region, a three-hop chain never trained",
    "xfer_selection": "H4: selection on region_of, a relation never trained in selection",
    "xfer_unseen_world": "H5: the training types in a world of another seed",
}
"""The asserted held-out benchmarks and what each holds."""
STRETCH = "xfer_stretch_selection"
"""Reported, not asserted: selection on born_in ("Which of P1, P2 or P3 was born in X?"), answered
with a person's name: two tokens copied from the question, a skill the base model lacks
(docs/micro_transfer.md)."""
BENCHMARKS = (*RL_TYPES, *HELD_OUT, STRETCH)
"""The test suite, training's types first."""

# (subject kind, asked kind) of each question kind of the grammar
_CHAINS = {
    "xfer_two_hop": (("person", "country"), ("company", "country")),
    "xfer_three_hop": (("company", "region"),),
    "xfer_single_hop": (("person", "city"), ("company", "city"), ("city", "country"), ("country", "region")),
    "xfer_new_pair": (("city", "region"),),
    "xfer_new_triple": (("person", "region"),),
}
_SELECTIONS = {
    "xfer_city_selection": ("city",),
    "xfer_selection": ("country",),
    STRETCH: ("person",),
    "sft_company_selection": ("company",),
}
"""Selection benchmarks -> the subject kinds whose first relation they ask about."""


@dataclass(frozen=True)
class TransferKnobs:
    """The world's difficulty knobs (counts, shares); the warm start's are in
    ``search_demo.transfer_warm_start.TransferWarmStart``."""

    train_prompts: int = 160
    """RL training questions (the train region's questions of the RL types, drawn)."""
    deep_share: float = 0.5
    """Share of the RL training questions that are three-hop (company -> region). At 0.25 (and 320
    prompts) the person questions, all two-hop, taught the policy to answer a person's region with
    the country: H3 rose, then fell to step 0 (docs/micro_transfer.md)."""
    select_share: float = 0.25
    """Share of the RL training questions that are selections on located_in ("Which of A, B or C is
    in K?"; the train region has one per city, 40)."""
    regions: dict[str, int] = field(default_factory=lambda: {"train": 5, "val": 2, "test": 6})
    """Regions per split (each split's countries are dealt among them, every region gets one)."""
    test_size: world.RegionSize = world.RegionSize(countries=12, cities=60, people=100, companies=40)
    """The test region: more cities and countries than the demo's, so H2 (one question per city)
    and the stretch type (per country) have enough questions."""
    val_size: world.RegionSize = world.RegionSize(countries=4, cities=12, people=30, companies=12)
    country_selections: int = 3
    """H4's selection questions per country (the test region has few countries)."""
    min_name_rows: int = 20
    """A place, country or company stem is used only if at least this many base-curriculum questions
    (``base_model.BASE_WORLD_SEEDS``, every split) name it in their text or answer: a name the base
    model rarely read has a weak embedding, and check A1 asks every held-out prompt token to occur
    in 20 training sequences (:func:`rare_names`)."""


DEFAULT_KNOBS = TransferKnobs()


@dataclass
class Facts:
    """One split's facts: relation -> {subject: object}, and the subjects of each kind."""

    relations: dict[str, dict[str, str]]
    kinds: dict[str, list[str]]

    def chain(self, subject: str, kind: str, asked: str) -> list[dict[str, str]]:
        """The hops from ``subject`` (of ``kind``) to the first object of kind ``asked``."""
        hops = []
        while kind != asked:
            relation, kind = NEXT[kind]
            answer = self.relations[relation][subject]
            hops.append({"subject": subject, "relation": relation, "answer": answer})
            subject = answer
        return hops


def _split_facts(rows: Sequence[dict[str, Any]], regions: dict[str, str]) -> Facts:
    rel: dict[str, dict[str, str]] = {}
    for r in rows:
        if r["type"] == "single_hop":
            hop = r["hops"][0]
            rel.setdefault(hop["relation"], {})[hop["subject"]] = hop["answer"]
    rel["region_of"] = dict(regions)
    kinds = {
        "person": sorted(rel["born_in"]),
        "company": sorted(rel["headquartered_in"]),
        "city": sorted(rel["located_in"]),
        "country": sorted(regions),
    }
    return Facts({k: rel[k] for k in ("born_in", "headquartered_in", "located_in", "region_of")}, kinds)


def question(subject: str, kind: str, asked: str) -> str:
    """The grammar's question for ``subject`` of ``kind``, asking for the ``asked`` kind."""
    return f"In which {asked} {UNITS[kind].format(s=subject)}?"


def _row(split: str, qtype: str, text: str, answer: str, hops: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "id": "",
        "question": text,
        "golden_answers": [answer],
        "type": qtype,
        "relation": "+".join(h["relation"] for h in hops),
        "hops": hops,
        "entities": [hops[0]["subject"]] + [h["answer"] for h in hops],
        "split": split,
    }


def chain_questions(facts: Facts, split: str, qtype: str) -> list[dict[str, Any]]:
    """One question per subject of every (subject kind, asked kind) of ``qtype``."""
    out = []
    for kind, asked in _CHAINS[qtype]:
        for subject in facts.kinds[kind]:
            hops = facts.chain(subject, kind, asked)
            out.append(_row(split, qtype, question(subject, kind, asked), hops[-1]["answer"], hops))
    return out


def selection_questions(
    facts: Facts, split: str, qtype: str, rng: random.Random, per_subject: int = 1
) -> list[dict[str, Any]]:
    """ "Which of A, B or C {unit} O?": per subject (``per_subject`` draws), it and two subjects of
    its kind whose object differs, in random order; the answer is that subject. One hop: the
    scripted teacher searches the question itself (the hop's ``query``; BM25 drops "which", "of",
    "or", "is", "in", so the passage naming both an option and O ranks first) and answers that
    passage's title (the hop's subject; its answer is O)."""
    out = []
    for kind in _SELECTIONS[qtype]:
        relation, _ = NEXT[kind]
        table = facts.relations[relation]
        subjects = facts.kinds[kind]
        for subject in subjects:
            others = [s for s in subjects if table[s] != table[subject]]
            for _ in range(per_subject if len(others) >= 2 else 0):
                options = [subject, *rng.sample(others, 2)]
                rng.shuffle(options)
                a, b, c = options
                text = SELECT.format(a=a, b=b, c=c, unit=SELECT_UNITS[kind], o=table[subject])
                hops = [{"subject": subject, "query": text, "relation": relation, "answer": table[subject]}]
                row = _row(split, qtype, text, subject, hops)
                row["entities"] = [*options, table[subject]]
                row["relation"] = relation
                out.append(row)
    return out


# ---- building ----------------------------------------------------------------------------------


def _deal_regions(countries: Sequence[str], n: int, names: list[str], rng: random.Random) -> dict[str, str]:
    """country -> region: ``n`` region names taken from ``names``, each region at least one country."""
    if not 1 <= n <= len(countries):
        raise ValueError(f"knobs.regions: {n} regions for {len(countries)} countries; need 1..countries")
    regions = [names.pop() for _ in range(n)]
    order = list(countries)
    rng.shuffle(order)
    return {c: regions[i] if i < n else rng.choice(regions) for i, c in enumerate(order)}


def _with_regions(passages: list[dict[str, str]], region_of: dict[str, str]) -> list[dict[str, str]]:
    """The country passages rewritten to name their region ("K is a country in the R region. It has
    N large cities."); every other passage unchanged."""
    out = []
    for p in passages:
        title, text = p["contents"].split("\n", 1)
        name = title.strip('"')
        if name in region_of:
            cities = text.removeprefix(f"{name} is a country with ").removesuffix(" large cities.")
            text = f"{name} is a country in the {region_of[name]} region. It has {cities} large cities."
        out.append({"id": p["id"], "contents": f"{title}\n{text}"})
    return out


@dataclass
class TransferWorld:
    """A built world: passages, each split's facts, the RL training rows and the suites."""

    passages: list[dict[str, str]]
    facts: dict[str, Facts]
    train: list[dict[str, Any]]
    val: dict[str, list[dict[str, Any]]]
    test: dict[str, list[dict[str, Any]]]


@functools.cache
def base_curriculum_rows() -> tuple[dict[str, Any], ...]:
    """Every question row of the base model's curriculum worlds (``base_model.BASE_WORLD_SEEDS``,
    every split): what the base model read, besides passages."""
    from search_demo.base_model import BASE_WORLD_SEEDS  # heavy: torch; only the seeds are read

    return tuple(
        r for seed in BASE_WORLD_SEEDS for rows in world.build_world(seed).questions.values() for r in rows
    )


@functools.cache
def rare_names(min_rows: int) -> frozenset[str]:
    """Places, countries and company stems of the inventory named (question text or answer, as a
    word) by fewer than ``min_rows`` questions of the base model's curriculum (:func:`base_curriculum_rows`)."""
    counts: Counter[str] = Counter()
    for r in base_curriculum_rows():
        counts.update(set(r["question"].rstrip("?").split()) | set(r["golden_answers"][0].split()))
    pools = (*world.INVENTORY.places, *world.INVENTORY.countries, *world.INVENTORY.company_stems)
    return frozenset(n for n in pools if counts[n] < min_rows)


def _region_pool(avoid: frozenset[str], rng: random.Random) -> list[str]:
    pool = [p for p in world.INVENTORY.places if p not in avoid]
    rng.shuffle(pool)
    return pool


def _base_world(
    seed: int, sizes: dict[str, world.RegionSize], avoid: frozenset[str], knobs: TransferKnobs
) -> tuple[world.World, list[dict[str, str]], dict[str, Facts], frozenset[str]]:
    """The demo world of ``seed`` with regions: (world, passages, facts per split, every name used)."""
    rare = rare_names(knobs.min_name_rows)
    w = world.build_world(seed, sizes=sizes, avoid=avoid | rare)
    names = world.entity_names(w)
    rng = random.Random(f"transfer_regions:{seed}")
    pool = _region_pool(names | avoid | rare, rng)
    facts, region_of = {}, {}
    for split in world.SPLITS:
        countries = sorted(
            {r["hops"][0]["answer"] for r in w.questions[split] if r["relation"] == "located_in"}
        )
        regions = _deal_regions(countries, min(knobs.regions[split], len(countries)), pool, rng)
        region_of |= regions
        facts[split] = _split_facts(w.questions[split], regions)
    return w, _with_regions(w.passages, region_of), facts, names | frozenset(region_of.values())


def _numbered(rows: list[dict[str, Any]], prefix: str, rng: random.Random) -> list[dict[str, Any]]:
    rng.shuffle(rows)
    return [{**r, "id": f"{prefix}-{i}"} for i, r in enumerate(rows)]


def suite(
    facts: Facts, split: str, rng: random.Random, knobs: TransferKnobs
) -> dict[str, list[dict[str, Any]]]:
    """Every benchmark of one split's region but the unseen world's (ids ``{split}-{benchmark}-i``)."""
    out = {}
    for name in BENCHMARKS:
        if name != "xfer_unseen_world":
            out[name] = _numbered(type_questions(facts, split, name, rng, knobs), f"{split}-{name}", rng)
    return out


def type_questions(
    facts: Facts, split: str, name: str, rng: random.Random, knobs: TransferKnobs
) -> list[dict[str, Any]]:
    """Every question of type ``name`` (a chain or a selection benchmark) in one split's region."""
    if name in _CHAINS:
        return chain_questions(facts, split, name)
    per = knobs.country_selections if name == "xfer_selection" else 1
    return selection_questions(facts, split, name, rng, per)


def training_rows(facts: Facts, knobs: TransferKnobs, rng: random.Random) -> list[dict[str, Any]]:
    """The RL training questions: ``knobs.train_prompts``, ``knobs.deep_share`` of them three-hop,
    ``knobs.select_share`` selections on located_in, the rest two-hop."""
    for name in ("deep_share", "select_share"):
        if not 0.0 <= getattr(knobs, name) <= 1.0:
            raise ValueError(f"knobs.{name}: {getattr(knobs, name)} is not a share in [0, 1]")
    pools = {
        "three-hop": chain_questions(facts, "train", "xfer_three_hop"),
        "selection": selection_questions(facts, "train", "xfer_city_selection", rng),
    }
    wanted = {
        "three-hop": round(knobs.deep_share * knobs.train_prompts),
        "selection": round(knobs.select_share * knobs.train_prompts),
    }
    pools["two-hop"] = chain_questions(facts, "train", "xfer_two_hop")
    wanted["two-hop"] = knobs.train_prompts - wanted["three-hop"] - wanted["selection"]
    short = [k for k in pools if not 0 <= wanted[k] <= len(pools[k])]
    if short:
        raise ValueError(
            f"knobs.train_prompts: {knobs.train_prompts} at deep_share {knobs.deep_share} and select_share "
            f"{knobs.select_share} needs {wanted}; the train region has "
            f"{ {k: len(v) for k, v in pools.items()} }. Fix: fewer train_prompts or other shares"
        )
    return _numbered([r for k in pools for r in rng.sample(pools[k], wanted[k])], "train", rng)


def build_transfer_world(seed: int, unseen_seed: int, knobs: TransferKnobs = DEFAULT_KNOBS) -> TransferWorld:
    """The transfer world of ``seed`` with the unseen world of ``unseen_seed`` (names disjoint)."""
    if seed == unseen_seed:
        raise ValueError(
            f"unseen_seed must differ from seed (both {seed}): the unseen world would be the same"
        )
    sizes = {**world.DEFAULT_SIZES, "val": knobs.val_size, "test": knobs.test_size}
    _, passages, facts, names = _base_world(seed, sizes, frozenset(), knobs)
    unseen_sizes = {
        "train": world.RegionSize(1, 1, 1, 1),
        "val": world.RegionSize(1, 1, 1, 1),
        "test": world.DEFAULT_SIZES["test"],
    }
    _, unseen_passages, unseen_facts, _ = _base_world(unseen_seed, unseen_sizes, names, knobs)
    rng = random.Random(f"transfer_world:{seed}:{unseen_seed}")
    train = training_rows(facts["train"], knobs, rng)
    val = suite(facts["val"], "val", rng, knobs)
    test = suite(facts["test"], "test", rng, knobs)
    unseen = [r for t in RL_TYPES for r in type_questions(unseen_facts["test"], "test", t, rng, knobs)]
    test["xfer_unseen_world"] = _numbered(unseen, "unseen", rng)
    order = [*RL_TYPES, *HELD_OUT, STRETCH]
    offset = len(passages)
    passages = passages + [
        {"id": str(offset + i), "contents": p["contents"]} for i, p in enumerate(unseen_passages)
    ]
    return TransferWorld(passages, facts, train, val, {k: test[k] for k in order})


SFT_KNOBS = replace(DEFAULT_KNOBS, regions={split: 10**6 for split in world.SPLITS})
"""The warm start's worlds: every country its own region. With a few regions per world the
region answers repeat, and the SFT learns to answer a frequent region name instead of copying the
passage's (measured: one-hop region_of 0/20 greedy with 3-4 regions per region of the world)."""


def sft_world_knobs() -> dict[str, Any]:
    """The knobs the warm start's worlds depend on (:func:`_base_world` reads these two): the warm
    start's cache key holds them, so tuning an RL knob (``deep_share``, ``train_prompts`` ...) keeps
    the built warm start."""
    return {"regions": SFT_KNOBS.regions, "min_name_rows": SFT_KNOBS.min_name_rows}


@functools.cache
def _sft_world(seed: int) -> tuple[list[dict[str, str]], dict[str, Facts]]:
    _, passages, facts, _ = _base_world(seed, dict(world.DEFAULT_SIZES), frozenset(), SFT_KNOBS)
    return passages, facts


def sft_rows(seed: int) -> dict[str, list[dict[str, Any]]]:
    """The warm start's pools from every region of the world of ``seed`` (the demo world's default
    sizes, :data:`SFT_KNOBS`; never an evaluated world): ``single_hop`` (every relation),
    ``two_hop`` (person -> country), ``two_hop_company`` (company -> country), ``selection`` (on
    located_in: "Which of A, B or C is in K?"), ``company_selection`` (on headquartered_in: "Which
    of Co1, Co2 or Co3 is in City?") and ``three_hop`` (company -> region)."""
    rng = random.Random(f"transfer_sft:{seed}")
    kinds = ("single_hop", "two_hop", "two_hop_company", "selection", "company_selection", "three_hop")
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for split, f in _sft_world(seed)[1].items():
        out["three_hop"] += chain_questions(f, split, "xfer_three_hop")
        out["single_hop"] += chain_questions(f, split, "xfer_single_hop")
        for r in chain_questions(f, split, "xfer_two_hop"):
            out["two_hop" if r["hops"][0]["relation"] == "born_in" else "two_hop_company"].append(r)
        out["selection"] += selection_questions(f, split, "xfer_city_selection", rng)
        out["company_selection"] += selection_questions(f, split, "sft_company_selection", rng)
    return out


def sft_passages(seed: int) -> list[dict[str, str]]:
    """The passages of the world :func:`sft_rows` draws from."""
    return list(_sft_world(seed)[0])


# ---- files -------------------------------------------------------------------------------------


def transfer_world_stamp(seed: int, unseen_seed: int, knobs: TransferKnobs = DEFAULT_KNOBS) -> dict[str, Any]:
    """What ``world.json`` of the transfer world of these seeds and knobs holds (``world.stamp_matches``)."""
    return {
        "kind": "transfer",
        "seed": seed,
        "unseen_seed": unseen_seed,
        "version": world.WORLD_VERSION,
        "transfer_version": TRANSFER_WORLD_VERSION,
        "knobs": json.loads(json.dumps(asdict(knobs))),
    }


def write_transfer_world(
    seed: int, unseen_seed: int, out: str | Path, knobs: TransferKnobs = DEFAULT_KNOBS
) -> Path:
    """Write corpus.jsonl, train.{jsonl,parquet} (data source = the row's type), val.parquet (data
    source = benchmark), test/<benchmark>.jsonl and world.json under ``out``; returns ``out``."""
    from search_env.data import QARow, write_parquet  # heavy: search_env.data imports pandas

    built = build_transfer_world(seed, unseen_seed, knobs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(built.passages, out / "corpus.jsonl")
    write_jsonl(built.train, out / "train.jsonl")
    for name, rows in built.test.items():
        write_jsonl(rows, out / "test" / f"{name}.jsonl")

    def qa(rows: Sequence[dict[str, Any]]) -> list[QARow]:
        return [QARow(id=r["id"], question=r["question"], golds=list(r["golden_answers"])) for r in rows]

    write_parquet(qa(built.train), [r["type"] for r in built.train], "train", out / "train.parquet")
    val_rows = [(name, r) for name, rows in built.val.items() for r in rows]
    write_parquet(qa([r for _, r in val_rows]), [n for n, _ in val_rows], "val", out / "val.parquet")
    meta = {
        **transfer_world_stamp(seed, unseen_seed, knobs),
        "passages": len(built.passages),
        "train": {t: sum(r["type"] == t for r in built.train) for t in RL_TYPES},
        "val": {k: len(v) for k, v in built.val.items()},
        "test": {k: len(v) for k, v in built.test.items()},
    }
    (out / "world.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


def ensure_transfer_world(seed: int, unseen_seed: int, out: str | Path) -> Path:
    """``out`` holding the transfer world of these seeds (rebuilt when missing or stale)."""
    if world.stamp_matches(out, transfer_world_stamp(seed, unseen_seed)):
        return Path(out)
    return write_transfer_world(seed, unseen_seed, out)


def main(argv: list[str] | None = None) -> None:
    world.two_world_main(argv, "transfer_world", __doc__, "transfer world", write_transfer_world)


if __name__ == "__main__":
    main()
