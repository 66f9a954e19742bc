"""Scoring speed: reward_fns vs the study's code, side by side, in two sections.

``throughput``: scores 51,713 synthetic (response, golds) rows — the size of the seven-benchmark
suite — with all three shapes (em_only, f1_only, f1_format) both ways, checks that the scores
agree, and prints rows/s and the ratio. The reference is the study's training scorer written as
the textbook per-metric loop (``training_m5_*/src/rewards/search_r1.py``: ``extract_solution``,
``em_check``, ``f1_check``): every metric re-extracts the answer and re-normalises prediction and
golds.

``worst-case``: responses flooded with one tag or prefix (24 kB, 48 kB, 200 kB), on which the
study's lazy regexes backtrack quadratically (exponentially for the format gate's parameter
blocks). Prints the time of the fastest call (of repeated calls; robust to a shared machine's load)
of each of the three shapes (``compute_score``), the format gate,
the query parser and the tool-response reader next to the study's regexes on the same input, and
the ratio; checks that both give the same result. A regex whose predicted time (quadratic
extrapolation from a smaller input of the same flood; 2^k for the parameter blocks) exceeds
``--regex-budget`` seconds is skipped, and the output says so.

    .venv/bin/python bench/scoring.py [--rows 51713] [--seed 0] [--only throughput|worst-case]
                                      [--regex-budget 30]
"""

from __future__ import annotations

import argparse
import math
import random
import re
import string
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from reward_fns import SHAPES, extract_answer, format_violation, score_rollout
from reward_fns.compute_score import compute_score
from search_env.paths import REPO_ROOT
from search_env.protocol import parse_query, tool_response_contents

sys.path.insert(0, str(REPO_ROOT / "tests"))
from study_reference import (  # noqa: E402  the study's regexes: tests/study_reference.py
    study_extract_answer,
    study_format_violation,
    study_parse_query,
    study_tool_response_contents,
)

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


def throughput(rows_n: int, seed: int) -> None:
    """Rows/s of reward_fns vs the reference loop on ``rows_n`` synthetic rows; exits 1 if scores differ."""
    rows = synthetic_rows(rows_n, seed)
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


# --- worst case: the study's regexes on flooded responses ------------------------------------

GOLDS = ["word", "Paris"]


def study_em_only(text: str) -> float:
    answer = study_extract_answer(text)
    return ref_em(answer, GOLDS) if answer is not None else 0.0


def study_f1_only(text: str) -> float:
    answer = study_extract_answer(text)
    return ref_f1(answer, GOLDS) if answer is not None else 0.0


def study_f1_format(text: str) -> float:
    if study_format_violation(text) is not None:
        return 0.0
    answer = study_extract_answer(text)
    f1 = ref_f1(answer, GOLDS) if answer is not None else 0.0
    return f1 if f1 > 0 else 0.1


def _shape(name: str) -> Callable[[str], float]:
    return lambda text: compute_score(solution_str=text, ground_truth=GOLDS, shape=name)["score"]


Growth = Literal["polynomial", "exponential"]


@dataclass(frozen=True)
class Flood:
    """A response made of ``k`` repeats of a unit: ``build(k)``, about ``unit_chars * k`` characters.

    ``growth``: how the study's regexes scale on it, ``polynomial`` in ``k`` (the degree is measured,
    at least 2) or ``exponential`` (2^k).
    """

    name: str
    build: Callable[[int], str]
    unit_chars: int
    growth: Growth = "polynomial"


