"""Widening the Gated-DeltaNet heads keeps the model's function (and stays a model vLLM's CPU
kernels take); training keeps the widened copies equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from search_demo import base_model, tiny, widen_heads


@pytest.fixture(scope="module")
def narrow_and_wide(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("widen")
    tok = tiny.build_tokenizer(0)
    narrow = tiny.build_random_model(
        tmp / "narrow",
        tok,
        {**tiny.TEXT_CONFIG, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
        seed=3,
    )
    return narrow, widen_heads.widen_linear_heads(narrow, tmp / "wide", 64)


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


def test_widened_model_computes_the_same_logits(narrow_and_wide):
    narrow, wide = narrow_and_wide
    config = json.loads((wide / "config.json").read_text())["text_config"]
    assert config["linear_key_head_dim"] == config["linear_value_head_dim"] == 64
    ids = torch.randint(0, tiny.VOCAB_SIZE, (2, 150), generator=torch.Generator().manual_seed(0))
    a, b = _logits(narrow, ids), _logits(wide, ids)
    assert (a - b).abs().max() <= 2**-9 * a.abs().max()  # below bf16 resolution (2^-8 relative)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_training_leaves_the_padding_at_zero(narrow_and_wide):
    """Every padded weight gets an exact-zero gradient, so AdamW keeps it at zero: the widened
    model learns what the narrow one would."""
    _, wide = narrow_and_wide
    model = AutoModelForCausalLM.from_pretrained(wide, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, tiny.VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    attn = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
    q, k, v = torch.split(attn.in_proj_qkv.weight, [attn.key_dim, attn.key_dim, attn.value_dim])
    pads = {
        "q": q.reshape(attn.num_k_heads, 4, 16, -1)[:, 1:],  # 16-dim heads widened 4x
        "k": k.reshape(attn.num_k_heads, 4, 16, -1)[:, 1:],
        "v": v.reshape(attn.num_v_heads, 4, 16, -1)[:, 1:],
        "z": attn.in_proj_z.weight.reshape(attn.num_v_heads, 4, 16, -1)[:, 1:],
        "norm": attn.norm.weight.reshape(4, 16)[1:],
        "out_proj": attn.out_proj.weight.reshape(-1, attn.num_v_heads, 4, 16)[:, :, 1:],
    }
    for name, pad in pads.items():
        assert torch.count_nonzero(pad) == 0, f"{name} padding moved"
    assert torch.count_nonzero(v.reshape(attn.num_v_heads, 4, 16, -1)[:, 0]) > 0


def test_bad_head_dims_are_refused():
    with pytest.raises(ValueError, match="must be equal and divide --head-dim"):
        widen_heads.widen_state_dict({}, {"linear_key_head_dim": 32, "linear_value_head_dim": 32}, 48)


def test_the_shipped_base_model_has_the_head_dim_vllm_takes():
    text = json.loads((base_model.SHIPPED / "config.json").read_text())["text_config"]
    stamp = json.loads((base_model.SHIPPED / base_model.STAMP).read_text())
    assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == base_model.SHIPPED_LINEAR_HEAD_DIM
    assert stamp["key"] == base_model.cache_key(base_model.BaseConfig(**stamp["config"]))
