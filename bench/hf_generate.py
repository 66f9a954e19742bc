"""CPU generation benchmark: continuous batching vs one request at a time, side by side in one run.

Workload: ``--rollouts`` (32) concurrent multi-turn rollouts on asyncio, as verl's agent loops
drive the ``hf`` backend: ``--questions`` chat prompts (the protocol's prompt and tool block,
``--group`` rollouts each, like a GRPO group), ``--turns`` assistant turns of at most
``--turn-tokens`` sampled tokens with the agent loop's sampling parameters (temperature 1, stop
ids and stop strings), each followed by a tool turn holding one corpus passage cut to ``--tool-chars``
characters, framed as the study's environment does (``protocol.tool_turn_text``). Every mode runs the identical workload: per-request random
streams are seeded from the prompt, so all modes sample the same tokens (the run checks it).

Modes, on one ``HFGenerator`` each (same model, same seed):
  (0) the previous generator, for reference: one request at a time under a lock in a worker
      thread, full-prompt logits, ``sdpa`` attention, a key/value concatenation per step
      (``PreviousGenerator``; its own random draws, so its samples differ);
  (a) one at a time: ``max_batch_size=1, prefix_cache_mb=0`` (same engine, batching and reuse off);
  (b) batched decoding, every prompt prefilled in full (``prefix_cache_mb=0``);
  (c) batched decoding + prefix-state reuse (the default).
Each mode runs ``--repeats`` times, interleaved, and its fastest run counts (the machine is
shared). Prints wall seconds and rollouts/s, CPU seconds of the process (robust to other load),
sampled / prefilled / reused tokens, mean batch (rows per decoding step), sequences per prefill
forward pass, time in prefill and decode, and the ratios b/a, c/a and c/0 in rollouts/s and in
rollouts per CPU-second (target >= 6).

Model: ``--model DIR`` (e.g. the warm-started demo model), else a random-weight model of the demo
size (``search_demo.tiny.DEMO_TEXT_CONFIG``) with the tiny tokenizer.

    .venv/bin/python -m bench.hf_generate [--model DIR] [--rollouts 32] [--threads 1]   # ~2-3 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from cpu_engine.hf_generate import HFGenerator
from search_demo import tiny
from search_env import protocol
from search_env.retrieval import SAMPLE_CORPUS

MODES: dict[str, dict[str, Any] | None] = {
    "0 previous": None,
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
    passages = [
        json.loads(line)["contents"] for line in SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()
    ]
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
                passage = passages[(q * group * turns + member * turns + turn) % len(passages)]
                chunk = protocol.cap_chunk(passage, cap=tool_chars)
                text = protocol.tool_turn_text(protocol.tool_response_text([chunk]))
                rollout_tools.append(tokenizer.encode(text, add_special_tokens=False))
            tools.append(rollout_tools)
    return prompts, tools


def sampling_params(tokenizer: Any, turn_tokens: int) -> dict[str, Any]:
    """The agent loop's per-turn parameters (verl AgentLoopWorker + SearchAgentLoop keys)."""
    stops = protocol.stop_sampling_params(tokenizer)
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id, *stops["stop_token_ids"]}
    return {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "logprobs": True,
        **stops,
        "stop_token_ids": sorted(ends),
        "max_tokens": turn_tokens,
    }


class PreviousGenerator:
    """The generator this project had before continuous batching (kept here as the baseline):
    requests take a lock in turn; each runs its prompt through the model with every position's
    logits, then one token per forward pass, sampling with ``torch.multinomial``."""

    def __init__(self, model_dir: str, seed: int):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = {int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None}
        self.lock = threading.Lock()
        self.rng = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], params: dict[str, Any]) -> list[int]:
        stop_ids = self.eos | set(params.get("stop_token_ids") or [])
        with self.lock:
            step, past, out = torch.tensor([prompt_ids]), None, []
            for _ in range(params["max_tokens"]):
                result = self.model(input_ids=step, past_key_values=past, use_cache=True)
                past = result.past_key_values
                probs = torch.softmax(result.logits[0, -1].float() / params["temperature"], dim=-1)
                out.append(int(torch.multinomial(probs, 1, generator=self.rng)))
                if out[-1] in stop_ids:
                    break
                step = torch.tensor([[out[-1]]])
        return out

    async def agenerate(self, prompt_ids: list[int], params: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(token_ids=await asyncio.to_thread(self.generate, prompt_ids, params))


async def _rollouts(
    generator: HFGenerator | PreviousGenerator,
    prompts: list[list[int]],
    tools: list[list[list[int]]],
    params: dict[str, Any],
) -> list[list[int]]:
    async def one(prompt: list[int], tool_turns: list[list[int]]) -> list[int]:
        sampled: list[int] = []
        for tool in tool_turns:
            out = await generator.agenerate(prompt, params)
            sampled += out.token_ids
            prompt = prompt + out.token_ids + tool
        return sampled

    return await asyncio.gather(*(one(p, t) for p, t in zip(prompts, tools, strict=True)))


def run_mode(
    model_dir: str, options: dict[str, Any] | None, prompts, tools, params, seed: int
) -> dict[str, Any]:
    """Time the whole workload on a fresh generator (``options`` None = ``PreviousGenerator``);
    returns its numbers and the sampled tokens."""
    if options is None:
        previous = PreviousGenerator(model_dir, seed)
        previous.generate(prompts[0][:8], {"max_tokens": 2, "temperature": 1.0})  # first-call set-up
        start, cpu_start = time.perf_counter(), time.process_time()
        sampled = asyncio.run(_rollouts(previous, prompts, tools, params))
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        delta = {
            key: float("nan")
            for key in ("decode_steps", "prefill_tokens", "reused_tokens", "prefill_s", "decode_s")
        }
        delta["decoded_rows"] = delta["prefill_rows"] = delta["prefill_calls"] = float("nan")
    else:
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
        "mean_batch": delta["decoded_rows"] / max(1, delta["decode_steps"]) if options is not None else 1.0,
        "prefill_batch": delta["prefill_rows"] / max(1, delta["prefill_calls"]),
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
        f"{'prefilled':>10}{'reused':>8}{'per prefill':>12}{'prefill s':>10}{'decode s':>9}"
    )
    print(header)
    for name, r in results.items():
        print(
            f"{name:<18}{r['seconds']:>8.2f}{r['rollouts_per_s']:>11.2f}{r['cpu_seconds']:>7.2f}"
            f"{r['sampled_tokens']:>8}{r['mean_batch']:>11.1f}{r['prefill_tokens']:>10}{r['reused_tokens']:>8}"
            f"{r['prefill_batch']:>12.1f}{r['prefill_s']:>10.2f}{r['decode_s']:>9.2f}"
        )
    base = results["a one-at-a-time"]
    same = all(
        r["sampled"] == base["sampled"] for name, found in runs.items() if name != "0 previous" for r in found
    )
    print(f"identical samples in all runs of a, b, c: {same}")
    for name, over in (("b batched", "a"), ("c batched+prefix", "a"), ("c batched+prefix", "0")):
        ref = base if over == "a" else results["0 previous"]
        wall = results[name]["rollouts_per_s"] / ref["rollouts_per_s"]
        cpu = results[name]["rollouts_per_cpu_s"] / ref["rollouts_per_cpu_s"]
        print(f"ratio {name[0]}/{over}: {wall:.1f}x rollouts/s (wall), {cpu:.1f}x rollouts per CPU-second")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
