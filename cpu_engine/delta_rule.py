"""Qwen3.5's Gated-DeltaNet layers on CPU: a faster chunked delta rule and a batched prefill.

``chunk_gated_delta_rule`` is transformers' torch fallback (``torch_chunk_gated_delta_rule``,
Apache-2.0, used when the ``fla`` kernels are absent) with its per-row Python loop replaced by one
batched triangular solve and shorter chunks (``CHUNK_SIZE``); results agree to float rounding.
``padded_prefill`` is the layer's forward for a prefill batch of right-padded rows that each
continue their own state: a padded position leaves the state exactly as it was. ``install`` puts
both into a model. Why and how: docs/environment.md, "CPU generation" (batched prefill).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet,
    torch_chunk_gated_delta_rule,
)

from cpu_engine.cache_rows import PrefillCache

CHUNK_SIZE = 16
"""Tokens per chunk (the fallback's default is 64). A token's work in the rule is ~C * (3 Dk + 2 Dv)
inside its chunk plus ~3 Dk * Dv against the carried state, and the per-chunk [C, C] matrices of
a batch stay in the CPU caches when C is small: on the demo model's shapes 16 is up to 3x faster
than 64 for a batched prefill and within 10 % of the best for one long sequence."""


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over a sequence, chunk by chunk.

    query/key [B, T, H, Dk], value [B, T, H, Dv], g (log decay) and beta [B, T, H];
    ``initial_state`` [B, H, Dk, Dv] or None (zeros). Returns the output [B, T, H, Dv] in the
    query's dtype and, if ``output_final_state``, the state after the last token (float32).
    """
    dtype = query.dtype
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query, key, value, beta, g = (
        x.transpose(1, 2).contiguous().float() for x in (query, key, value, beta, g)
    )
    batch, heads, length, k_dim = key.shape
    v_dim = value.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    query = query * (1 / (k_dim**0.5))
    v_beta, k_beta = value * beta[..., None], key * beta[..., None]
    query, key, value, k_beta, v_beta = (
        x.reshape(batch, heads, -1, chunk_size, x.shape[-1]) for x in (query, key, value, k_beta, v_beta)
    )
    g = g.reshape(batch, heads, -1, chunk_size).cumsum(dim=-1)
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()
    upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device))
    lower = -((k_beta @ key.transpose(-1, -2)) * decay).masked_fill(upper, 0)  # A, strictly lower
    eye = torch.eye(chunk_size, dtype=lower.dtype, device=lower.device)
    # the fallback's row loop computes T = (I - A)^-1 - I, then adds I: solve (I - A) X = I at once
    attn = torch.linalg.solve_triangular(eye - lower, eye.expand_as(lower), upper=False, unitriangular=True)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp()[..., None])
    state = (
        torch.zeros(batch, heads, k_dim, v_dim, dtype=value.dtype, device=value.device)
        if initial_state is None
        else initial_state.to(value)
    )
    out = torch.zeros_like(value)
    for i in range(value.shape[2]):
        q_i, k_i, v_i = query[:, :, i], key[:, :, i], value[:, :, i]
        intra = q_i @ k_i.transpose(-1, -2) * decay[:, :, i]  # decay is lower-triangular
        v_new = v_i - k_cumdecay[:, :, i] @ state
        out[:, :, i] = (q_i * g[:, :, i, :, None].exp()) @ state + intra @ v_new
        state = (
            state * g[:, :, i, -1, None, None].exp()
            + (k_i * (g[:, :, i, -1, None] - g[:, :, i]).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    out = out.reshape(batch, heads, -1, v_dim)[:, :, :length].transpose(1, 2).contiguous().to(dtype)
    return out, (state if output_final_state else None)


def padded_prefill(layer: torch.nn.Module, hidden_states: torch.Tensor, cache: PrefillCache) -> torch.Tensor:
    """``Qwen3_5GatedDeltaNet.forward`` for a batched prefill of right-padded rows.

    ``hidden_states`` [B, N, hidden]: row b's first ``cache.lengths[b]`` (>= 1) positions are real,
    the rest padding. The cache layer holds each row's state before them (``CacheRows.blank``'s
    zeros for a fresh sequence): ``conv_states`` [B, conv_dim, K] (the last K conv inputs) and
    ``recurrent_states`` [B, heads, Dk, Dv]; both are replaced by the states after each row's last
    real token, as the stock forward would leave them for that row alone. Returns [B, N, hidden];
    the outputs at padded positions are meaningless (callers drop them).
    """
    batch, width, _ = hidden_states.shape
    state = cache.layers[layer.layer_idx]
    lengths = cache.lengths
    real = torch.arange(width) < lengths[:, None]  # [B, N]
    kernel = layer.conv_kernel_size
    # conv inputs: the cached last K, then the new tokens' [B, conv_dim, K + N]
    inputs = torch.cat([state.conv_states, layer.in_proj_qkv(hidden_states).transpose(1, 2)], dim=-1)
    last = (lengths[:, None] + torch.arange(kernel))[:, None, :].expand(-1, inputs.shape[1], -1)
    conv_states = inputs.gather(2, last)  # the K inputs ending at the row's last real token
    mixed = F.silu(layer.conv1d(inputs)[:, :, : inputs.shape[-1]])[:, :, -width:]
    mixed = mixed.masked_fill(~real[:, None, :], 0.0).transpose(1, 2)  # q = k = v = 0 when padded
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(batch, width, -1, layer.head_k_dim)
    key = key.reshape(batch, width, -1, layer.head_k_dim)
    value = value.reshape(batch, width, -1, layer.head_v_dim)
    padded = ~real[..., None]
    beta = layer.in_proj_b(hidden_states).sigmoid().masked_fill(padded, 0.0)
    g = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(hidden_states).float() + layer.dt_bias)
    g = g.masked_fill(padded, 0.0)
    if layer.num_v_heads // layer.num_k_heads > 1:
        query = query.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
        key = key.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
    out, recurrent = layer.chunk_gated_delta_rule(
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=state.recurrent_states,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    state.conv_states, state.recurrent_states = conv_states, recurrent.to(state.recurrent_states.dtype)
    z = layer.in_proj_z(hidden_states).reshape(-1, layer.head_v_dim)
    out = layer.norm(out.reshape(-1, layer.head_v_dim), z).reshape(batch, width, -1)
    return layer.out_proj(out)


def _forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache_params: object = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """A Gated-DeltaNet layer's forward: ``padded_prefill`` under a ``PrefillCache``, else the stock one."""
    if isinstance(cache_params, PrefillCache):
        return padded_prefill(self, hidden_states, cache_params)
    return type(self).forward(
        self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
    )


def install(model: torch.nn.Module) -> int:
    """Give every Gated-DeltaNet layer of ``model`` the ``padded_prefill`` path (for a
    ``PrefillCache``) and, where it runs transformers' torch fallback rule (not the ``fla``
    kernel), ``chunk_gated_delta_rule``; returns how many layers it changed."""
    layers = 0
    for module in model.modules():
        if isinstance(module, Qwen3_5GatedDeltaNet):
            if module.chunk_gated_delta_rule is torch_chunk_gated_delta_rule:
                module.chunk_gated_delta_rule = chunk_gated_delta_rule
            module.forward = types.MethodType(_forward, module)
            layers += 1
    return layers