FLOODS = {
    "answer": Flood("</think> + <answer> * k", lambda k: "</think>" + "<answer>" * k, 8),
    "answer_pairs": Flood("<answer>a</answer> * k", lambda k: "</think>" + "<answer>a</answer>" * k, 18),
    "long_answer": Flood(
        "<answer> + word * k + </answer>", lambda k: "</think><answer>" + "word " * k + "</answer>", 5
    ),
    "answer_near_close": Flood(
        "<answer> + </answe * k + </answer>", lambda k: "</think><answer>" + "</answe" * k + "</answer>", 7
    ),
    "calls": Flood(
        "</tool_call> * k + <tool_call> * k",
        lambda k: "</think>" + "</tool_call>" * k + "<tool_call>" * k,
        23,
    ),
    "valid_calls": Flood(
        "closed calls * k + answer",
        lambda k: (
            "</think>"
            + "<tool_call><function=f><parameter=p>v</parameter></function></tool_call>" * k
            + "<answer>word</answer>"
        ),
        72,
    ),
    "call_near_close": Flood(
        "<tool_call> + </tool_cal * k + </tool_call>",
        lambda k: "</think><tool_call>" + "</tool_cal" * k + "</tool_call><answer>a</answer>",
        10,
    ),
    "heads": Flood(
        "call of (<function=f><parameter=p>) * k",
        lambda k: "</think><tool_call>" + "<function=f><parameter=p>" * k + "</tool_call><answer>a</answer>",
        25,
    ),
    "params": Flood(
        "call of <parameter=p>v</parameter> * k, no </function>",
        lambda k: (
            "</think><tool_call><function=f>"
            + "<parameter=p>v</parameter>" * k
            + "</tool_call><answer>a</answer>"
        ),
        26,
        "exponential",
    ),
    "query_params": Flood(
        "<tool_call> + <parameter=query> * k", lambda k: "<tool_call>" + "<parameter=query>" * k, 17
    ),
    "query_closes": Flood(
        "<tool_call><parameter=query> + q</parameter> * k",
        lambda k: "<tool_call><parameter=query>" + "q</parameter>" * k,
        13,
    ),
    "query_spaces": Flood(
        "<tool_call><parameter=query> + whitespace * k",
        lambda k: "<tool_call><parameter=query>" + " \n" * k + "q",
        2,
    ),
    "open_calls": Flood("<tool_call> * k", lambda k: "<tool_call>" * k, 11),
    "responses": Flood("<tool_response>\\n * k", lambda k: "<tool_response>\n" * k, 16),
    "responses_near_close": Flood(
        "<tool_response>\\n + \\n</tool_respons * k + close",
        lambda k: "<tool_response>\n" + "\n</tool_respons" * k + "\n</tool_response>",
        15,
    ),
}
"""Floods, by key: most make one scan of the study's regexes rescan (or re-split) the rest; the
``*_near_close``, ``*_pairs``, ``long_answer`` and ``valid_calls`` ones are the slowest inputs for the
linear code (no regex blow-up there)."""

SHAPE_FLOODS = [
    "answer",
    "answer_pairs",
    "long_answer",
    "answer_near_close",
    "calls",
    "valid_calls",
    "heads",
    "params",
]
CASES: list[tuple[str, Callable[[str], object], Callable[[str], object], list[str]]] = [
    ("em_only", _shape("em_only"), study_em_only, SHAPE_FLOODS),
    ("f1_only", _shape("f1_only"), study_f1_only, SHAPE_FLOODS),
    ("f1_format", _shape("f1_format"), study_f1_format, SHAPE_FLOODS),
    (
        "format_violation",
        format_violation,
        study_format_violation,
        ["calls", "valid_calls", "call_near_close", "heads", "params"],
    ),
    (
        "extract_answer",
        extract_answer,
        study_extract_answer,
        ["answer", "answer_pairs", "long_answer", "answer_near_close"],
    ),
    (
        "parse_query",
        parse_query,
        study_parse_query,
        ["open_calls", "query_params", "query_closes", "query_spaces"],
    ),
    (
        "tool_response_contents",
        tool_response_contents,
        study_tool_response_contents,
        ["responses", "responses_near_close"],
    ),
]
"""(function, ours, the study's, flood keys)."""

WORST_CASE_SIZES = (24_000, 48_000, 200_000)
"""Response sizes, in characters (ASCII: one byte each)."""
EXPONENTIAL_CALIBRATION_K = 16
"""Parameter blocks in the input that calibrates the 2^k prediction."""


class RegexCost:
    """Predicts the seconds one call of a study regex takes on ``flood.build(k)``.

    Polynomial floods: measured on doubling ``k`` (from 8 units, until a call takes 20 ms or ``k``
    reaches ``max_k``), the degree taken from the last two points and never below 2, then
    extrapolated from the largest input measured so far (:meth:`observe` adds one). Exponential
    floods: one measurement at ``EXPONENTIAL_CALIBRATION_K`` blocks, doubled per further block.
    """

    def __init__(self, study_fn: Callable[[str], object], flood: Flood, max_k: int) -> None:
        self.flood = flood
        if flood.growth == "exponential":
            self.k, self.seconds = EXPONENTIAL_CALIBRATION_K, self._time(study_fn, EXPONENTIAL_CALIBRATION_K)
            self.degree = 0.0
            return
        points = [(8, self._time(study_fn, 8))]
        while points[-1][1] < 0.02 and points[-1][0] * 2 <= max_k:
            k = points[-1][0] * 2
            points.append((k, self._time(study_fn, k)))
        self.k, self.seconds = points[-1]
        self.degree = 2.0
        if len(points) > 1 and points[-2][1] >= 1e-3:
            self.degree = max(2.0, math.log2(points[-1][1] / points[-2][1]))

    def _time(self, study_fn: Callable[[str], object], k: int) -> float:
        return per_call(study_fn, self.flood.build(k), min_total_s=0.02)[0]

    def predict(self, k: int) -> float:
        if self.flood.growth == "exponential":
            log2_s = math.log2(max(self.seconds, 1e-9)) + (k - self.k)
            return math.inf if log2_s > 60 else 2.0**log2_s
        return self.seconds * (k / self.k) ** self.degree

    def observe(self, k: int, seconds: float) -> None:
        if self.flood.growth != "exponential":
            self.k, self.seconds = k, seconds


