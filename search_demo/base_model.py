"""Build the demo's base model: a small ``qwen3_5`` LM that reads passages and searches, before any protocol.

The CPU demo's stand-in for the pretrained Qwen3.5-0.8B of the GPU recipes: a random 1.4M-parameter
model (``tiny.DEMO_TEXT_CONFIG``) trained on a plain-text reading curriculum (stages read, search and
wide; :class:`BaseConfig`) over fresh worlds (``BASE_WORLD_SEEDS``, never a demo world), then
widened to linear-attention head dim 64 (``search_demo.widen_heads``) so vLLM's CPU kernels serve it.
The build takes ~31 minutes, so it ships as ``assets/demo_base``;
``python -m search_demo.base_model --out assets/demo_base`` rebuilds it. The curriculum and why each
stage: docs/training.md, "The CPU demo" (item 2).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText

from search_demo import tiny, trajectories, widen_heads, world
from search_env import protocol
from search_env.paths import REPO_ROOT
from search_env.retrieval.bm25 import BM25Retriever
from search_env.retrieval.corpus import Corpus
from search_env.safe_fs import UnsafeDeleteError, check_owned, remove_owned, remove_tree, replace_durably

BASE_VERSION = 4
"""Bumped when this module's output changes for the same inputs."""
SHIPPED_LINEAR_HEAD_DIM = 64
"""Linear-attention head dim of the written model. The curriculum trains ``tiny.DEMO_TEXT_CONFIG``'s
32 and the result is widened exactly (``search_demo.widen_heads``): vLLM's CPU Gated-DeltaNet
kernel takes 64 or 128 only, and the narrow model trains faster."""
STAMP = "base_model.json"
SHIPPED = REPO_ROOT / "assets" / "demo_base"
"""The base model the repository ships (built by this module's CLI)."""
BASE_WORLD_SEEDS = tuple(range(-301, -313, -1))
"""Fresh worlds of the curriculum (seeds < 0: never a demo world)."""
HELD_OUT_SEED = -900
"""The world the curriculum's progress is measured on (in no training sample)."""
READ_TOPK = 3
"""Passages per search in the curriculum's first two stages (the wide stage: ``protocol.TOPK``)."""


@dataclass(frozen=True)
class BaseConfig:
    """The curriculum's length and optimiser (steps, sequences per step, learning rates)."""

    seed: int = 0
    read_steps: int = 500
    search_steps: int = 800
    wide_steps: int = 400
    """Steps of the wide stage (search and read samples with ``protocol.TOPK`` passages)."""
    batch_size: int = 32
    read_mix: int = 8
    """Read samples added to each search-stage batch (keeps the reading skill while searching is learnt)."""
    lr: float = 3e-3
    warmup_steps: int = 50
    context_weight: float = 0.1
    """Loss weight of tokens the model does not write (question, passages)."""


Sample = tuple[list[int], list[float], list[int]]
"""(token ids, loss weight per token, 1 on the answer tokens)."""


@functools.cache
def _world_index(seed: int) -> tuple[world.World, list[str], Any]:
    """The world of ``seed``, its passages' contents, and a BM25 index over them (in memory)."""
    w = world.build_world(seed)
    tmp = Path(tempfile.mkdtemp(prefix="base_world_"))
    world.write_world(w, tmp)
    corpus = Corpus(tmp / "corpus.jsonl")
    contents = [corpus.contents(i) for i in range(len(corpus))]
    return w, contents, BM25Retriever.build(corpus)


def _encode(tokenizer: Any, segments: Sequence[tuple[str, float, bool]]) -> Sample:
    ids: list[int] = []
    weights: list[float] = []
    answer: list[int] = []
    for text, weight, is_answer in segments:
        t = tokenizer.encode(text, add_special_tokens=False)
        ids += t
        weights += [weight] * len(t)
        answer += [int(is_answer)] * len(t)
    return ids, weights, answer


