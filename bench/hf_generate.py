"""CPU generation benchmark: continuous batching vs one request at a time, side by side in one run.

Workload: ``--rollouts`` (32) concurrent multi-turn rollouts on asyncio, as verl's agent loops
drive the ``hf`` backend: ``--questions`` chat prompts (the protocol's prompt and tool block,
``--group`` rollouts each, like a GRPO group), ``--turns`` assistant turns of at most
``--turn-tokens`` sampled tokens with the agent loop's sampling parameters (temperature 1, stop
ids and stop strings), each followed by a tool turn of ``--tool-chars`` characters of a corpus
passage in the study's framing. Every mode runs the identical workload: per-request random
streams are seeded from the prompt, so all modes sample the same tokens (the run checks it).

Modes, on one ``HFGenerator`` each (same model, same seed):
  (a) one at a time: ``max_batch_size=1, prefix_cache_mb=0`` (the old lock-per-request path);
  (b) batched decoding, every prompt prefilled in full (``prefix_cache_mb=0``);
  (c) batched decoding + prefix-state reuse (the default).
Each mode runs ``--repeats`` times, interleaved, and its fastest run counts (the machine is
shared). Prints wall seconds and rollouts/s, CPU seconds of the process (robust to other load),
sampled / prefilled / reused tokens, mean batch, time in prefill and decode, and the ratios b/a
and c/a in rollouts/s and in rollouts per CPU-second (target c/a >= 6).

Model: ``--model DIR`` (e.g. the warm-started demo model), else a random-weight model of the demo
size (``search_env.cpu.tiny.DEMO_TEXT_CONFIG``) with the tiny tokenizer.

    .venv/bin/python bench/hf_generate.py [--model DIR] [--rollouts 32] [--threads 1]   # ~2-3 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from search_env import DEMO_CORPUS, protocol
from search_env.cpu import tiny
from search_env.cpu.hf_generate import HFGenerator

MODES = {
    "a one-at-a-time": {"max_batch_size": 1, "prefix_cache_mb": 0},
    "b batched": {"prefix_cache_mb": 0},
    "c batched+prefix": {},
}
QUESTIONS = [
    "who founded the city where the painter of the blue horse was born",
    "in which country is the river that flows through the capital of the northern province",
    "what year was the university attended by the author of the silent harbor founded",
    "who directed the film that won the festival held in the lakeside town",
    "which company built the bridge named after the first mayor",
    "where was the composer of the winter symphony born",
    "who wrote the novel adapted into the longest running play of the old theatre",
    "what is the capital of the region where the oldest monastery stands",
]


def build_workload(
    tokenizer: Any, questions: int, group: int, turns: int, tool_chars: int
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Per rollout: its first prompt (token ids) and the tool-turn tokens appended after each turn."""
    passages = [json.loads(line)["contents"] for line in DEMO_CORPUS.read_text(encoding="utf-8").splitlines()]
    prompts, tools = [], []
    for q in range(questions):
        messages = protocol.build_messages(QUESTIONS[q % len(QUESTIONS)])
        prompt = tokenizer.apply_chat_template(
            messages,
            tools=[protocol.SEARCH_TOOL_SCHEMA],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **protocol.CHAT_TEMPLATE_KWARGS,
        )
        for member in range(group):
            prompts.append(list(prompt))
            rollout_tools = []
            for turn in range(turns):
                passage = passages[(q * group * turns + member * turns + turn) % len(passages)][:tool_chars]
                text = (
                    "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
                    f"{passage}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                )
                rollout_tools.append(tokenizer.encode(text, add_special_tokens=False))
            tools.append(rollout_tools)
    return prompts, tools


def sampling_params(tokenizer: Any, turn_tokens: int) -> dict[str, Any]:
    """The agent loop's per-turn parameters (verl AgentLoopWorker + SearchAgentLoop keys)."""
    stop_ids = {
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.convert_tokens_to_ids("</tool_call>"),
    }
    return {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "logprobs": True,
        "stop_token_ids": sorted(stop_ids),
        "stop": ["</tool_call>", "</answer>"],
        "include_stop_str_in_output": True,
        "max_tokens": turn_tokens,
    }


async def _rollouts(
    generator: HFGenerator, prompts: list[list[int]], tools: list[list[list[int]]], params: dict[str, Any]
) -> list[list[int]]:
    async def one(prompt: list[int], tool_turns: list[list[int]]) -> list[int]:
        sampled: list[int] = []
        for tool in tool_turns:
            out = await generator.agenerate(prompt, params)
            sampled += out.token_ids
            prompt = prompt + out.token_ids + tool
        return sampled

    return await asyncio.gather(*(one(p, t) for p, t in zip(prompts, tools, strict=True)))


def run_mode(model_dir: str, options: dict[str, Any], prompts, tools, params, seed: int) -> dict[str, Any]:
    """Time the whole workload on a fresh generator; returns its numbers and the sampled tokens."""
    generator = HFGenerator(model_dir, max_new_tokens=params["max_tokens"], seed=seed, **options)
    try:
        generator.generate(prompts[0][:8], {"max_tokens": 2})  # first-call set-up, not timed
        before = generator.stats()
        start, cpu_start = time.perf_counter(), time.process_time()
        sampled = asyncio.run(_rollouts(generator, prompts, tools, params))
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        after = generator.stats()
    finally:
        generator.close()
    delta = {k: after[k] - before[k] for k in after if k != "mean_batch"}
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "rollouts_per_s": len(prompts) / seconds,
        "rollouts_per_cpu_s": len(prompts) / cpu_seconds,
        "sampled_tokens": sum(len(s) for s in sampled),
        "mean_batch": delta["decoded_rows"] / max(1, delta["decode_steps"]),
        "sampled": sampled,
        **delta,
    }


