"""The transfer world's checks before any RL (A1-A4 of docs/micro_transfer.md), on shipped assets.

- A1 surface (:func:`surface_misses`): every token of every held-out prompt occurs in at least
  :data:`MIN_SEQUENCES` training sequences. Counted on parts of the real sequences, each tokenized
  as its sequence holds it: the rendered prompts of the warm start's demonstrations and of the RL
  training questions, and the base curriculum's ``Question: ...`` segments. Those are parts of
  their sequences, so the counts are lower bounds.
- A2 feasibility (:func:`oracle_feasibility`): the scripted teacher's searches through BM25 (the
  server's library, in process) within the turn and token limits; solved when every search
  surfaces its hop's passage and that passage states the hop's answer.
- A3/A4 (:func:`warm_start_rollouts`): warm-start rollouts through verl's agent loop
  (``cpu_engine.local_rollout``) against a real BM25 server, scored form-normalised
  (``reward_fns.metrics.form_normalised_em``).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reward_fns.answer import extract_answer
from search_demo import transfer_warm_start, transfer_world, world
from search_demo.trajectories import render_trajectory
from search_demo.warm_start import SFT_WORLD_SEEDS, bm25_server
from search_env import protocol
from search_env.jsonl import write_jsonl
from search_env.retrieval.corpus import Corpus

MIN_SEQUENCES = 20
"""A1: training sequences each held-out prompt token must occur in."""


@dataclass(frozen=True)
class Limits:
    """The rollout limits the checks hold the teacher and the model to (recipes/micro_transfer.yaml)."""

    max_turns: int = 5
    max_turn_tokens: int = 64
    max_response_tokens: int = 768
    topk: int = protocol.TOPK


# ---- A1 surface ----------------------------------------------------------------------------------


def prompt_texts(tokenizer: Any, questions: Iterable[str]) -> list[str]:
    """The rendered generation prompt of each question (the chat template, the tool, thinking on)."""
    head, tail = _prompt_parts(tokenizer)
    return [head + q + tail for q in questions]


def _prompt_parts(tokenizer: Any) -> tuple[str, str]:
    """The rendered prompt's text before and after the question."""
    marker = "\x00QUESTION\x00"
    text = tokenizer.apply_chat_template(
        protocol.build_messages(marker),
        tools=[protocol.SEARCH_TOOL_SCHEMA],
        add_generation_prompt=True,
        tokenize=False,
        **protocol.CHAT_TEMPLATE_KWARGS,
    )
    head, tail = text.split(marker)
    return head, tail


def _ids(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)]


def prompt_ids(tokenizer: Any, questions: Sequence[str]) -> list[list[int]]:
    """Token ids of :func:`prompt_texts`, the constant head tokenized once: a question starting with
    a capitalised word is its own pre-token (``tiny.DEMO_NAME_PATTERN``), so no merge crosses the
    head's end (ValueError for a question that does not start so)."""
    head, tail = _prompt_parts(tokenizer)
    bad = next((q for q in questions if not q[:1].isupper()), None)
    if bad is not None:
        raise ValueError(
            f"question {bad!r} does not start with a capital letter; tokenize prompt_texts instead"
        )
    head_ids = _ids(tokenizer, [head])[0]
    return [head_ids + ids for ids in _ids(tokenizer, [q + tail for q in questions])]


def _tokens(tokenizer: Any, texts: Sequence[str]) -> list[set[int]]:
    return [set(ids) for ids in _ids(tokenizer, texts)]


def _hits(passages: list[dict[str, str]], queries: list[str], topk: int) -> tuple[list[str], Any]:
    """(every passage's contents, the BM25 top-``topk`` row of each query) over ``passages``."""
    from search_env.retrieval.bm25 import BM25Retriever  # heavy: bm25s

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Corpus(write_jsonl(passages, Path(tmp) / "corpus.jsonl"))
        contents = [corpus.contents(i) for i in range(len(corpus))]
        hits, _ = BM25Retriever.build(corpus).search_rows(queries, topk)
        corpus.close()
    return contents, hits


def training_sequence_counts(
    tokenizer: Any, rl_rows: Sequence[dict[str, Any]], topk: int = protocol.TOPK
) -> Counter[int]:
    """token id -> a lower bound on the training sequences that hold it. Counted sequences, each
    from parts tokenized alone as the sequence holds them:

    - every warm-start demonstration (every SFT world): its rendered prompt and its tool turns
      (BM25 top-``topk`` per search, as the agent loop appends them);
    - every RL training prompt;
    - the base curriculum's search samples (every world): their question and answer segments.
    """
    sequences: list[set[int]] = []
    cfg = transfer_warm_start.TransferWarmStart()
    for seed in SFT_WORLD_SEEDS:
        picked = transfer_warm_start.pick_rows(transfer_world.sft_rows(seed), cfg, seed)
        contents, hits = _hits(
            transfer_world.sft_passages(seed), [world.hop_query(h) for r in picked for h in r["hops"]], topk
        )
        turns = [
            protocol.tool_turn_text(
                protocol.tool_response_text([protocol.cap_chunk(contents[int(i)]) for i in row if i >= 0])
            )
            for row in hits
        ]
        prompts = [set(ids) for ids in prompt_ids(tokenizer, [r["question"] for r in picked])]
        turn_tokens = iter(_tokens(tokenizer, turns))
        sequences += [
            p.union(*(next(turn_tokens) for _ in r["hops"])) for p, r in zip(prompts, picked, strict=True)
        ]
    sequences += [set(ids) for ids in prompt_ids(tokenizer, [r["question"] for r in rl_rows])]
    rows = transfer_world.base_curriculum_rows()
    segments = _tokens(
        tokenizer, [x for r in rows for x in (f"Question: {r['question']}\n", f" {r['golden_answers'][0]}")]
    )
    sequences += [segments[2 * j] | segments[2 * j + 1] for j in range(len(rows))]
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq)
    return counts


