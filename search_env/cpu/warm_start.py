"""Warm start of the CPU demo: a small ``qwen3_5`` model SFT-trained on protocol trajectories.

``build_warm_start(out)`` makes the policy the demo's GRPO starts from:

1. **Tokenizer** (``search_env.cpu.tiny.build_demo_tokenizer``), trained on the fixed name
   inventory of ``search_env.world`` and on trajectories of a fixed reference world rendered by
   ``search_env.protocol`` and the chat template, so every seed's world is covered.
2. **Model**: a random ``qwen3_5`` model of ``tiny.DEMO_TEXT_CONFIG`` (the real classes).
3. **Pretraining** (:func:`pretrain`), the stand-in for an LM's pretraining: next-token loss on
   passages and rendered oracle trajectories of ``PRETRAIN_WORLDS`` fresh worlds (seeds < 0,
   never a demo world), which teaches the model to copy a name it has read.
4. **Demonstrations**: training questions of the ``SFT_WORLD_SEEDS`` worlds are rolled out
   through verl's own ``AgentLoopWorker`` -> ``SearchAgentLoop`` -> ``SearchTool`` against a real
   BM25 server over each world's corpus, with :class:`TeacherClient` in place of the LLM: on each
   turn it writes the assistant message the oracle would send (search the hop's subject, then
   answer) as the chat template renders it, cut where the protocol's stop strings stop a
   generator. So the token sequences (prompt, tool turns, masks) are exactly those a GRPO
   rollout of the same protocol produces, and they follow any protocol change. A demonstration
   whose retrieved passages miss the passage it needs is dropped.
5. **SFT** (:func:`sft`): a plain torch loop (AdamW, next-token loss on the model's own tokens
   only, i.e. ``response_mask`` 1). Deliberately partial (``WarmStartConfig``): mostly single-hop
   demonstrations and few steps, so the policy searches and answers in the protocol's format but
   often fails, on two-hop questions most, which leaves GRPO something to learn.

The warm start depends on no demo world, so one model serves every world seed (the demo's GRPO
world and the unseen world it is also evaluated on).

Why not verl's SFT trainer: it needs a torchrun/FSDP process group and its multi-turn dataset
re-tokenises messages with the chat template, while the protocol's tool turns are hand-built
(``protocol.tool_turn_text``, the study's format) and the exact rollout tokens come only from the
agent loop; a few hundred steps on a 1.4M-parameter model also run faster in-process than a
trainer start-up on two CPU cores.

Cache: ``out/warm_start.json`` records :func:`cache_key` — a hash of a trajectory rendered by
the protocol and chat template, the tokenizer's training texts, the model config, the world
generator version, the SFT/pretraining worlds and the settings. :func:`ensure_warm_start`
rebuilds only when it differs. Deterministic for a seed. CLI::

    python -m search_env.cpu.warm_start --out DIR [--seed N] [--steps N] [--force]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from search_env import protocol, world

WARM_START_VERSION = 3
"""Bumped when this module's output changes for the same inputs."""
REFERENCE_WORLD_SEED = -1000
"""The world whose rendered trajectories (with the inventory) train the demo tokenizer (< 0: no demo world)."""
STAMP = "warm_start.json"
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class WarmStartConfig:
    """What the warm start trains on and how long (counts of questions, optimiser steps)."""

    seed: int = 0
    single_hop: int = 80
    """Single-hop training questions demonstrated per SFT world (at most the split's count)."""
    two_hop: int = 16
    """Two-hop training questions demonstrated per SFT world: few, so two-hop stays weak."""
    pretrain_steps: int = 300
    """Language-model steps on passages of fresh worlds (reading and copying names), before SFT."""
    pretrain_batch_size: int = 8
    """Passage sequences per pretraining step."""
    pretrain_trajectories: int = 8
    """Rendered oracle trajectories of the pretraining worlds per pretraining step."""
    pretrain_passages: int = 6
    """Passages per pretraining sequence."""
    pretrain_lr: float = 3e-3
    steps: int = 150
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 10
    max_turns: int = 3
    """Assistant turns of a demonstration rollout (a two-hop demonstration needs 3)."""