def demo_model(folder: Path, seed: int) -> str:
    """A random-weight model of the demo size with the tiny tokenizer, written to ``folder``."""
    return str(tiny.build_random_model(folder, tiny.build_tokenizer(), tiny.DEMO_TEXT_CONFIG, seed=seed))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: random demo-size model)")
    parser.add_argument("--rollouts", type=int, default=32, help="concurrent rollouts (= questions x group)")
    parser.add_argument("--group", type=int, default=4, help="rollouts per question (GRPO group)")
    parser.add_argument("--turns", type=int, default=3, help="assistant turns per rollout")
    parser.add_argument("--turn-tokens", type=int, default=24, help="most sampled tokens per turn")
    parser.add_argument("--tool-chars", type=int, default=500, help="characters of passage per tool turn")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (Ray actors get 1)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per mode, interleaved; the fastest counts"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.rollouts % args.group:
        parser.error(f"--rollouts ({args.rollouts}) must be a multiple of --group ({args.group})")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or demo_model(Path(tmp) / "demo_model", args.seed)
        tokenizer = HFGenerator(model_dir, max_batch_size=1).tokenizer
        prompts, tools = build_workload(
            tokenizer, args.rollouts // args.group, args.group, args.turns, args.tool_chars
        )
        params = sampling_params(tokenizer, args.turn_tokens)
        print(
            f"model {args.model or 'random demo-size qwen3_5'} | {args.rollouts} rollouts x {args.turns} turns "
            f"(<= {args.turn_tokens} tokens) | prompt {len(prompts[0])} tokens, tool turns "
            f"{sum(len(t) for t in tools[0]) // args.turns} tokens | torch threads {args.threads} | "
            f"load {os.getloadavg()[0]:.1f}"
        )
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in MODES}
        for _ in range(args.repeats):
            for name, options in MODES.items():
                runs[name].append(run_mode(model_dir, options, prompts, tools, params, args.seed))
        results = {name: min(found, key=lambda r: r["seconds"]) for name, found in runs.items()}
    header = (
        f"{'mode':<18}{'wall s':>8}{'rollouts/s':>11}{'CPU s':>7}{'sampled':>8}{'mean batch':>11}"
        f"{'prefilled':>10}{'reused':>8}{'prefill s':>10}{'decode s':>9}"
    )
    print(header)
    for name, r in results.items():
        print(
            f"{name:<18}{r['seconds']:>8.2f}{r['rollouts_per_s']:>11.2f}{r['cpu_seconds']:>7.2f}"
            f"{r['sampled_tokens']:>8}{r['mean_batch']:>11.1f}{r['prefill_tokens']:>10}{r['reused_tokens']:>8}"
            f"{r['prefill_s']:>10.2f}{r['decode_s']:>9.2f}"
        )
    base = results["a one-at-a-time"]
    same = all(r["sampled"] == base["sampled"] for found in runs.values() for r in found)
    print(f"identical samples in all runs: {same}")
    for name in ("b batched", "c batched+prefix"):
        wall = results[name]["rollouts_per_s"] / base["rollouts_per_s"]
        cpu = results[name]["rollouts_per_cpu_s"] / base["rollouts_per_cpu_s"]
        print(f"ratio {name[0]}/a: {wall:.1f}x rollouts/s (wall), {cpu:.1f}x rollouts per CPU-second")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