def per_call(fn: Callable[[str], object], text: str, min_total_s: float = 0.2) -> tuple[float, object]:
    """Seconds of the fastest call of ``fn(text)`` among calls repeated for at least ``min_total_s``
    (at least 3), and its result: the fastest call is what the code costs; slower ones measure the
    other load of a shared machine."""
    best, calls, start = float("inf"), 0, time.perf_counter()
    while True:
        began = time.perf_counter()
        result = fn(text)
        best = min(best, time.perf_counter() - began)
        calls += 1
        if calls >= 3 and time.perf_counter() - start >= min_total_s:
            return best, result


def _same(ours_result: object, study_result: object) -> bool:
    if isinstance(ours_result, float):
        return abs(ours_result - float(study_result)) < 1e-12  # type: ignore[arg-type]
    return ours_result == study_result


def worst_case(regex_budget_s: float, sizes: tuple[int, ...] = WORST_CASE_SIZES) -> None:
    """One line per (function, flood, size in characters): ms per call both ways and the ratio.

    Exits 1 if a result differs between the new code and the study's regexes where both ran.
    """
    print(
        f"worst case: ms per call, reward_fns/protocol vs the study's regexes on the same flooded response "
        f"(regex skipped where predicted > {regex_budget_s:.0f} s)"
    )
    print(f"{'function':<22} {'flood':<52} {'size':>7} {'new ms':>9} {'regex ms':>11} {'regex/new':>10}")
    worst: dict[str, tuple[float, str]] = {}
    differ = 0
    for function, ours_fn, study_fn, keys in CASES:
        for key in keys:
            flood = FLOODS[key]
            cost = RegexCost(study_fn, flood, sizes[0] // flood.unit_chars)
            for size in sizes:
                k = size // flood.unit_chars
                text = flood.build(k)
                new_s, new_result = per_call(ours_fn, text)
                if new_s > worst.get(function, (0.0, ""))[0]:
                    worst[function] = (new_s, f"{flood.name}, {len(text) / 1000:.0f} kB")
                predicted_s = cost.predict(k)
                if predicted_s > regex_budget_s:
                    shown = f"> 1e18 s, 2^{k} splits" if math.isinf(predicted_s) else f"~{predicted_s:,.0f} s"
                    regex_cell, ratio_cell = "skipped", f"(predicted {shown})"
                else:
                    study_s, study_result = per_call(study_fn, text, min_total_s=0.05)
                    cost.observe(k, study_s)
                    differ += not _same(new_result, study_result)
                    ratio = study_s / new_s
                    regex_cell = f"{study_s * 1e3:,.2f}"
                    ratio_cell = f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.2f}x"
                print(
                    f"{function:<22} {flood.name:<52} {len(text) / 1000:>5.0f}kB {new_s * 1e3:>9.3f} "
                    f"{regex_cell:>11} {ratio_cell:>10}"
                )
    print("worst new-code time per call at any size (target <= 20 ms at 200 kB):")
    for function, (secs, where) in worst.items():
        print(f"  {function:<22} {secs * 1e3:8.3f} ms  ({where})")
    print(f"inputs whose results differ between new code and the study's regexes: {differ}")
    if differ:
        raise SystemExit("results differ between the scanners and the study's regexes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=51_713)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("throughput", "worst-case"), help="run one section (default: both)")
    ap.add_argument(
        "--regex-budget",
        type=float,
        default=30.0,
        help="skip a study regex call predicted to take longer than this, in seconds (default 30)",
    )
    args = ap.parse_args()
    if args.only in (None, "throughput"):
        throughput(args.rows, args.seed)
    if args.only in (None, "worst-case"):
        worst_case(args.regex_budget)


if __name__ == "__main__":
    main()