# ---- rendering through the protocol and the chat template ----------------------------------------


def _template(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    from search_env.cpu.tiny import QWEN35_CHAT_TEMPLATE

    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=[protocol.SEARCH_TOOL_SCHEMA],
        chat_template=QWEN35_CHAT_TEMPLATE,
        add_generation_prompt=generation_prompt,
        **protocol.CHAT_TEMPLATE_KWARGS,
    )
    return rendered[0]


def assistant_message(row: dict[str, Any], turn: int) -> dict[str, Any]:
    """The oracle's assistant message on ``turn`` (0-based): search hop ``turn``'s subject, or answer."""
    hops = row["hops"]
    if turn < len(hops):
        call = {
            "type": "function",
            "function": {"name": protocol.TOOL_NAME, "arguments": {"query": hops[turn]["subject"]}},
        }
        return {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [call]}
    return {
        "role": "assistant",
        "content": protocol.render_answer(row["golden_answers"][0]),
        "reasoning_content": "",
    }


def turn_text(prompt_text: str, message: dict[str, Any], question: str) -> str:
    """What the model writes for ``message`` after ``prompt_text`` (which ends in a generation prompt).

    The chat template renders the message (``<|im_start|>assistant\\n<think>\\n…</think>\\n\\n`` +
    content/call); the part the prompt already holds (its generation prompt: with or without
    ``<think>\\n``) is removed, and the text is cut right after the first stop string
    (``protocol.find_stop``), as a generator honouring the protocol's stops would end it.
    """
    user = protocol.build_messages(question)
    rendered = _template(user + [message], generation_prompt=False)[
        len(_template(user, generation_prompt=False)) :
    ]
    overlap = next(
        (k for k in range(min(len(rendered), len(prompt_text)), 0, -1) if prompt_text.endswith(rendered[:k])),
        0,
    )
    text = rendered[overlap:]
    end = protocol.find_stop(text)
    return text[:end] if end is not None else text.rstrip("\n")


def render_trajectory(row: dict[str, Any], chunks_per_hop: Sequence[Sequence[str]]) -> str:
    """The full text of the oracle's rollout of ``row``, tool turns holding ``chunks_per_hop``.

    Rendered like the agent loop builds it: the templated prompt, each turn's text
    (:func:`turn_text`), and after each search ``protocol.tool_turn_text`` of the chunks.
    Used for the tokenizer's training texts and the cache key (not for the SFT tokens, which come
    from the agent loop itself).
    """
    text = _template(protocol.build_messages(row["question"]), generation_prompt=True)
    for turn in range(len(row["hops"]) + 1):
        text += turn_text(text, assistant_message(row, turn), row["question"])
        if turn < len(row["hops"]):
            chunks = [protocol.cap_chunk(c) for c in chunks_per_hop[turn]]
            text += protocol.tool_turn_text(protocol.tool_response_text(chunks))
    return text


def _reference_trajectories(limit: int = 600) -> list[str]:
    """Trajectories over the reference world, its gold passage first among four others per hop."""
    ref = world.build_world(REFERENCE_WORLD_SEED)
    by_title = {p["contents"].split("\n", 1)[0].strip('"'): p["contents"] for p in ref.passages}
    contents = [p["contents"] for p in ref.passages]
    rng = random.Random(REFERENCE_WORLD_SEED)
    rows = [r for split in world.SPLITS for r in ref.questions[split]][:limit]
    out = []
    for row in rows:
        chunks = [[by_title[h["subject"]], *rng.sample(contents, protocol.TOPK - 1)] for h in row["hops"]]
        out.append(render_trajectory(row, chunks))
    return out


