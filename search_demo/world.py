"""A synthetic multi-hop world for the CPU demo: fictional entities, wiki-18 passages, QA rows.

``build_world(seed)`` draws fictional countries, cities, people and companies linked by four
relations, and writes their passages (with distractors) and single-hop and two-hop bridge
questions; every name comes from the fixed ``INVENTORY`` the demo tokenizer covers, and each
split is its own region of the world. Same seed -> identical files. What it writes and why:
docs/training.md ("The CPU demo", step 1).

    python -m search_demo.world --seed 7 --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from search_env.jsonl import write_jsonl

WORLD_VERSION = 2
"""Bumped whenever the generator's output for a seed changes (part of the demo cache key)."""
SPLITS = ("train", "val", "test")
TYPES = ("single_hop", "two_hop")

# ---- the fixed name inventory ------------------------------------------------------------------

_ONSETS = [
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "kr",
    "st",
    "th",
    "sh",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "x", "nd"]
INVENTORY_SEED = 20261201
"""Seed of the name inventory (fixed: the tokenizer and every world share one inventory)."""
COMPANY_SUFFIXES = ("Industries", "Press", "Mills", "Works", "Holdings", "Foundry", "Labs", "Trading")
OCCUPATIONS = ("painter", "sailor", "chemist", "poet", "teacher", "doctor", "composer", "banker")
CITY_FEATURES = ("river", "harbour", "bridge", "market", "castle", "cathedral")


@dataclass(frozen=True)
class Inventory:
    """Every name a world may use (capitalised, single words; people are first + last name)."""

    first_names: tuple[str, ...]
    last_names: tuple[str, ...]
    places: tuple[str, ...]
    countries: tuple[str, ...]
    company_stems: tuple[str, ...]

    def words(self) -> list[str]:
        """All name words, suffixes included (what the tokenizer must cover)."""
        return [
            *self.first_names,
            *self.last_names,
            *self.places,
            *self.countries,
            *self.company_stems,
            *COMPANY_SUFFIXES,
        ]


def _build_inventory(seed: int = INVENTORY_SEED) -> Inventory:
    """Draw unique pronounceable names for each category (no word shared between categories)."""
    rng = random.Random(seed)
    seen: set[str] = set()

    def draw(count: int, syllables: tuple[int, int]) -> tuple[str, ...]:
        out: list[str] = []
        while len(out) < count:
            n = rng.randint(*syllables)
            word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n)) + rng.choice(_CODAS)
            word = word.capitalize()
            if 4 <= len(word) <= 10 and word not in seen:
                seen.add(word)
                out.append(word)
        return tuple(out)

    return Inventory(
        first_names=draw(120, (2, 2)),
        last_names=draw(160, (2, 3)),
        places=draw(240, (2, 3)),
        countries=draw(60, (2, 3)),
        company_stems=draw(200, (2, 2)),
    )


INVENTORY = _build_inventory()


# ---- world structure ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RegionSize:
    """Entities of one split's region (counts)."""

    countries: int
    cities: int
    people: int
    companies: int


DEFAULT_SIZES: dict[str, RegionSize] = {
    "train": RegionSize(countries=10, cities=40, people=200, companies=80),
    "val": RegionSize(countries=3, cities=8, people=20, companies=8),
    "test": RegionSize(countries=6, cities=24, people=100, companies=40),
}
"""Per-split regions: train 760 questions, val 76, test 384 (204 single-hop, 180 two-hop)."""


@dataclass
class Person:
    name: str
    occupation: str
    born_in: str
    lived_in: str | None  # a distractor city (never the birthplace)


@dataclass
class Company:
    name: str
    founded_by: str
    headquartered_in: str


@dataclass
class Region:
    """One split's entities; every relation points inside the region."""

    split: str
    countries: list[str]
    city_country: dict[str, str]
    people: list[Person]
    companies: list[Company]
    city_feature: dict[str, str] = field(default_factory=dict)