def curriculum_samples(
    seed: int, tokenizer: Any, cfg: BaseConfig, topk: int = READ_TOPK
) -> dict[str, list[tuple[dict, Sample]]]:
    """``{"read": [...], "search": [...]}``: (question row, sample) of every question of world
    ``seed``, with the BM25 top-``topk`` passages per search."""
    w, contents, bm25 = _world_index(seed)
    rows = [r for split in world.SPLITS for r in w.questions[split]]
    queries = [h["subject"] for r in rows for h in r["hops"]]
    hits, _ = bm25.search_rows(queries, topk)
    low = cfg.context_weight
    out: dict[str, list[tuple[dict, Sample]]] = {"read": [], "search": []}
    k = 0
    for row in rows:
        answer = row["golden_answers"][0]
        search: list[tuple[str, float, bool]] = [(f"Question: {row['question']}\n", low, False)]
        first_passages = ""
        for hop in row["hops"]:
            passages = "\n\n".join(contents[int(i)] for i in hits[k] if i >= 0) + "\n\n"
            k += 1
            first_passages = first_passages or passages
            search += [("Search:", 1.0, False), (f" {hop['subject']}\n", 1.0, False), (passages, low, False)]
        search += [("Answer:", 1.0, False), (f" {answer}", 1.0, True), ("\n", 1.0, False)]
        out["search"].append((row, _encode(tokenizer, search)))
        if row["type"] == "single_hop":
            read = [(f"{first_passages}Question: {row['question']}\nAnswer:", low, False)]
            out["read"].append((row, _encode(tokenizer, [*read, (f" {answer}", 1.0 + low, True)])))
    return out


def batch_tensors(samples: Sequence[Sample], pad_id: int) -> tuple[Any, Any, Any, Any]:
    """Right-padded ``input_ids``, ``attention_mask``, loss weights, answer mask (float)."""
    width = max(len(s[0]) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    weights = torch.zeros((len(samples), width))
    answer = torch.zeros_like(weights)
    for j, (tok, w, a) in enumerate(samples):
        n = len(tok)
        ids[j, :n] = torch.tensor(tok)
        attn[j, :n] = 1
        weights[j, :n] = torch.tensor(w)
        answer[j, :n] = torch.tensor(a, dtype=torch.float)
    return ids, attn, weights, answer


def weighted_loss(model: Any, samples: Sequence[Sample], pad_id: int) -> Any:
    """Next-token cross-entropy weighted per target token, normalised by the weights' sum."""
    ids, attn, weights, _ = batch_tensors(samples, pad_id)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)
    w = weights[:, 1:]
    return (nll * w).sum() / w.sum().clamp_min(1e-8)


def answer_accuracy(
    model: Any, items: Sequence[tuple[dict, Sample]], pad_id: int, batch: int = 50
) -> dict[str, float]:
    """Teacher-forced: share of ``items`` whose every answer token is the argmax, per question type."""
    hits: dict[str, list[int]] = {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(items), batch):
            chunk = items[start : start + batch]
            ids, attn, _, answer = batch_tensors([s for _, s in chunk], pad_id)
            ok = model(input_ids=ids, attention_mask=attn).logits[:, :-1].argmax(-1) == ids[:, 1:]
            for j, (row, _) in enumerate(chunk):
                mask = answer[j, 1:].bool()
                hits.setdefault(row["type"], []).append(int(bool(ok[j][mask].all())))
    model.train(was_training)
    return {t: round(sum(v) / len(v), 3) for t, v in sorted(hits.items())}


def optimise(
    model: Any,
    batches: Iterable[Any],
    lr: float,
    lr_scale: Callable[[int], float],
    loss_of: Callable[[Any], Any],
    on_step: Callable[[int, float], None],
) -> list[float]:
    """One AdamW step (weight decay 0.01, gradients clipped to norm 1) per batch of ``batches`` at
    learning rate ``lr x lr_scale(step)`` (step from 0), on ``loss_of(batch)``; ``on_step(step, loss)``
    after each; the losses. The loop of the base model's curriculum and of the warm start's SFT."""
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    losses = []
    for step, batch in enumerate(batches):
        for group in optim.param_groups:
            group["lr"] = lr * lr_scale(step)
        loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        on_step(step, losses[-1])
    return losses