def tokenizer_texts() -> list[str]:
    """The demo tokenizer's training texts: inventory names (each in a few phrasings) + trajectories."""
    words = world.INVENTORY.words()
    names = [f"{w} {w}\n" for w in words] * 3 + [" ".join(words)]
    return names + _reference_trajectories()


# ---- the teacher -------------------------------------------------------------------------------


class TeacherClient:
    """A verl ``LLMServerClient`` stand-in that answers each turn with the oracle's tokens.

    Knows each question's row (by its user message); turn = assistant turns already in the prompt.
    ``failed`` collects the ids of the rows whose retrieved passages lacked the fact the next turn
    needs (the hop's subject passage), so their demonstrations can be dropped.
    """

    def __init__(self, config: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], facts: dict[str, str]):
        from verl.workers.rollout.llm_server import LLMServerClient

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
        from verl.workers.rollout.replica import TokenOutput

        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        row = self._row(prompt_text)
        turn = prompt_text.count("<|im_start|>assistant") - 1
        if turn > 0:  # the previous search must have surfaced its hop's passage
            blocks = protocol.tool_response_contents(prompt_text.rsplit("<|im_start|>user", 1)[-1])
            if self.facts[row["hops"][turn - 1]["subject"]] not in blocks:
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
    """A real BM25 retrieval server (``python -m search_env serve``) over ``corpus``; yields its URL."""
    from search_env.retrieval.server import spawn_server

    with spawn_server(["--backend", "bm25", "--corpus", str(corpus)], port=port) as server:
        yield server.url


def _pick_rows(rows: Sequence[dict[str, Any]], cfg: WarmStartConfig) -> list[dict[str, Any]]:
    rng = random.Random(f"warm_start:{cfg.seed}")
    single = [r for r in rows if r["type"] == "single_hop"]
    two = [r for r in rows if r["type"] == "two_hop"]
    picked = rng.sample(single, min(cfg.single_hop, len(single))) + rng.sample(
        two, min(cfg.two_hop, len(two))
    )
    rng.shuffle(picked)
    return picked


