"""Warm start of the CPU demo: the shipped base model SFT-trained, briefly, on protocol trajectories.

A deliberately flawed teacher (:class:`TeacherClient`, :func:`stopped_early`) is rolled out
through verl's own agent loop against a real BM25 server, so the SFT tokens are exactly a GRPO
rollout's; :func:`sft` is a plain torch loop. :func:`ensure_warm_start` copies the shipped build
(``SHIPPED``) whose :func:`cache_key` matches, else trains. Why and how: docs/training.md ("The
CPU demo", step 3, and "Shipped warm starts").

    python -m search_demo.warm_start --out DIR [--base DIR] [--regime R] [--seed N] [--steps N] [--force]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from search_demo import base_model, world
from search_demo.trajectories import REFERENCE_WORLD_SEED, assistant_message, render_trajectory, turn_text
from search_env import protocol
from search_env.paths import REPO_ROOT, repo_relative
from search_env.retrieval.process import spawn_server
from search_env.safe_fs import UnsafeDeleteError, replace_durably

WARM_START_VERSION = 3
"""Bumped when this module's output changes for the same inputs."""
STAMP = "warm_start.json"


@dataclass(frozen=True)
class WarmStartConfig:
    """What the warm start trains on and how long (counts of questions, optimiser steps)."""

    seed: int = 0
    single_hop: int = 80
    """Single-hop training questions demonstrated per SFT world (at most the split's count)."""
    two_hop: int = 64
    """Two-hop training questions demonstrated per SFT world (fewer than single-hop)."""
    two_hop_stop_early: float = 0.35
    """Fraction of the two-hop demonstrations in which the teacher answers right after its first
    search, with the name that search found (the bridge entity: the classic multi-hop error;
    :func:`stopped_early`). A deliberately flawed teacher, so GRPO, rewarded for the final answer,
    has a behaviour to learn: the greedy warm start then stops after one search on most two-hop
    questions (held-out two-hop EM 0.37, single-hop 0.81), while its samples (T=1) still search a
    second time often enough to score. Measured on the demo (docs/training.md): 0.15 left the
    greedy policy searching twice already (two-hop EM 0.73: little to learn), 0.5 stopped it
    always (two-hop EM 0.00; GRPO then raised aborts to 0.34); 0 is a flawless teacher."""
    phrased_answer: float = 0.0
    """Fraction of the demonstrations in which the teacher answers with the name inside a short
    phrase ("in Velmora", "by Ana Belt"; :func:`answered_in_a_phrase`) instead of the bare name, as
    a small untrained model answers. EM scores it 0 and F1 gives it partial credit (0.67-0.8), so a
    high value makes the sparse regime (:data:`REGIMES`): the greedy warm start phrases almost every
    answer, its samples give the bare name now and then. 0 (the dense regime): every answer bare."""
    steps: int = 250
    """SFT steps: deliberately partial (with a flawless teacher, 400 gave held-out EM 0.725, two-hop 0.75)."""
    name_weight: float = 5.0
    """Loss weight of the name tokens the model writes (its queries and answers), other written
    tokens 1: the protocol's format tokens otherwise dominate, and the SFT collapses to answering
    one frequent name once two-hop demonstrations are more than a few (32-48 per world, weight 1)."""
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 10
    max_turns: int = 3
    """Assistant turns of a demonstration rollout (a two-hop demonstration needs 3)."""


# ---- the teacher -------------------------------------------------------------------------------