def train_steps(
    model: Any,
    draw: Callable[[random.Random], list[Sample]],
    steps: int,
    cfg: BaseConfig,
    rng: random.Random,
    pad_id: int,
    report: Callable[[int, float], None],
    every: int = 100,
    decay: bool = True,
) -> list[float]:
    """``steps`` AdamW steps (:func:`optimise`) on ``draw(rng)`` batches; losses per step.

    Learning rate: linear warm-up, constant, then (``decay``) linear decay to 10 % over the last
    20 % of the steps. The read stage keeps it constant: its accuracy jumps from "a frequent name"
    to "the name in the passage" late and abruptly, and a decaying rate can stall it on the plateau
    before the jump (a cosine over the stage did: 0.2 instead of 0.97).
    """

    def scale(step: int) -> float:
        tail = max(0.0, (step - 0.8 * steps) / (0.2 * steps)) if decay else 0.0
        return min(1.0, (step + 1) / cfg.warmup_steps) * (1.0 - 0.9 * tail)

    def on_step(step: int, loss: float) -> None:
        if (step + 1) % every == 0 or step == steps - 1:
            report(step + 1, loss)

    batches = (draw(rng) for _ in range(steps))
    return optimise(model, batches, cfg.lr, scale, lambda batch: weighted_loss(model, batch, pad_id), on_step)