def demonstrations(
    model_dir: Path, world_dir: Path, cfg: WarmStartConfig, retrieval_url: str
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Teacher rollouts of the training questions through verl's agent loop: SFT samples + counts.

    Each sample is ``{"ids": prompt + response token ids, "mask": 1 on the model's own tokens}``.
    """
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    import search_env.agent_loop  # noqa: F401  (registers search_agent)
    from search_env.cpu.local_rollout import compose_rollout_config, rows_to_batch, write_tool_config

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
            agent_loop_config_path=REPO_ROOT / "recipes" / "agent_loops.yaml",
            overrides=[
                f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={cfg.max_turns}",
                *(
                    f"data.apply_chat_template_kwargs.{k}={json.dumps(v)}"
                    for k, v in protocol.CHAT_TEMPLATE_KWARGS.items()
                ),
            ],
        )
        from transformers import AutoTokenizer

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
        counts[picked[i]["type"]] += 1
        samples.append({"ids": prompt + response, "mask": [0] * len(prompt) + mask})
    return samples, counts


# ---- pretraining on passages ----------------------------------------------------------------------

PRETRAIN_WORLDS = 24
"""Fresh worlds (seeds -1 .. -24; demo worlds use seeds >= 0) whose passages the model reads first."""


@functools.cache
def _pretrain_worlds() -> tuple[world.World, ...]:
    return tuple(world.build_world(-k) for k in range(1, PRETRAIN_WORLDS + 1))


def pretrain_passages() -> list[str]:
    """Passages (wiki-18 ``contents``) of the pretraining worlds: no demo world's facts, only its names."""
    return [p["contents"] for w in _pretrain_worlds() for p in w.passages]


def pretrain_trajectories(rng: random.Random, count: int) -> list[str]:
    """``count`` oracle trajectories over the pretraining worlds (:func:`render_trajectory`), each
    search answered by its subject's passage among ``protocol.TOPK - 1`` others of the same world."""
    worlds = _pretrain_worlds()
    out = []
    for _ in range(count):
        w = rng.choice(worlds)
        by_title = {p["contents"].split("\n", 1)[0].strip('"'): p["contents"] for p in w.passages}
        contents = list(by_title.values())
        row = rng.choice(w.questions[rng.choice(world.SPLITS)])
        chunks = []
        for hop in row["hops"]:
            others = rng.sample(contents, protocol.TOPK - 1)
            others.insert(rng.randrange(3), by_title[hop["subject"]])
            chunks.append(others)
        out.append(render_trajectory(row, chunks))
    return out


def pretrain(model: Any, tokenizer: Any, cfg: WarmStartConfig, log: Any = print) -> list[float]:
    """Next-token training on sequences of ``cfg.pretrain_passages`` random passages; losses per step.

    The stand-in for an LM's pretraining: a random model has no notion of copying a name it has
    just read, and the few hundred demonstrations are too few to find it (SFT alone plateaus at
    predicting the most frequent name). Each passage repeats its subject's name ("X was a poet.
    X was born in Y."), so predicting the repeat teaches attention to copy: held-out copy accuracy
    goes from 0 to > 0.9 in ~200 steps. The worlds are not the demo's (seeds < 0, facts drawn
    afresh), so nothing here answers a demo question.
    """
    import torch

    texts = pretrain_passages()
    rng = random.Random(f"pretrain:{cfg.seed}")
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=0.01)
    sep = "\n\n"
    losses = []
    model.train()
    for step in range(cfg.pretrain_steps):
        for group in optim.param_groups:
            group["lr"] = cfg.pretrain_lr * min(1.0, (step + 1) / cfg.warmup_steps)
        docs = [sep.join(rng.sample(texts, cfg.pretrain_passages)) for _ in range(cfg.pretrain_batch_size)]
        docs += pretrain_trajectories(rng, cfg.pretrain_trajectories)
        seqs = [tokenizer.encode(doc, add_special_tokens=False) for doc in docs]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for j, seq in enumerate(seqs):
            ids[j, : len(seq)] = labels[j, : len(seq)] = torch.tensor(seq)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == cfg.pretrain_steps - 1:
            log(f"pretrain step {step + 1}/{cfg.pretrain_steps}: loss {losses[-1]:.3f}")
    return losses


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


def sft(
    model: Any, samples: Sequence[dict[str, Any]], cfg: WarmStartConfig, pad_id: int, log: Any = print
) -> list[float]:
    """Train ``model`` in place on ``samples`` (next-token loss where ``mask`` is 1); losses per step."""
    import torch

    if not samples:
        raise ValueError("no demonstrations to train on (every teacher rollout was dropped)")
    torch.manual_seed(cfg.seed)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    losses = []
    for step, batch in enumerate(_batches(samples, cfg)):
        width = max(len(s["ids"]) for s in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for j, s in enumerate(batch):
            n = len(s["ids"])
            ids[j, :n] = torch.tensor(s["ids"])
            attn[j, :n] = 1
            keep = torch.tensor(s["mask"], dtype=torch.bool)
            labels[j, :n] = torch.where(keep, ids[j, :n], torch.full_like(ids[j, :n], -100))
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == cfg.steps - 1:
            log(f"sft step {step + 1}/{cfg.steps}: loss {losses[-1]:.3f}")
    model.eval()
    return losses


# ---- cache and build ---------------------------------------------------------------------------


SFT_WORLD_SEEDS = range(-101, -107, -1)
"""The worlds whose training questions are demonstrated (seeds < 0: never a demo world). Several
worlds, so no small set of names recurs in the answers: the model has to copy, not recall."""


def cache_key(cfg: WarmStartConfig) -> str:
    """Hash of everything the warm start depends on (see the module docstring)."""
    from search_env.cpu import tiny

    ref = world.build_world(REFERENCE_WORLD_SEED)
    sample = next(r for r in ref.questions["train"] if r["type"] == "two_hop")
    chunks = [[ref.passages[0]["contents"], ref.passages[1]["contents"]]] * 2
    parts = {
        "version": WARM_START_VERSION,
        "format": render_trajectory(sample, chunks),
        "stops": list(protocol.STOP_STRINGS),
        "tool_format": protocol.TOOL_FORMAT,
        "texts": hashlib.sha256("\x00".join(tokenizer_texts()).encode()).hexdigest(),
        "model": tiny.DEMO_TEXT_CONFIG,
        "world": {
            "version": world.WORLD_VERSION,
            "sft_seeds": list(SFT_WORLD_SEEDS),
            "pretrain": PRETRAIN_WORLDS,
        },
        "config": asdict(cfg),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def build_warm_start(out: str | Path, cfg: WarmStartConfig = WarmStartConfig(), log: Any = print) -> Path:
    """Build the warm-started model into ``out`` (HF folder + ``warm_start.json``); returns ``out``.

    The model depends on no demo world: its demonstrations come from ``SFT_WORLD_SEEDS``, its
    pretraining from ``PRETRAIN_WORLDS`` others, so one warm start serves every demo world.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    from search_env.cpu import tiny

    out = Path(out)
    started = time.monotonic()
    key = cache_key(cfg)
    stage = out.with_name(out.name + ".partial")
    tokenizer = tiny.build_demo_tokenizer(tokenizer_texts())
    tiny.build_random_model(stage, tokenizer, tiny.DEMO_TEXT_CONFIG, seed=cfg.seed)
    log(f"warm start {key}: tokenizer + random {tiny.DEMO_TEXT_CONFIG['hidden_size']}-wide model in {stage}")
    samples: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in SFT_WORLD_SEEDS:
            world_dir = world.write_world(world.build_world(seed), Path(tmp) / f"world_{seed}")
            with bm25_server(world_dir / "corpus.jsonl") as url:
                got, c = demonstrations(stage, world_dir, cfg, url)
            samples += got
            counts = {k: counts.get(k, 0) + v for k, v in c.items()}
    log(f"warm start: {len(samples)} demonstrations {counts} ({time.monotonic() - started:.0f} s)")
    torch.set_num_threads(1)  # 3-8x faster than 2 threads on 2 busy cores; this model is too small to split
    model = AutoModelForImageTextToText.from_pretrained(stage, dtype=torch.float32)
    pre = pretrain(model, tokenizer, cfg, log=log) if cfg.pretrain_steps else [float("nan")]
    losses = sft(model, samples, cfg, tokenizer.pad_token_id, log=log)
    model.save_pretrained(stage)
    stamp = {
        "key": key,
        "config": asdict(cfg),
        "sft_worlds": list(SFT_WORLD_SEEDS),
        "demonstrations": counts,
        "tokens_per_demo": sum(len(s["ids"]) for s in samples) / len(samples),
        "pretrain_loss_last": pre[-1],
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "seconds": round(time.monotonic() - started, 1),
    }
    (stage / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(stage, out)
    log(f"warm start written to {out} in {stamp['seconds']} s (loss {losses[0]:.2f} -> {losses[-1]:.2f})")
    return out


def ensure_warm_start(out: str | Path, cfg: WarmStartConfig = WarmStartConfig(), log: Any = print) -> Path:
    """``out`` if its stamp matches :func:`cache_key`, else a fresh :func:`build_warm_start`."""
    out = Path(out)
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == cache_key(cfg):
        return out
    return build_warm_start(out, cfg, log=log)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m search_env.cpu.warm_start", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="model folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=WarmStartConfig.steps, help="SFT steps")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    args = parser.parse_args(argv)
    cfg = WarmStartConfig(seed=args.seed, steps=args.steps)
    if args.force:
        build_warm_start(args.out, cfg)
    else:
        ensure_warm_start(args.out, cfg)


if __name__ == "__main__":
    main()
