"""Widen a Qwen3.5 model's Gated-DeltaNet heads without changing what it computes or learns.

vLLM's CPU Gated-DeltaNet kernel takes a linear-attention head dim of 64 or 128 only, and the demo
model was trained with 32. :func:`widen_linear_heads` zero-pads every head from ``d`` to ``f * d``
channels and rescales the gated norm (weight by ``1/√f``, ``rms_norm_eps`` by ``1/f²``): the
outputs stay the narrow model's, and every padded weight gets an exact-zero gradient, so training
leaves it at zero. Why zero-padding and not duplicated channels: docs/training.md, "Measured with
the head-dim-64 base model".

    python -m search_demo.widen_heads --src DIR --out DIR --head-dim 64
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_LINEAR = ".linear_attn."


def _pad_heads(t: torch.Tensor, heads: int, dim: int, f: int) -> torch.Tensor:
    """``t`` with each of its ``heads`` blocks of ``dim`` rows followed by ``(f - 1) * dim`` zero rows."""
    blocks = t.reshape(heads, dim, *t.shape[1:])
    zeros = torch.zeros(heads, (f - 1) * dim, *t.shape[1:], dtype=t.dtype)
    return torch.cat([blocks, zeros], dim=1).reshape(heads * f * dim, *t.shape[1:])


def widen_state_dict(
    state: dict[str, torch.Tensor], text_config: dict, head_dim: int
) -> dict[str, torch.Tensor]:
    """The weights of ``state`` (HF Qwen3.5 names) with linear-attention heads of ``head_dim``.

    ``text_config`` is the narrow model's text config (``linear_key_head_dim`` must equal
    ``linear_value_head_dim`` and divide ``head_dim``). Other tensors are returned unchanged.
    """
    dk, dv = text_config["linear_key_head_dim"], text_config["linear_value_head_dim"]
    if dk != dv or head_dim % dk:
        raise ValueError(
            f"widen_heads: linear_key_head_dim ({dk}) and linear_value_head_dim ({dv}) must be equal "
            f"and divide --head-dim ({head_dim})"
        )
    f = head_dim // dk
    hk, hv = text_config["linear_num_key_heads"], text_config["linear_num_value_heads"]
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if _LINEAR not in name or f == 1:
            out[name] = t
            continue
        leaf = name.split(_LINEAR, 1)[1]
        if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
            q, k, v = torch.split(t, [hk * dk, hk * dk, hv * dv], dim=0)
            out[name] = torch.cat(
                [_pad_heads(q, hk, dk, f), _pad_heads(k, hk, dk, f), _pad_heads(v, hv, dv, f)]
            )
        elif leaf == "in_proj_z.weight":
            out[name] = _pad_heads(t, hv, dv, f)
        elif leaf == "norm.weight":
            out[name] = _pad_heads(t / f**0.5, 1, dv, f)
        elif leaf == "out_proj.weight":
            out[name] = _pad_heads(t.T, hv, dv, f).T
        elif leaf in ("A_log", "dt_bias", "in_proj_a.weight", "in_proj_b.weight"):
            out[name] = t  # per head, not per channel
        else:
            raise ValueError(f"widen_heads: unknown linear-attention tensor {name}")
    return out


def widen_linear_heads(src: str | Path, out: str | Path, head_dim: int = 64) -> Path:
    """Copy the HF model folder ``src`` to ``out`` with linear-attention head dim ``head_dim``.

    Every file is copied; ``config.json`` gets the new head dims and ``model.safetensors`` the
    widened weights (same dtype). ``out`` is overwritten. Returns ``out``.
    """
    src, out = Path(src), Path(out)
    if src.resolve() == out.resolve():
        raise ValueError("widen_heads: --out must differ from --src")
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    weights = load_file(str(src / "model.safetensors"))
    wide = widen_state_dict(weights, text, head_dim)
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.name not in ("config.json", "model.safetensors"):
            shutil.copy2(item, out / item.name)
    f = head_dim // text["linear_key_head_dim"]
    text["linear_key_head_dim"] = text["linear_value_head_dim"] = head_dim
    text["rms_norm_eps"] = text["rms_norm_eps"] / f**2
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in wide.items()}, str(out / "model.safetensors"), {"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True, help="HF model folder (Qwen3.5)")
    parser.add_argument("--out", required=True, help="output folder (created; files overwritten)")
    parser.add_argument("--head-dim", type=int, default=64, help="new linear-attention head dim (default 64)")
    args = parser.parse_args(argv)
    print(f"widened model written to {widen_linear_heads(args.src, args.out, args.head_dim)}")


if __name__ == "__main__":
    main()