def cache_key(cfg: BaseConfig) -> str:
    """Hash of what the base model depends on: tokenizer texts, model config, worlds, settings."""
    parts = {
        "version": BASE_VERSION,
        "texts": hashlib.sha256("\x00".join(trajectories.tokenizer_texts()).encode()).hexdigest(),
        "model": tiny.DEMO_TEXT_CONFIG,
        "linear_head_dim": SHIPPED_LINEAR_HEAD_DIM,
        "world": world.WORLD_VERSION,
        "seeds": list(BASE_WORLD_SEEDS),
        "config": asdict(cfg),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def curriculum_pool(tokenizer: Any, cfg: BaseConfig, topk: int) -> tuple[list[Sample], list[Sample]]:
    """(read samples, search samples) of every curriculum world (``BASE_WORLD_SEEDS``), ``topk`` passages."""
    read: list[Sample] = []
    search: list[Sample] = []
    for seed in BASE_WORLD_SEEDS:
        got = curriculum_samples(seed, tokenizer, cfg, topk)
        read += [s for _, s in got["read"]]
        search += [s for _, s in got["search"]]
    return read, search


def held_out_samples(tokenizer: Any, cfg: BaseConfig) -> dict[str, list[tuple[dict, Sample]]]:
    """200 read and 200 search items of the held-out world per width: ``{"read": ..., "search": ...,
    "read@5": ..., "search@5": ...}`` (no suffix: ``READ_TOPK`` passages; ``@5``: ``protocol.TOPK``)."""
    out = {}
    for topk, suffix in ((READ_TOPK, ""), (protocol.TOPK, f"@{protocol.TOPK}")):
        pick = random.Random(HELD_OUT_SEED)
        got = curriculum_samples(HELD_OUT_SEED, tokenizer, cfg, topk)
        out |= {k + suffix: pick.sample(v, min(200, len(v))) for k, v in got.items()}
    return out


def mixed_draw(
    read: Sequence[Sample], search: Sequence[Sample], cfg: BaseConfig
) -> Callable[[random.Random], list[Sample]]:
    """A batch drawer: ``batch_size - read_mix`` search samples + ``read_mix`` read samples."""
    return lambda r: (
        [r.choice(search) for _ in range(cfg.batch_size - cfg.read_mix)]
        + [r.choice(read) for _ in range(cfg.read_mix)]
    )


def own_folder(folder: Path, stamp: str, check_only: bool = False) -> None:
    """Delete ``folder`` (unless ``check_only``) when it is absent, empty or carries ``stamp`` (a model
    folder a demo builder wrote); otherwise UnsafeDeleteError naming --out, and nothing is deleted."""
    try:
        (check_owned if check_only else remove_owned)(folder, folder.absolute().parent, stamp)
    except UnsafeDeleteError as err:
        raise UnsafeDeleteError(
            f"--out: {err}; a demo builder replaces only an empty folder or one it wrote (with {stamp}). "
            f"Fix: give --out a new or empty folder, or move {folder} aside"
        ) from None


def new_stage(folder: Path, stamp: str) -> Path:
    """An empty build folder ``folder`` carrying a placeholder ``stamp`` (so a killed build's leftover
    is recognised as this builder's and replaced next time)."""
    own_folder(folder, stamp)
    folder.mkdir(parents=True)
    (folder / stamp).write_text('{"partial": true}\n')
    return folder


def build_base_model(
    out: str | Path, cfg: BaseConfig = BaseConfig(), log: Callable[[str], None] = print
) -> Path:
    """Train the base model into ``out`` (HF folder with tokenizer + ``base_model.json``). An existing
    ``out`` is replaced only when empty or a base model folder (``own_folder``), checked first."""
    out = Path(out)
    own_folder(out, STAMP, check_only=True)
    started = time.monotonic()
    torch.set_num_threads(1)  # faster than 2 threads on 2 cores for a model this small, and deterministic
    tokenizer = tiny.build_demo_tokenizer(trajectories.tokenizer_texts())
    pad = tokenizer.pad_token_id
    stage = new_stage(out.with_name(out.name + ".partial"), STAMP)
    wide = new_stage(out.with_name(out.name + ".wide"), STAMP)
    tiny.build_random_model(stage, tokenizer, tiny.DEMO_TEXT_CONFIG, seed=cfg.seed)
    model = AutoModelForImageTextToText.from_pretrained(stage, dtype=torch.float32)
    pools = {k: curriculum_pool(tokenizer, cfg, k) for k in (READ_TOPK, protocol.TOPK)}
    held = held_out_samples(tokenizer, cfg)
    log(
        f"base model: {len(pools[READ_TOPK][0])} read + {len(pools[READ_TOPK][1])} search samples "
        f"per width {sorted(pools)} ({time.monotonic() - started:.0f} s)"
    )
    torch.manual_seed(cfg.seed)

    def reporter(stage_name: str) -> Callable[[int, float], None]:
        def report(step: int, loss: float) -> None:
            acc = {k: answer_accuracy(model, v, pad) for k, v in held.items()}
            log(
                f"base {stage_name} step {step}: loss {loss:.3f}, held-out answer accuracy {acc} "
                f"({time.monotonic() - started:.0f} s)"
            )

        return report

    read, search = pools[READ_TOPK]
    train_steps(
        model,
        lambda r: [r.choice(read) for _ in range(cfg.batch_size)],
        cfg.read_steps,
        cfg,
        random.Random(cfg.seed),
        pad,
        reporter("read"),
        decay=False,
    )
    train_steps(
        model,
        mixed_draw(read, search, cfg),
        cfg.search_steps,
        cfg,
        random.Random(cfg.seed + 1),
        pad,
        reporter("search"),
    )
    train_steps(
        model,
        mixed_draw(*pools[protocol.TOPK], cfg),
        cfg.wide_steps,
        cfg,
        random.Random(cfg.seed + 2),
        pad,
        reporter("wide"),
    )
    held_out = {k: answer_accuracy(model, v, pad) for k, v in held.items()}
    model.save_pretrained(stage)
    widen_heads.widen_linear_heads(stage, wide, SHIPPED_LINEAR_HEAD_DIM)
    remove_tree(stage, out.absolute().parent)
    stamp = {
        "key": cache_key(cfg),
        "config": asdict(cfg),
        "held_out_accuracy": held_out,
        "linear_head_dim": SHIPPED_LINEAR_HEAD_DIM,
        "seconds": round(time.monotonic() - started, 1),
    }
    (wide / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    own_folder(out, STAMP)
    replace_durably(wide, out)
    log(f"base model written to {out} in {stamp['seconds']} s: {stamp['held_out_accuracy']}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m search_demo.base_model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=SHIPPED, help=f"model folder to write (default {SHIPPED})"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--read-steps", type=int, default=BaseConfig.read_steps)
    parser.add_argument("--search-steps", type=int, default=BaseConfig.search_steps)
    parser.add_argument("--wide-steps", type=int, default=BaseConfig.wide_steps)
    args = parser.parse_args(argv)
    cfg = BaseConfig(
        seed=args.seed, read_steps=args.read_steps, search_steps=args.search_steps, wide_steps=args.wide_steps
    )
    try:
        build_base_model(args.out, cfg)
    except UnsafeDeleteError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
