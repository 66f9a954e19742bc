"""Token-in/token-out generation with a Hugging Face causal LM, in verl's ``TokenOutput`` shape.

The one HF generation path of the project: the CPU ``hf`` rollout backend (patches) serves it
from a Ray actor during training, and the evaluation harness and the in-process agent-loop
tests call it directly. It is meant for tiny models on CPU: one request at a time, fp32.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.workers.rollout.replica import TokenOutput


class HFGenerator:
    """Holds one HF model and answers ``generate(prompt_ids, sampling_params)``.

    ``sampling_params`` uses verl's keys: ``temperature`` (0 = greedy), ``top_p``, ``top_k``
    (-1/0/None = off), ``max_tokens`` (new tokens; default ``max_new_tokens``), ``stop_token_ids``
    (added to the tokenizer's EOS). Log-probs are those of the unscaled model distribution.
    """

    def __init__(self, model_path: str, max_new_tokens: int = 1024, seed: int = 0, dtype: str = "float32"):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.eval()
        self.max_new_tokens = max_new_tokens
        self.global_steps: int | None = None
        self._lock = threading.Lock()
        self._rng = torch.Generator().manual_seed(seed)
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        eos_ids.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted({int(i) for i in eos_ids if i is not None})

    def load_weights(self, state_dict: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Copy weights in (names as in the HF state dict); returns how many tensors were loaded."""
        own = self.model.state_dict()
        missing = [k for k in state_dict if k not in own]
        if missing:
            raise KeyError(f"weights not in the rollout model: {missing[:5]} (… {len(missing)} in all)")
        with self._lock, torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor.to(own[name].dtype))
            if global_steps is not None:
                self.global_steps = global_steps
        return len(state_dict)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        max_tokens = int(sampling_params.get("max_tokens") or self.max_new_tokens)
        temperature = float(sampling_params.get("temperature", 1.0) or 0.0)
        top_p = float(sampling_params.get("top_p", 1.0) or 1.0)
        top_k = sampling_params.get("top_k") or -1
        stop_ids = set(self.eos_token_ids) | set(sampling_params.get("stop_token_ids") or [])
        with self._lock:
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
            past = None
            out_ids: list[int] = []
            log_probs: list[float] = []
            step_input = ids
            for _ in range(max(1, max_tokens)):
                out = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                token = self._pick(logits, temperature, top_p, int(top_k))
                out_ids.append(token)
                log_probs.append(float(logp[token]))
                if token in stop_ids:
                    break
                step_input = torch.tensor([[token]], dtype=torch.long)
        extra = {"global_steps": self.global_steps} if self.global_steps is not None else {}
        return TokenOutput(
            token_ids=out_ids, log_probs=log_probs, stop_reason="completed", extra_fields=extra
        )

    def _pick(self, logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        logits = logits / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self._rng))
