"""A tiny, local, random-weight Qwen3.5 model for CPU tests and the CPU demo.

``build_tiny(out_dir, seed=0)`` writes a Hugging Face model folder that looks like
``Qwen/Qwen3.5-0.8B`` to every consumer (verl, transformers, the agent loop), only tiny: a root
``qwen3_5`` config with a 4-layer hybrid text model and a 1-block vision tower, a byte-level BPE
trained locally with Qwen3.5's special tokens, and Qwen3.5's chat template. It also holds the demo
model's config and tokenizer (``DEMO_TEXT_CONFIG``, :func:`build_demo_tokenizer`). Deterministic
for a seed, no network, a few seconds; what each part holds and why: docs/environment.md, "Tiny
model". CLI: ``python -m search_demo.tiny --out DIR [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3_5Config
from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

from search_env import protocol
from search_env.retrieval import SAMPLE_CORPUS

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Special tokens (``special=True``); ids 0, 1, 2 in this order."""
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
"""Single-token, non-special tags (``special=False``), as in Qwen3.5's vocabulary."""

# Qwen3.5's chat template (Qwen/Qwen3.5-35B-A3B chat_template.jinja, Apache-2.0), unchanged
# except for the generation prompt: the small Qwen3.5 models (0.8B) default to non-thinking,
# so only ``enable_thinking=True`` opens ``<think>\n``.
QWEN35_CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is true %}
        {{- '<think>\n' }}
    {%- else %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

TEXT_CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
VISION_CONFIG = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
}


def _training_texts() -> list[str]:
    """Texts the tokenizer is trained on: the demo corpus and every string the protocol renders."""
    texts = [json.loads(line)["contents"] for line in SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()]
    example_call = protocol.render_search_call("who wrote the origin of species")
    texts += [
        QWEN35_CHAT_TEMPLATE,
        json.dumps(protocol.SEARCH_TOOL_SCHEMA),
        protocol.build_messages("who wrote the origin of species")[-1]["content"],
        example_call,
        "<answer> Charles Darwin </answer>",
    ] * 20
    return texts


def _wrap_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    """Qwen3.5's added tokens, EOS/pad and chat template around a trained BPE."""
    bpe.add_tokens([AddedToken(tok, special=False, normalized=False) for tok in ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=TEXT_CONFIG["max_position_embeddings"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = QWEN35_CHAT_TEMPLATE
    return tokenizer


def _train_bpe(texts: Sequence[str], pre_tokenizer: Any, max_token_length: int | None = None) -> Tokenizer:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizer
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        max_token_length=max_token_length,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return bpe


def build_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE and wrap it with Qwen3.5's special tokens and chat template.

    BPE training is deterministic for fixed input; ``seed`` is accepted for symmetry and unused.
    """
    del seed
    return _wrap_tokenizer(_train_bpe(_training_texts(), pre_tokenizers.ByteLevel(add_prefix_space=False)))


DEMO_NAME_PATTERN = r"[A-Z][a-z]+(?: [A-Z][a-z]+)*"
"""A run of capitalised words (a name of ``search_demo.world.INVENTORY``: "Ilsa Marren", "Velmora",
"Dornby Press") is one pre-token, then split before each later word: "Ilsa" + " Marren" wherever it stands."""


def build_demo_tokenizer(texts: Sequence[str]) -> PreTrainedTokenizerFast:
    """The demo model's tokenizer: a byte-level BPE (``VOCAB_SIZE`` ids) trained on ``texts``.

    Unlike ``build_tokenizer`` it may merge across spaces (no GPT-2 word split), so the fixed chat
    template, instruction and passage phrasing shrink to a few long tokens and a demo sequence is
    ~2.5x shorter; names are split out first (``DEMO_NAME_PATTERN``), so a name has the same
    tokens wherever it stands (question, query, passage, answer), and the second word of a name is
    one token with its space (" Marren"): copying a name is "the token that followed this one". Same texts -> identical tokenizer. Qwen3.5's special/added tokens and chat template
    as in ``build_tokenizer``.
    """
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(DEMO_NAME_PATTERN), behavior="isolated"),
            pre_tokenizers.Split(Regex(" [A-Z][a-z]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return _wrap_tokenizer(_train_bpe(texts, pre, max_token_length=48))


DEMO_TEXT_CONFIG = {
    **TEXT_CONFIG,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "full_attention", "full_attention"],
    "head_dim": 32,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "max_position_embeddings": 4096,
}
"""The demo model (``search_demo.warm_start``): 1.4M parameters, one Gated-DeltaNet layer and
three full-attention layers (copying names out of passages needs attention; transformers' cache
path needs at least one linear-attention layer). ~4 ms per decoded token on one CPU core."""


def build_config(
    tokenizer: PreTrainedTokenizerFast, text_config: dict[str, Any] | None = None
) -> Qwen3_5Config:
    """A ``qwen3_5`` config (default ``TEXT_CONFIG``), with EOS/pad ids taken from ``tokenizer``."""
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    text = {
        **(text_config or TEXT_CONFIG),
        "vocab_size": len(tokenizer),
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    vision = {**VISION_CONFIG, "out_hidden_size": text["hidden_size"]}
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def build_random_model(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    text_config: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    """Write ``tokenizer`` and a randomly initialised ``qwen3_5`` model to ``out_dir``; returns it.

    Same inputs -> byte-identical files. Overwrites existing files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(tokenizer, text_config)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny(out_dir: str | Path, seed: int = 0) -> Path:
    """Write tokenizer, chat template, config, generation config and random weights to ``out_dir``.

    Returns the folder. Same ``seed`` -> byte-identical weights. Overwrites existing files.
    """
    tokenizer = build_tokenizer(seed)
    if len(tokenizer) != VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {len(tokenizer)} ids, expected {VOCAB_SIZE}")
    return build_random_model(out_dir, tokenizer, TEXT_CONFIG, seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder (created; files overwritten)")
    parser.add_argument("--seed", type=int, default=0, help="weight-initialisation seed (default 0)")
    args = parser.parse_args(argv)
    path = build_tiny(args.out, seed=args.seed)
    print(f"tiny qwen3_5 model written to {path}")


if __name__ == "__main__":
    main()