def surface_misses(
    tokenizer: Any, questions: Sequence[str], counts: Counter[int], min_count: int = MIN_SEQUENCES
) -> dict[str, int]:
    """Tokens (as text) of the prompts of ``questions`` held by fewer than ``min_count`` training
    sequences (``counts``: :func:`training_sequence_counts`), with their counts; empty: A1 passes."""
    misses: dict[str, int] = {}
    for ids in prompt_ids(tokenizer, questions):
        for t in ids:
            if counts[t] < min_count:
                misses[tokenizer.convert_ids_to_tokens(t)] = counts[t]
    return misses


# ---- A2 feasibility ------------------------------------------------------------------------------


def oracle_feasibility(
    world_dir: Path, tokenizer: Any, limits: Limits = Limits(), benchmarks: Sequence[str] | None = None
) -> dict[str, float]:
    """Per benchmark of ``world_dir/test``: the share of questions the scripted teacher solves
    within ``limits`` (every search surfaces its hop's passage, which states the hop's answer; the
    searches and the answer fit the turns; each turn and the whole response fit the tokens)."""
    from search_env.retrieval.bm25 import BM25Retriever  # heavy: bm25s

    corpus = Corpus(world_dir / "corpus.jsonl")
    contents = [corpus.contents(i) for i in range(len(corpus))]
    bm25 = BM25Retriever.build(corpus)
    out = {}
    for name in benchmarks or transfer_world.BENCHMARKS:
        rows = [json.loads(x) for x in (world_dir / "test" / f"{name}.jsonl").read_text().splitlines()]
        queries = [world.hop_query(h) for r in rows for h in r["hops"]]
        hits, _ = bm25.search_rows(queries, limits.topk)
        k, solved = 0, 0
        for row in rows:
            chunks, ok = [], len(row["hops"]) + 1 <= limits.max_turns
            for hop in row["hops"]:
                got = [contents[int(i)] for i in hits[k] if i >= 0]
                k += 1
                fact = next((c for c in got if c.split("\n", 1)[0].strip('"') == hop["subject"]), None)
                ok = ok and fact is not None and hop["answer"] in fact
                chunks.append(got)
            if ok:
                ok = _fits(tokenizer, row, chunks, limits)
            solved += ok
        out[name] = solved / len(rows)
    return out


def _fits(tokenizer: Any, row: dict[str, Any], chunks: list[list[str]], limits: Limits) -> bool:
    """Whether the teacher's rollout of ``row`` fits the response and per-turn token limits."""
    prompt = prompt_texts(tokenizer, [row["question"]])[0]
    text = render_trajectory(row, chunks)
    response = len(tokenizer(text[len(prompt) :], add_special_tokens=False)["input_ids"])
    turns = [t.split("<|im_end|>")[0] for t in text[len(prompt) :].split("<|im_start|>assistant\n")]
    longest = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in turns)
    return response <= limits.max_response_tokens and longest <= limits.max_turn_tokens


# ---- A3/A4 rollouts ------------------------------------------------------------------------------


@contextlib.contextmanager
def warm_start_rollouts(
    model_dir: Path, corpus: Path, seed: int = 0, limits: Limits = Limits()
) -> Iterator[Callable[[Sequence[dict[str, Any]], int, bool], list[list[str | None]]]]:
    """Yields ``answers(rows, n, greedy)``: per row, the final answers of ``n`` rollouts of the
    model in ``model_dir`` (greedy, or sampled at T = 1; ``seed`` fixes the samples) through verl's
    agent loop against a BM25 server over ``corpus``, within ``limits`` (None: no answer)."""
    from cpu_engine.hf_generate import HFGenerator  # heavy: torch, verl
    from cpu_engine.local_rollout import LocalRollout  # heavy: verl
    from search_demo.rollout import demo_rollout_config  # heavy: verl's config
    from search_env.verl_glue import rollout_records, write_tool_config  # heavy: verl

    with tempfile.TemporaryDirectory() as tmp, bm25_server(corpus) as url:
        tools = write_tool_config(Path(tmp) / "tools.yaml", [url])
        config = demo_rollout_config(
            model_dir,
            tools,
            overrides=[
                f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={limits.max_turns}",
                f"actor_rollout_ref.rollout.response_length={limits.max_response_tokens}",
                f"actor_rollout_ref.rollout.custom.{protocol.TURN_TOKENS_KEY}={limits.max_turn_tokens}",
                f"actor_rollout_ref.rollout.max_model_len={256 + limits.max_response_tokens}",
            ],
        )
        generator = HFGenerator(str(model_dir), max_new_tokens=limits.max_turn_tokens, seed=seed)
        rollout = LocalRollout(config, generator)

        def answers(
            rows: Sequence[dict[str, Any]], n: int = 1, greedy: bool = True
        ) -> list[list[str | None]]:
            verl_rows = [
                {
                    "prompt": protocol.build_messages(r["question"]),
                    "data_source": r["type"],
                    "agent_name": "search_agent",
                    "extra_info": {"index": i, "tools_kwargs": {}},
                }
                for i, r in enumerate(rows)
            ]
            batch = rollout.generate(verl_rows, n=n, validate=greedy)
            records = rollout_records(batch, rollout.tokenizer, skip_special_tokens=True)
            got = [extract_answer(r["response"]) for r in records]
            return [got[i * n : (i + 1) * n] for i in range(len(rows))]

        try:
            yield answers
        finally:
            generator.close()