class TeacherClient:
    """A verl ``LLMServerClient`` stand-in that answers each turn with the oracle's tokens.

    Knows each question's row (by its user message); turn = assistant turns already in the prompt.
    ``failed`` collects the ids of the rows whose retrieved passages lacked the fact the next turn
    needs (the hop's subject passage), so their demonstrations can be dropped.
    """

    def __init__(self, config: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], facts: dict[str, str]):
        from verl.workers.rollout.llm_server import LLMServerClient  # heavy: verl, teacher rollouts only

        self._base = LLMServerClient(config, load_balancer_handle=None)
        self.tokenizer = tokenizer
        self.rows = {protocol.build_messages(r["question"])[0]["content"].strip(): r for r in rows}
        self.facts = facts
        self.failed: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def _row(self, prompt_text: str) -> dict[str, Any]:
        start = prompt_text.index("<|im_start|>user\n") + len("<|im_start|>user\n")
        return self.rows[prompt_text[start : prompt_text.index("<|im_end|>", start)].strip()]

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ):
        from verl.workers.rollout.replica import TokenOutput  # heavy: verl, only for the teacher rollouts

        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        row = self._row(prompt_text)
        turn = prompt_text.count("<|im_start|>assistant") - 1
        if turn > 0:  # the previous search must have surfaced its hop's passage
            blocks = protocol.tool_response_contents(prompt_text.rsplit("<|im_start|>user", 1)[-1])
            fact = self.facts.get(row["hops"][turn - 1]["subject"])
            if fact is None or fact not in blocks:
                self.failed.add(row["id"])
        ids = protocol.scripted_turn_ids(
            self.tokenizer, turn_text(prompt_text, assistant_message(row, turn), row["question"])
        )
        ids = ids[: max(1, int(sampling_params.get("max_tokens") or len(ids)))]
        return TokenOutput(
            token_ids=ids, log_probs=[0.0] * len(ids), stop_reason="completed", extra_fields={}
        )


@contextlib.contextmanager
def bm25_server(corpus: Path, port: int | None = None) -> Iterator[str]:
    """A real BM25 retrieval server (``python -m search_env.retrieval serve``) over ``corpus``; yields
    its URL. Meanwhile SIGTERM to this process (in its main thread) raises KeyboardInterrupt, so a
    terminated build stops the server instead of leaving it behind."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
    try:
        with spawn_server(["--backend", "bm25", "--corpus", str(corpus)], port=port) as server:
            yield server.url
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def stopped_early(row: dict[str, Any]) -> dict[str, Any]:
    """The flawed teacher's version of a two-hop ``row``: its first hop only, answered with that
    hop's answer (the bridge entity), which is not the question's answer."""
    return {**row, "hops": row["hops"][:1], "golden_answers": [row["hops"][0]["answer"]]}


ANSWER_PHRASES = {
    "born_in": "in {a}",
    "located_in": "in {a}",
    "founded_by": "by {a}",
    "headquartered_in": "in {a}",
}
"""The phrase a phrased answer puts the name in, by the last hop's relation."""