@dataclass
class World:
    """A built world: passages (wiki-18 rows) and question rows per split."""

    seed: int
    passages: list[dict[str, str]]
    questions: dict[str, list[dict[str, Any]]]
    sizes: dict[str, RegionSize]


class _Names:
    """Draws names without replacement from the inventory (unique within a world)."""

    def __init__(self, rng: random.Random, avoid: frozenset[str] = frozenset()):
        self.rng = rng
        self.pools = {
            "place": list(INVENTORY.places),
            "country": list(INVENTORY.countries),
            "company": list(INVENTORY.company_stems),
        }
        for kind, pool in self.pools.items():
            rng.shuffle(pool)  # then filtered: an empty ``avoid`` draws exactly as before
            self.pools[kind] = [name for name in pool if name not in avoid]
        self.people: set[str] = set(avoid)

    def take(self, kind: str) -> str:
        pool = self.pools[kind]
        if not pool:
            raise ValueError(f"the name inventory has too few {kind} names for these world sizes")
        return pool.pop()

    def person(self) -> str:
        for _ in range(10_000):
            name = f"{self.rng.choice(INVENTORY.first_names)} {self.rng.choice(INVENTORY.last_names)}"
            if name not in self.people:
                self.people.add(name)
                return name
        raise ValueError("the name inventory has too few person names for these world sizes")

    def company(self) -> str:
        return f"{self.take('company')} {self.rng.choice(COMPANY_SUFFIXES)}"


def _region(split: str, size: RegionSize, names: _Names, rng: random.Random) -> Region:
    if min(size.countries, size.cities, size.people, size.companies) < 1 or size.cities < size.countries:
        raise ValueError(f"{split}: every count must be >= 1 and cities >= countries, got {size}")
    countries = [names.take("country") for _ in range(size.countries)]
    cities = [names.take("place") for _ in range(size.cities)]
    # every country gets at least one city
    city_country = {
        c: countries[i] if i < len(countries) else rng.choice(countries) for i, c in enumerate(cities)
    }
    people = []
    for _ in range(size.people):
        born = rng.choice(cities)
        lived = (
            rng.choice([c for c in cities if c != born]) if len(cities) > 1 and rng.random() < 0.5 else None
        )
        people.append(Person(names.person(), rng.choice(OCCUPATIONS), born, lived))
    founders = rng.sample(people, min(size.companies, len(people)))
    founders += [rng.choice(people) for _ in range(size.companies - len(founders))]
    # headquarters never in the founder's birthplace: a two-hop "founder born" answer is not in the company passage
    companies = [
        Company(names.company(), f.name, rng.choice([c for c in cities if c != f.born_in] or cities))
        for f in founders
    ]
    features = {c: rng.choice(CITY_FEATURES) for c in cities}
    return Region(split, countries, city_country, people, companies, features)


def _passages(regions: Sequence[Region], rng: random.Random) -> list[tuple[str, str]]:
    """(title, text) of every entity and distractor passage."""
    out: list[tuple[str, str]] = []
    surnames: dict[str, list[str]] = {}
    for r in regions:
        for country in r.countries:
            n_cities = sum(1 for v in r.city_country.values() if v == country)
            out.append((country, f"{country} is a country with {n_cities} large cities."))
        for city, country in r.city_country.items():
            feature = r.city_feature[city]
            out.append((city, f"{city} is a city in {country}. It is known for its {feature}."))
            if rng.random() < 0.4:  # distractor: names the city, says nothing about its country
                out.append(
                    (f"{city} Festival", f"Every summer the {city} Festival is held near the {feature}.")
                )
        for p in r.people:
            text = f"{p.name} was a {p.occupation}. {p.name} was born in {p.born_in}."
            if p.lived_in:
                text += f" Later, {p.name.split()[0]} lived in {p.lived_in}."
            out.append((p.name, text))
            surnames.setdefault(p.name.split()[1], []).append(p.name)
        for c in r.companies:
            out.append(
                (
                    c.name,
                    f"{c.name} is a company founded by {c.founded_by}. Its headquarters are in {c.headquartered_in}.",
                )
            )
    for surname, people in sorted(surnames.items()):
        if len(people) > 1:  # distractor: every namesake, no relation
            out.append(
                (
                    f"{surname} (surname)",
                    f"{surname} is a family name. People named {surname} include {', '.join(people)}.",
                )
            )
    return out


