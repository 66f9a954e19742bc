"""The tiny local Qwen3.5 model: deterministic, Qwen3.5 tokens/template, loads where verl loads it."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from verl.utils.model import get_hf_auto_model_class
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from cpu_engine.hf_generate import HFGenerator
from search_demo.tiny import build_tiny


def test_deterministic_for_a_seed(tiny_model_dir, tmp_path):
    again = build_tiny(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_qwen35_tokens_and_config(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    added = {t.content: t.special for t in tok.added_tokens_decoder.values()}
    assert {k: added[k] for k in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")} == dict.fromkeys(
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), True
    )
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"):
        assert added[tag] is False and len(tok.encode(tag, add_special_tokens=False)) == 1
    assert tok.decode(tok.encode("<tool_call>\nx</tool_call><|im_end|>"), skip_special_tokens=True) == (
        "<tool_call>\nx</tool_call>"
    )
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["layer_types"].count("linear_attention") == 3


def test_verl_picks_qwen_continuous_token_builder(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    builder = create_continuous_token_builder(tok, hf_model_type="qwen3_5")
    assert type(builder).__name__ == "QwenContinuousTokenBuilder"


def test_actor_and_rollout_classes_load_the_same_weights(tiny_model_dir):
    causal = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    full_cls = get_hf_auto_model_class(
        AutoConfig.from_pretrained(tiny_model_dir)
    )  # what verl's FSDP actor uses
    assert full_cls is AutoModelForImageTextToText
    full = full_cls.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    logits = full(input_ids=ids).logits
    assert torch.allclose(logits, causal(input_ids=ids).logits, atol=1e-5)
    logits.sum().backward()  # the actor class trains on CPU (torch fallback of the linear attention)


def test_hf_generator_kv_cache_matches_full_forward(tiny_model_dir):
    gen = HFGenerator(str(tiny_model_dir), max_new_tokens=12, seed=0)
    prompt = gen.tokenizer.encode("Evan Morris was a lobbyist for")
    out = gen.generate(prompt, {"temperature": 0})
    with torch.no_grad():
        logits = gen.model(input_ids=torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == out.token_ids
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(out.log_probs), atol=1e-4)
