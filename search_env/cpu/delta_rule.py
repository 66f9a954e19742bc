"""The chunked gated delta rule of Qwen3.5's Gated-DeltaNet layers, for prefill on CPU.

Same algorithm and signature as transformers' torch fallback
(``transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule``, Apache-2.0),
used when the ``fla`` kernels are absent, with one change: within a chunk the fallback inverts
the unit lower-triangular matrix ``I - A`` by a Python loop over the chunk's 63 rows (~4 ms per
call on the demo model, whatever the number of tokens); here one batched triangular solve does
it. Every prefill of the CPU generator calls this once per DeltaNet layer, so the loop was a
fixed cost per request. Results agree with the fallback to float rounding (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
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


def install(model: torch.nn.Module) -> int:
    """Use this rule in every Gated-DeltaNet layer of ``model`` that runs transformers' torch
    fallback (not the ``fla`` kernel); returns how many layers were switched."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    switched = 0
    for module in model.modules():
        if getattr(module, "chunk_gated_delta_rule", None) is torch_chunk_gated_delta_rule:
            module.chunk_gated_delta_rule = chunk_gated_delta_rule
            switched += 1
    return switched
