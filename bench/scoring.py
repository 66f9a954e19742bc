"""Scoring throughput: reward_fns vs a straightforward reference loop, side by side.

Scores 51,713 synthetic (response, golds) rows — the size of the seven-benchmark suite — with
all three shapes (em_only, f1_only, f1_format) both ways, checks that the scores agree, and
prints rows/s and the ratio. The reference is the study's training scorer written as the textbook
per-metric loop (``training_m5_*/src/rewards/search_r1.py``: ``extract_solution``, ``em_check``,
``f1_check``): every metric re-extracts the answer and re-normalises prediction and golds.

    .venv/bin/python bench/scoring.py [--rows 51713] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import re
import string
import time
from collections import Counter

from reward_fns import SHAPES, score_rollout

WORDS = [
    "paris",
    "the",
    "river",
    "Thames",
    "a",
    "king",
    "of",
    "France",
    "1999",
    "yes",
    "no",
    "John",
    "Smith",
    "an",
    "Academy",
    "Award",
    "Best",
    "Film",
    "U.S.",
    "state",
    "Titan",
    "IIIE",
    "rocket",
]
CALL = "<tool_call>\n<function=search>\n<parameter=query>\n{q}\n</parameter>\n</function>\n</tool_call>"


def synthetic_rows(n: int, seed: int) -> list[tuple[str, list[str]]]:
    """Rollout-like responses (searches, tool responses, an answer) with 1-3 golds each."""
    rng = random.Random(seed)

    def phrase(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 3)):
            parts.append(CALL.format(q=phrase(4)))
            parts.append(
                f'\nuser\n<tool_response>\n"{phrase(2)}"\n{phrase(60)}\n</tool_response>\nassistant\n'
            )
        if rng.random() < 0.85:
            parts.append(f"<answer>{phrase(rng.randint(1, 4))}</answer>")
        rows.append(("".join(parts), [phrase(rng.randint(1, 3)) for _ in range(rng.randint(1, 3))]))
    return rows


# --- reference: straightforward per-metric loop -------------------------------------------


PUNCT = set(string.punctuation)


def ref_normalize(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def ref_answer(text: str) -> str | None:
    found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


def ref_em(pred: str, golds: list[str]) -> float:
    p = ref_normalize(pred)
    return float(any(p == ref_normalize(g) for g in golds))


def ref_f1(pred: str, golds: list[str]) -> float:
    best = 0.0
    p = ref_normalize(pred).split()
    for g in golds:
        t = ref_normalize(g).split()
        if not p and not t:
            best = max(best, 1.0)
            continue
        if not p or not t:
            continue
        common = sum((Counter(p) & Counter(t)).values())
        if common:
            prec, rec = common / len(p), common / len(t)
            best = max(best, 2 * prec * rec / (prec + rec))
    return best


def reference_scores(text: str, golds: list[str]) -> tuple[float, float, float]:
    """One metric call per shape, as a reward function per shape would do."""
    from reward_fns import is_well_formed  # the format gate is the same code both ways

    answer = ref_answer(text)
    em = ref_em(answer, golds) if answer is not None else 0.0
    f1 = ref_f1(ref_answer(text) or "", golds) if ref_answer(text) is not None else 0.0
    if not is_well_formed(text):
        fmt = 0.0
    else:
        f1_again = ref_f1(ref_answer(text) or "", golds) if ref_answer(text) is not None else 0.0
        fmt = f1_again if f1_again > 0 else 0.1
    return em, f1, fmt


def ours(text: str, golds: list[str]) -> tuple[float, float, float]:
    scored = score_rollout(text, golds)
    return tuple(fn(scored) for fn in SHAPES.values())  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=51_713)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = synthetic_rows(args.rows, args.seed)
    timings = {}
    results = {}
    for name, fn in (("reference", reference_scores), ("reward_fns", ours)):
        start = time.perf_counter()
        results[name] = [fn(text, golds) for text, golds in rows]
        timings[name] = time.perf_counter() - start
    mismatches = sum(
        any(abs(a - b) > 1e-12 for a, b in zip(r, o, strict=True))
        for r, o in zip(results["reference"], results["reward_fns"], strict=True)
    )
    for name, secs in timings.items():
        print(
            f"{name:>10}: {len(rows) / secs:>10,.0f} rows/s  ({secs:.2f} s for {len(rows):,} rows x 3 shapes)"
        )
    print(f"speed-up reward_fns / reference: {timings['reference'] / timings['reward_fns']:.2f}x")
    print(f"rows whose scores differ: {mismatches}")
    if mismatches:
        raise SystemExit("scores differ between reference and reward_fns")


if __name__ == "__main__":
    main()