_SINGLE = {
    "born_in": ("Where was {s} born?", "In which city was {s} born?"),
    "located_in": ("In which country is {s} located?", "Which country is {s} in?"),
    "founded_by": ("Who founded {s}?", "Who is the founder of {s}?"),
    "headquartered_in": ("Where is {s} headquartered?", "In which city is {s} based?"),
}
_TWO = {
    ("born_in", "located_in"): ("In which country was {s} born?", "What country was {s} born in?"),
    ("founded_by", "born_in"): (
        "Where was the founder of {s} born?",
        "In which city was the founder of {s} born?",
    ),
    ("headquartered_in", "located_in"): (
        "In which country is {s} headquartered?",
        "In which country is {s} based?",
    ),
}


def _facts(r: Region) -> dict[str, dict[str, str]]:
    """relation -> {subject: object} inside one region."""
    return {
        "born_in": {p.name: p.born_in for p in r.people},
        "located_in": dict(r.city_country),
        "founded_by": {c.name: c.founded_by for c in r.companies},
        "headquartered_in": {c.name: c.headquartered_in for c in r.companies},
    }


def hop_query(hop: dict[str, str]) -> str:
    """What the scripted teacher searches for ``hop``: its ``query`` where it has one (a transfer
    world's selection searches the options at once), else its subject."""
    return hop.get("query", hop["subject"])


def _questions(r: Region, rng: random.Random) -> list[dict[str, Any]]:
    facts = _facts(r)
    rows: list[dict[str, Any]] = []

    def add(qtype: str, relation: str, template: str, hops: list[dict[str, str]]) -> None:
        subject, answer = hops[0]["subject"], hops[-1]["answer"]
        entities = [subject] + [h["answer"] for h in hops]
        rows.append(
            {
                "id": f"{r.split}-{len(rows)}",
                "question": template.format(s=subject),
                "golden_answers": [answer],
                "type": qtype,
                "relation": relation,
                "hops": hops,
                "entities": entities,
                "split": r.split,
            }
        )

    for relation, table in facts.items():
        for subject, obj in table.items():
            add(
                "single_hop",
                relation,
                rng.choice(_SINGLE[relation]),
                [{"subject": subject, "relation": relation, "answer": obj}],
            )
    for (first, second), templates in _TWO.items():
        for subject, bridge in facts[first].items():
            hops = [
                {"subject": subject, "relation": first, "answer": bridge},
                {"subject": bridge, "relation": second, "answer": facts[second][bridge]},
            ]
            add("two_hop", f"{first}+{second}", rng.choice(templates), hops)
    rng.shuffle(rows)
    for i, row in enumerate(rows):
        row["id"] = f"{r.split}-{i}"
    return rows