def answered_in_a_phrase(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` answered with its answer in the phrase of its last hop's relation
    (:data:`ANSWER_PHRASES`), e.g. "in Velmora" for "Velmora": right, but not an exact match."""
    hop = row["hops"][-1]
    return {**row, "golden_answers": [ANSWER_PHRASES[hop["relation"]].format(a=row["golden_answers"][0])]}


def _pick_rows(rows: Sequence[dict[str, Any]], cfg: WarmStartConfig) -> list[dict[str, Any]]:
    """The demonstrated rows of one world, in SFT order; ``cfg.two_hop_stop_early`` of the two-hop
    ones (a seeded draw) replaced by :func:`stopped_early`, then ``cfg.phrased_answer`` of all of
    them (another seeded draw, so it leaves the first unchanged) by :func:`answered_in_a_phrase`."""
    rng = random.Random(f"warm_start:{cfg.seed}")
    single = [r for r in rows if r["type"] == "single_hop"]
    two = [r for r in rows if r["type"] == "two_hop"]
    picked = rng.sample(single, min(cfg.single_hop, len(single))) + rng.sample(
        two, min(cfg.two_hop, len(two))
    )
    rng.shuffle(picked)
    early = random.Random(f"stop_early:{cfg.seed}")
    picked = [
        stopped_early(r) if r["type"] == "two_hop" and early.random() < cfg.two_hop_stop_early else r
        for r in picked
    ]
    phrased = random.Random(f"phrased:{cfg.seed}")
    return [answered_in_a_phrase(r) if phrased.random() < cfg.phrased_answer else r for r in picked]


def demonstrations(
    model_dir: Path,
    world_dir: Path,
    cfg: WarmStartConfig,
    retrieval_url: str,
    picked: Sequence[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Teacher rollouts of the training questions through verl's agent loop: SFT samples + counts.

    Each sample is ``{"ids": prompt + response token ids, "mask": 1 on the model's own tokens}``.
    ``picked``: the rows to demonstrate, in order (default: :func:`_pick_rows` of the world's
    ``train.jsonl``); counts are per row ``type``.
    """
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker  # heavy: verl, teacher rollouts only

    import search_env.agent_loop  # noqa: F401  (registers search_agent)
    from search_env.verl_glue import (  # heavy: verl, only for the teacher rollouts
        compose_rollout_config,
        rows_to_batch,
        write_tool_config,
    )

    if picked is None:
        rows = [json.loads(line) for line in (world_dir / "train.jsonl").read_text().splitlines()]
        picked = _pick_rows(rows, cfg)
    facts = {}
    for line in (world_dir / "corpus.jsonl").read_text().splitlines():
        contents = json.loads(line)["contents"]
        facts[contents.split("\n", 1)[0].strip('"')] = protocol.cap_chunk(contents)
    with tempfile.TemporaryDirectory() as tmp:
        tools = write_tool_config(Path(tmp) / "tools.yaml", [retrieval_url])
        config = compose_rollout_config(
            model_dir,
            tools,
            prompt_length=512,
            response_length=1024,
            overrides=[
                f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={cfg.max_turns}",
                *(
                    f"data.apply_chat_template_kwargs.{k}={json.dumps(v)}"
                    for k, v in protocol.CHAT_TEMPLATE_KWARGS.items()
                ),
            ],
        )

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        teacher = TeacherClient(config, tokenizer, picked, facts)
        worker = AgentLoopWorker(config, llm_client=teacher)
        verl_rows = [
            {
                "prompt": protocol.build_messages(r["question"]),
                "data_source": r["type"],
                "agent_name": "search_agent",
                "reward_model": {"style": "rule", "ground_truth": {"target": r["golden_answers"]}},
                "extra_info": {"index": i, "id": r["id"], "tools_kwargs": {}},
            }
            for i, r in enumerate(picked)
        ]
        batch = asyncio.run(worker.generate_sequences(rows_to_batch(verl_rows)))
    prompt_width = batch.batch["prompts"].shape[1]
    samples, counts = [], {"single_hop": 0, "two_hop": 0, "dropped": 0}
    for i in range(len(batch)):
        attn = batch.batch["attention_mask"][i]
        prompt = batch.batch["prompts"][i][attn[:prompt_width] == 1].tolist()
        length = int(attn[prompt_width:].sum())
        response = batch.batch["responses"][i, :length].tolist()
        mask = batch.batch["response_mask"][i, :length].tolist()
        answered = protocol.render_answer(picked[i]["golden_answers"][0]) in tokenizer.decode(response)
        if picked[i]["id"] in teacher.failed or not answered:
            counts["dropped"] += 1
            continue
        counts[picked[i]["type"]] = counts.get(picked[i]["type"], 0) + 1
        samples.append({"ids": prompt + response, "mask": [0] * len(prompt) + mask})
    return samples, counts


# ---- SFT ---------------------------------------------------------------------------------------


def _batches(samples: Sequence[dict[str, Any]], cfg: WarmStartConfig) -> Iterator[list[dict[str, Any]]]:
    """``cfg.steps`` batches: epochs of seeded shuffles, each batch of similar lengths."""
    rng = random.Random(f"sft:{cfg.seed}")
    produced = 0
    while produced < cfg.steps:
        order = list(range(len(samples)))
        rng.shuffle(order)
        chunk = cfg.batch_size * 8
        for start in range(0, len(order), chunk):
            group = sorted(order[start : start + chunk], key=lambda i: len(samples[i]["ids"]))
            batches = [group[j : j + cfg.batch_size] for j in range(0, len(group), cfg.batch_size)]
            rng.shuffle(batches)
            for b in batches:
                if produced == cfg.steps:
                    return
                produced += 1
                yield [samples[i] for i in b]


def name_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the inventory's names (each one token, with or without a leading space)."""
    out = set()
    for word in world.INVENTORY.words():
        for variant in (word, f" {word}"):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if len(ids) == 1:
                out.add(ids[0])
    return out


def sft(
    model: Any,
    samples: Sequence[dict[str, Any]],
    cfg: WarmStartConfig,
    pad_id: int,
    log: Any = print,
    name_ids: set[int] = frozenset(),
) -> list[float]:
    """Train ``model`` in place on ``samples``; losses per step.

    Next-token loss on the tokens where ``mask`` is 1, weighted ``cfg.name_weight`` on those in
    ``name_ids`` (queries and answers) and 1 elsewhere, normalised by the weights' sum."""
    if not samples:
        raise ValueError("no demonstrations to train on (every teacher rollout was dropped)")
    torch.manual_seed(cfg.seed)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    def loss_of(batch: list[dict[str, Any]]) -> Any:
        weighted = [
            (
                s["ids"],
                [
                    m * (cfg.name_weight if t in name_ids else 1.0)
                    for t, m in zip(s["ids"], s["mask"], strict=True)
                ],
                [0] * len(s["ids"]),
            )
            for s in batch
        ]
        return base_model.weighted_loss(model, weighted, pad_id)

    def on_step(step: int, loss: float) -> None:
        if step % 10 == 0 or step == cfg.steps - 1:
            log(f"sft step {step + 1}/{cfg.steps}: loss {loss:.3f}")

    losses = base_model.optimise(model, _batches(samples, cfg), cfg.lr, lr_at, loss_of, on_step)
    model.eval()
    return losses


# ---- cache and build ---------------------------------------------------------------------------


REGIMES: dict[str, WarmStartConfig] = {
    "dense": WarmStartConfig(),
    "sparse": WarmStartConfig(phrased_answer=0.8, two_hop_stop_early=0.0),
}
"""The warm starts of the micro study's two reward regimes (``launch.assets.regime``;
docs/micro_study/regimes.md), the same but for the answer's form. ``dense``: bare answers,
held-out EM about 0.6 at step 0, a wrong rollout rarely has partial F1. ``sparse``: the paper's
regime, answers in a phrase (EM near the paper's 9 % floor at step 0, partial F1 common). A first
sparse teacher answered with whole sentences ("Ana Belt was born in Velmora"); its samples then
never searched twice on two-hop questions and scored 0 under every shape (measured; the
regimes page has the numbers), so the phrase is kept to one word. The sparse teacher never stops
early: with the dense regime's 35 % early stops, 13-16 % of the wrong sampled rollouts had partial
F1 (most were wrong entities, F1 0), under the regime's 25 % target; what GRPO has to learn here is
the answer's form, the behaviour EM rewards and F1 only partly."""


SFT_WORLD_SEEDS = range(-101, -107, -1)
"""The worlds whose training questions are demonstrated (seeds < 0: never a demo world). Several
worlds, so no small set of names recurs in the answers: the model has to copy, not recall."""


MAX_DROPPED_SHARE = 0.05
"""A world whose teacher rollouts drop more than this share fails the build (0 in every shipped
build; seen once: two of six worlds dropped whole, and the SFT went on with four)."""


def base_stamp(base: Path) -> dict[str, Any]:
    """The base model's stamp (``base_model.json``); a clear error when ``base`` holds no base model."""
    stamp = Path(base) / base_model.STAMP
    if not stamp.is_file() or not (Path(base) / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{base} holds no demo base model ({base_model.STAMP} + model.safetensors); the repository "
            f"ships one in {base_model.SHIPPED} (restore it with `git checkout -- assets/demo_base`) "
            "or rebuild it with `python -m search_demo.base_model --out DIR` (~30 min on 2 cores)"
        )
    return json.loads(stamp.read_text())


def cache_key(cfg: WarmStartConfig, base: Path) -> str:
    """Hash of everything the warm start depends on (see the module docstring)."""
    ref = world.build_world(REFERENCE_WORLD_SEED)
    sample = next(r for r in ref.questions["train"] if r["type"] == "two_hop")
    chunks = [[ref.passages[0]["contents"], ref.passages[1]["contents"]]] * 2
    parts = {
        "version": WARM_START_VERSION,
        "format": render_trajectory(sample, chunks),
        "stops": list(protocol.STOP_STRINGS),
        "tool_format": protocol.TOOL_FORMAT,
        "base": base_stamp(base)["key"],
        "world": {"version": world.WORLD_VERSION, "sft_seeds": list(SFT_WORLD_SEEDS)},
        "config": asdict(cfg),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _warn_if_base_stale(base: Path, log: Any) -> None:
    stamp = base_stamp(base)
    if stamp.get("key") != base_model.cache_key(base_model.BaseConfig(**stamp.get("config", {}))):
        log(
            f"note: the base model in {base} was built from other inputs (tokenizer texts, model "
            "config or curriculum changed since); it still works, its own tokenizer is used. "
            "Rebuild it with `python -m search_demo.base_model` to match the code."
        )


def build_warm_start(
    out: str | Path, cfg: WarmStartConfig = WarmStartConfig(), base: Path | None = None, log: Any = print
) -> Path:
    """Build the warm-started model into ``out`` (HF folder + ``warm_start.json``); returns ``out``.

    Starts from the base model in ``base`` (default: the shipped ``assets/demo_base``). The model
    depends on no demo world (demonstrations come from ``SFT_WORLD_SEEDS``, the base model's
    curriculum from others), so one warm start serves every demo world.
    """
    base = Path(base or base_model.SHIPPED)
    _warn_if_base_stale(base, log)

    def worlds(tmp: Path) -> Iterator[tuple[Path, None]]:
        for seed in SFT_WORLD_SEEDS:
            yield world.write_world(world.build_world(seed), tmp / f"world_{seed}"), None

    key = cache_key(cfg, base)
    return sft_into(Path(out), base, key, cfg, worlds, {"config": asdict(cfg)}, "warm start", log)


def sft_into(
    out: Path,
    base: Path,
    key: str,
    cfg: WarmStartConfig,
    worlds: Callable[[Path], Iterator[tuple[Path, Sequence[dict[str, Any]] | None]]],
    stamp: dict[str, Any],
    name: str,
    log: Any = print,
) -> Path:
    """Build a warm start into ``out`` (HF folder + ``warm_start.json``), stamped ``key``: a staged
    copy of ``base``, the teacher's :func:`demonstrations` in each world ``worlds(tmp)`` yields (a
    folder with ``corpus.jsonl``, and the rows to demonstrate or None for :func:`_pick_rows` of its
    ``train.jsonl``), ``cfg.steps`` of :func:`sft`; the stamp holds ``stamp`` and what every warm
    start records. ``name`` labels the log lines. ``out`` is replaced only once the build is whole."""
    base_model.own_folder(out, STAMP, check_only=True)
    started = time.monotonic()
    stage = base_model.new_stage(out.with_name(out.name + ".partial"), STAMP)
    shutil.copytree(base, stage, dirs_exist_ok=True)
    (stage / base_model.STAMP).unlink()
    tokenizer = AutoTokenizer.from_pretrained(stage)
    log(f"{name} {key}: from the base model {base} (key {base_stamp(base)['key']})")
    samples: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world_dir, picked in worlds(Path(tmp)):
            with bm25_server(world_dir / "corpus.jsonl") as url:
                got, c = demonstrations(stage, world_dir, cfg, url, picked=picked)
            log(f"{name}: {world_dir.name}: {c} ({time.monotonic() - started:.0f} s)")
            if c["dropped"] > MAX_DROPPED_SHARE * sum(c.values()):
                raise RuntimeError(
                    f"{name}: {world_dir.name}: {c['dropped']} of {sum(c.values())} teacher rollouts dropped "
                    f"(their search missed the hop's passage, or no answer): more than {MAX_DROPPED_SHARE:.0%}, "
                    "so the retriever failed its searches. Nothing was written. Fix: build again"
                )
            samples += got
            counts = {k: counts.get(k, 0) + v for k, v in c.items()}
    torch.set_num_threads(1)  # 3-8x faster than 2 threads on 2 busy cores; this model is too small to split
    model = AutoModelForImageTextToText.from_pretrained(stage, dtype=torch.float32)
    losses = sft(model, samples, cfg, tokenizer.pad_token_id, log=log, name_ids=name_token_ids(tokenizer))
    model.save_pretrained(stage)
    stamp = {
        "key": key,
        **stamp,
        "base": repo_relative(base),
        "base_key": base_stamp(base)["key"],
        "sft_worlds": list(SFT_WORLD_SEEDS),
        "demonstrations": counts,
        "tokens_per_demo": sum(len(s["ids"]) for s in samples) / len(samples),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "seconds": round(time.monotonic() - started, 1),
    }
    (stage / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    base_model.own_folder(out, STAMP)
    replace_durably(stage, out)
    log(f"{name} written to {out} in {stamp['seconds']} s (loss {losses[0]:.2f} -> {losses[-1]:.2f})")
    return out


def copy_shipped(shipped: Path, out: Path, key: str, name: str, log: Any = print) -> Path:
    """A durable copy of the built warm start ``shipped`` (stamped ``key``) at ``out`` (no SFT: same
    inputs)."""
    base_model.own_folder(out, STAMP, check_only=True)
    stage = base_model.new_stage(out.with_name(out.name + ".partial"), STAMP)
    shutil.copytree(shipped, stage, dirs_exist_ok=True)
    base_model.own_folder(out, STAMP)
    replace_durably(stage, out)
    log(f"{name} {key}: copied the shipped {repo_relative(shipped)} to {out} (no SFT: same inputs)")
    return out


SHIPPED = {name: REPO_ROOT / "assets" / f"warm_start_{name}" for name in ("dense", "sparse")}
"""The built warm start of each regime of :data:`REGIMES` (default steps, the shipped base model),
committed: see the module docstring. ``tests/search_demo/test_warm_start.py`` fails when one is stale."""


def stamp_key(folder: Path) -> str | None:
    """The :func:`cache_key` ``folder``'s stamp records (None: no stamp, so no warm start there)."""
    stamp = Path(folder) / STAMP
    return json.loads(stamp.read_text()).get("key") if stamp.is_file() else None


def ensure_warm_start(
    out: str | Path, cfg: WarmStartConfig = WarmStartConfig(), base: Path | None = None, log: Any = print
) -> Path:
    """``out`` if its stamp matches :func:`cache_key`; else a copy of the :data:`SHIPPED` warm start
    of that key, if any; else a fresh :func:`build_warm_start`."""
    out = Path(out)
    key = cache_key(cfg, Path(base or base_model.SHIPPED))
    if stamp_key(out) == key:
        return out
    shipped = next((f for f in SHIPPED.values() if stamp_key(f) == key), None)
    if shipped is None or shipped.resolve() == out.resolve():
        return build_warm_start(out, cfg, base=base, log=log)
    return copy_shipped(shipped, out, key, "warm start", log)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m search_demo.warm_start", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="model folder to write")
    parser.add_argument(
        "--base", type=Path, default=None, help="base model folder (default: assets/demo_base)"
    )
    parser.add_argument("--regime", choices=sorted(REGIMES), default="dense", help="REGIMES entry")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=WarmStartConfig.steps, help="SFT steps")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    args = parser.parse_args(argv)
    cfg = replace(REGIMES[args.regime], seed=args.seed, steps=args.steps)
    try:
        if args.force:
            build_warm_start(args.out, cfg, base=args.base)
        else:
            ensure_warm_start(args.out, cfg, base=args.base)
    except UnsafeDeleteError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