def build_world(
    seed: int, sizes: dict[str, RegionSize] | None = None, avoid: frozenset[str] = frozenset()
) -> World:
    """The world of ``seed`` (``sizes``: per-split region sizes, default ``DEFAULT_SIZES``).

    ``avoid``: names this world must not use — single words (places, countries, company stems)
    and full person names, e.g. :func:`entity_names` of another world, so that both worlds' passages
    can share one corpus without contradicting each other. Empty (the default): unchanged draws.
    """
    sizes = dict(sizes or DEFAULT_SIZES)
    if set(sizes) != set(SPLITS):
        raise ValueError(f"sizes must have exactly the splits {SPLITS}, got {sorted(sizes)}")
    rng = random.Random(f"world:{seed}")
    names = _Names(rng, avoid)
    regions = [_region(split, sizes[split], names, rng) for split in SPLITS]
    texts = _passages(regions, rng)
    rng.shuffle(texts)
    passages = [{"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(texts)]
    questions = {r.split: _questions(r, rng) for r in regions}
    return World(seed=seed, passages=passages, questions=questions, sizes=sizes)


def entity_names(w: World) -> frozenset[str]:
    """Every entity name of ``w`` that another world must avoid (``build_world(avoid=...)``): full
    names (people, companies, cities, countries) and the company stems."""
    names = {e for rows in w.questions.values() for r in rows for e in r["entities"]}
    return frozenset(names | {n.split()[0] for n in names if n.split()[-1] in COMPANY_SUFFIXES})


# ---- files -------------------------------------------------------------------------------------


def stamp_matches(out: str | Path, want: dict[str, Any]) -> bool:
    """Whether ``out/world.json`` exists and holds every key of ``want`` with its value (a folder
    built by another seed, kind or generator version does not match and is rebuilt)."""
    meta = Path(out) / "world.json"
    if not meta.is_file():
        return False
    info = json.loads(meta.read_text())
    return all(info.get(k) == v for k, v in want.items())


def write_world(world: World, out: str | Path) -> Path:
    """Write the world's files under ``out`` (see the module docstring); returns ``out``."""
    from search_env.data import QARow, write_parquet  # heavy: search_env.data imports pandas

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(world.passages, out / "corpus.jsonl")
    for split, rows in world.questions.items():
        write_jsonl(rows, out / f"{split}.jsonl")
    for qtype in TYPES:
        write_jsonl(
            [r for r in world.questions["test"] if r["type"] == qtype], out / "test" / f"{qtype}.jsonl"
        )
    for split in ("train", "val"):
        rows = world.questions[split]
        qa = [QARow(id=r["id"], question=r["question"], golds=list(r["golden_answers"])) for r in rows]
        write_parquet(qa, [r["type"] for r in rows], split, out / f"{split}.parquet")
    meta = {
        "seed": world.seed,
        "version": WORLD_VERSION,
        "sizes": {k: asdict(v) for k, v in world.sizes.items()},
        "passages": len(world.passages),
        "questions": {
            s: {t: sum(r["type"] == t for r in rows) for t in TYPES} for s, rows in world.questions.items()
        },
    }
    (out / "world.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m search_demo.world", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seed", type=int, required=True, help="world seed (names, relations, question order)"
    )
    parser.add_argument(
        "--out", required=True, help="output folder (created; a world of the same seed is rewritten)"
    )
    args = parser.parse_args(argv)
    meta = Path(args.out) / "world.json"
    held = json.loads(meta.read_text()).get("seed") if meta.is_file() else args.seed
    if held != args.seed:
        parser.error(
            f"--out {args.out} already holds the world of seed {held}; "
            "runs trained or evaluated on it would silently see another corpus: remove that folder "
            "or choose another --out"
        )
    world = build_world(args.seed)
    out = write_world(world, args.out)
    counts = ", ".join(f"{s} {len(rows)}" for s, rows in world.questions.items())
    print(f"world seed {args.seed}: {len(world.passages)} passages, questions {counts} -> {out}")


def two_world_main(
    argv: list[str] | None, module: str, doc: str, label: str, write: Callable[[int, int, Path], Path]
) -> None:
    """``python -m search_demo.<module> --seed S --unseen-seed U --out DIR``: ``write(S, U, DIR)``
    (a world trained on and one only tested on), then one line naming ``label`` and the counts."""
    parser = argparse.ArgumentParser(prog=f"python -m search_demo.{module}", description=doc.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True, help="seed of the world trained on")
    parser.add_argument("--unseen-seed", type=int, required=True, help="seed of the world only tested on")
    parser.add_argument("--out", required=True, type=Path, help="output folder (created or rewritten)")
    args = parser.parse_args(argv)
    out = write(args.seed, args.unseen_seed, args.out)
    meta = json.loads((out / "world.json").read_text())
    splits = ", ".join(f"{k} {meta[k]}" for k in ("train", "val", "test") if k in meta)
    print(
        f"{label} {args.seed} (+ unseen {args.unseen_seed}): {meta['passages']} passages, {splits} -> {out}"
    )


if __name__ == "__main__":
    main()
